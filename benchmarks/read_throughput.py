"""Read throughput of a store against a plain ``.npy`` of the same values.

One layer of realistic post-ReLU float16 activations (a ResNet layer3-like map, (256, 14, 14) by
default; about half the values are exact zeros) is written through ``FeatureStore`` with the job
defaults (chunk size from ``default_chunk_size``, zstd level 1), and the same array to a ``.npy``.
Then, median of ``--repeats`` interleaved timings each:

    a  reader     ``open_features(...).load(layer, dtype=None)``: the whole layer, sequentially
    a32           the same with the default ``dtype="float32"`` (decode + convert)
    b  dataset    one shuffled epoch of ``FeatureDataset`` + ``ChunkShuffleSampler`` through a
                  ``DataLoader`` with ``--workers`` workers (per-sample items, collated into batches)
    c  npy        ``np.load(mmap_mode="r")`` copied into memory sequentially, chunk by chunk

GB/s are of stored-dtype (float16) bytes, 1 GB = 1e9 B; GB/CPU-s divides by the CPU time the variant
used (all threads and worker processes), which other load on the machine barely changes. Everything is read warm: the files were just
written and each variant runs once untimed first, so both sides come from the page cache and the
comparison is decode cost against memcpy, not disk.

    python benchmarks/read_throughput.py --json read.json [--megabytes 256] [--shape 256 14 14]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extract.job.plan import default_chunk_size  # noqa: E402
from extract.read.dataset import ChunkShuffleSampler, FeatureDataset  # noqa: E402
from extract.read.features import open_features  # noqa: E402
from extract.store.chunks import Plan  # noqa: E402
from extract.store.store import FeatureStore  # noqa: E402

LAYER = "layer3"


def activations(rows: int, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Post-ReLU-like float16 values: per-channel offsets make some channels mostly zero, others dense,
    and about half of all values exactly zero, as in a trained ResNet's intermediate maps."""
    channel_bias = np.linspace(-1.2, 0.8, shape[0], dtype=np.float32).reshape(1, shape[0], *([1] * (len(shape) - 1)))
    values = rng.standard_normal((rows, *shape), dtype=np.float32) + channel_bias
    return np.maximum(values, 0).astype(np.float16)


def make_data(
    folder: Path, megabytes: float, shape: tuple[int, ...], chunk_size: int | None, compressor: str = "zstd"
) -> tuple[Path, Path, int, int]:
    row_bytes = int(np.prod(shape)) * 2
    num_samples = max(1, int(megabytes * 1e6) // row_bytes)
    plan = Plan(num_samples, chunk_size or default_chunk_size(num_samples, row_bytes))
    store_path, npy_path = folder / "read.zarr", folder / "read.npy"
    store = FeatureStore.create(
        store_path,
        shapes={LAYER: shape},
        num_samples=num_samples,
        chunk_size=plan.chunk_size,
        dtype="float16",
        compressor=compressor,
        attrs={"status": "running", "layers": [LAYER], "num_samples": num_samples, "chunk_size": plan.chunk_size},
    )
    npy = np.lib.format.open_memmap(npy_path, mode="w+", dtype=np.float16, shape=(num_samples, *shape))
    rng = np.random.default_rng(0)
    for chunk in range(plan.num_chunks):
        start, stop = plan.bounds(chunk)
        values = activations(stop - start, shape, rng)
        labels = np.arange(start, stop) % 10
        store.write_chunk(chunk, start, stop, {LAYER: values}, labels, np.ones(stop - start, dtype=bool))
        npy[start:stop] = values
    npy.flush()
    del npy
    store.update_attrs(status="complete")
    return store_path, npy_path, num_samples, plan.chunk_size


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (DataLoader workers), all threads."""
    return sum(
        r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def timed(variants: dict[str, Callable[[], Any]], repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall seconds and median CPU seconds per variant. The variants are interleaved, so a slow
    spell on a shared machine hits all of them rather than one; each runs once untimed first (page
    cache, zarr's event loop and threads, DataLoader imports). CPU seconds say what a variant costs
    whatever else the machine is doing."""
    for run in variants.values():
        run()
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start, start_cpu = time.perf_counter(), cpu_seconds()
            run()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(cpu_seconds() - start_cpu)
    median = statistics.median
    return {name: median(values) for name, values in wall.items()}, {name: median(v) for name, v in cpu.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=256, help="raw float16 size of the layer (default 256)")
    p.add_argument("--shape", type=int, nargs="+", default=[256, 14, 14], help="per-sample shape (default 256 14 14)")
    p.add_argument("--chunk-size", type=int, help="samples per chunk (default: what a job would choose)")
    p.add_argument("--compressor", default="zstd", help="zstd (default, as jobs write) | blosc | none")
    p.add_argument("--batch-size", type=int, default=256, help="DataLoader batch size for (b)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers for (b) (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant, median reported (default 5)")
    p.add_argument("--dir", type=Path, help="where to write the data (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    load_before = round(os.getloadavg()[0], 2)  # other work on the machine skews every variant

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store_path, npy_path, num_samples, chunk_size = make_data(
            Path(tmp), args.megabytes, tuple(args.shape), args.chunk_size, args.compressor
        )
        features = open_features(store_path)
        raw_bytes = features.array(LAYER).nbytes
        stored_bytes = sum(f.stat().st_size for f in (store_path / "features").rglob("*") if f.is_file())
        zero_fraction = float((features.load(LAYER, slice(0, chunk_size), dtype=None) == 0).mean())

        def npy_sequential() -> None:
            array = np.load(npy_path, mmap_mode="r")
            out = np.empty(array.shape, array.dtype)
            for start in range(0, num_samples, chunk_size):
                out[start : start + chunk_size] = array[start : start + chunk_size]

        dataset = FeatureDataset(store_path, LAYER)
        sampler = ChunkShuffleSampler(num_samples, chunk_size, args.batch_size, num_workers=args.workers, seed=0)
        epochs = iter(range(10**6))

        def dataset_epoch() -> None:
            sampler.set_epoch(next(epochs))
            loader = DataLoader(dataset, batch_sampler=sampler, num_workers=args.workers)
            assert sum(len(labels) for _, labels in loader) == num_samples

        assert np.array_equal(features.load(LAYER, slice(0, 3), dtype=None), np.load(npy_path, mmap_mode="r")[:3])
        seconds, cpu = timed(
            {
                "a_reader_float16": lambda: features.load(LAYER, dtype=None),
                "a_reader_float32": lambda: features.load(LAYER),
                "b_dataset_shuffled_epoch": dataset_epoch,
                "c_npy_mmap_sequential": npy_sequential,
            },
            args.repeats,
        )

    rates = {name: raw_bytes / s / 1e9 for name, s in seconds.items()}
    per_cpu = {name: raw_bytes / max(s, 1e-9) / 1e9 for name, s in cpu.items()}
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "versions": {"torch": torch.__version__, "zarr": zarr.__version__, "numpy": np.__version__},
        "zarr_config": {"async.concurrency": zarr.config.get("async.concurrency")},
        "load_average_1min": {"before": load_before, "after": round(os.getloadavg()[0], 2)},
        "num_samples": num_samples,
        "shape": args.shape,
        "chunk_size": chunk_size,
        "compressor": args.compressor,
        "raw_bytes": raw_bytes,
        "stored_bytes": stored_bytes,
        "compression_ratio": round(raw_bytes / stored_bytes, 3),
        "zero_fraction": round(zero_fraction, 3),
        "batch_size": args.batch_size,
        "workers": args.workers,
        "repeats": args.repeats,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "gb_per_s": {k: round(v, 3) for k, v in rates.items()},
        "cpu_seconds": {k: round(v, 4) for k, v in cpu.items()},
        "gb_per_cpu_second": {k: round(v, 3) for k, v in per_cpu.items()},
        "a_over_c": round(rates["a_reader_float16"] / rates["c_npy_mmap_sequential"], 3),
    }
    print(
        f"{num_samples} samples x {args.shape} float16 = {raw_bytes / 1e6:.0f} MB raw, {stored_bytes / 1e6:.0f} MB "
        f"stored ({args.compressor}, {result['compression_ratio']}x, {zero_fraction:.0%} zeros), chunk {chunk_size}"
    )
    print(f"{'variant':<28} {'seconds':>8} {'GB/s':>7} {'CPU s':>7} {'GB/CPU-s':>9}")
    for name, s in seconds.items():
        print(f"{name:<28} {s:>8.3f} {rates[name]:>7.2f} {cpu[name]:>7.3f} {per_cpu[name]:>9.2f}")
    print(
        f"(a) / (c) = {result['a_over_c']:.2f}  (target >= 0.5); 1-min load average {load_before} -> {result['load_average_1min']['after']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
