"""How fast ``ChunkWriter`` + ``FeatureStore`` get realistic activations into a zarr store on local disk.

Activations are resnet50 layer3 + layer4 shaped ((1024, 14, 14) and (2048, 7, 7) per sample), float16,
post-ReLU: a spatially smoothed Gaussian with a per-channel scale, clipped at 0 (about 50% zeros).
Variants, timed interleaved in one process (order rotates every repeat), median of the repeats:

    codec    zstd level 1 | zstd level 3 | blosc lz4 + shuffle | none
    threads  ChunkWriter writer threads 1 | 2 | 4
    layout   chunk: one object per chunk of C samples (C from the chunk target, 16 MiB by default)
             shard: one object per shard of 4 chunks (sharding codec), written whole
    target   extra chunk-size targets for zstd-1 / 2 threads / chunk layout (--targets-mib)

For each: GB/s of raw float16 written (wall clock, first submit to ``close()``), CPU seconds per raw
GB (all threads of the process: what the writer takes away from the forward on a small machine) and
the compression ratio (raw bytes / bytes on disk).

    python benchmarks/writer_throughput.py --json writer.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extract.capture.staging import HostStaging  # noqa: E402
from extract.job.plan import MAX_CHUNK_SIZE  # noqa: E402
from extract.store.arrays import dimension_names  # noqa: E402
from extract.store.chunks import Plan  # noqa: E402
from extract.store.store import FeatureStore  # noqa: E402
from extract.store.writer import ChunkWriter  # noqa: E402


def submit(writer: ChunkWriter, slot: Any, indices: torch.Tensor, labels: torch.Tensor) -> None:
    """``ChunkWriter.submit`` with every sample valid."""
    writer.submit(slot, indices, labels, np.ones(len(indices), dtype=bool))


SHAPES = {"layer3": (1024, 14, 14), "layer4": (2048, 7, 7)}
CODECS: dict[str, Any] = {
    "zstd-1": lambda: [ZstdCodec(level=1)],
    "zstd-3": lambda: [ZstdCodec(level=3)],
    "blosc-lz4-shuffle": lambda: [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")],
    "none": lambda: None,
}
SHARD_CHUNKS = 4


def activations(samples: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Post-ReLU-like float16 maps: smoothed noise (neighbouring pixels correlate) times a log-normal
    per-channel scale, shifted so about half the values are below zero, then clipped at zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((samples, *shape), generator=g)
    if len(shape) == 3:
        x = torch.nn.functional.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False) * 2.5
    scale = torch.exp(torch.randn((1, shape[0]) + (1,) * (len(shape) - 1), generator=g) * 0.7)
    return torch.relu(x * scale).to(torch.float16).numpy()


def create_store(
    path: Path, codec: str, layout: str, chunk_size: int, num_samples: int, empty_check: bool = False
) -> FeatureStore:
    """The layout of ``FeatureStore.create`` with any codec, optionally sharded (``shards`` of
    ``SHARD_CHUNKS`` chunks: then the writer's unit, the plan's chunk, is a shard)."""
    shutil.rmtree(path, ignore_errors=True)
    group = zarr.open_group(path, mode="w", attributes={"format": "extract-features", "layers": list(SHAPES)})
    features = group.create_group("features")
    object_rows = chunk_size * (SHARD_CHUNKS if layout == "shard" else 1)
    for layer, shape in SHAPES.items():
        features.create_array(
            layer,
            shape=(num_samples, *shape),
            chunks=(chunk_size, *shape),
            shards=(object_rows, *shape) if layout == "shard" else None,
            dtype="float16",
            fill_value=np.nan,
            compressors=CODECS[codec](),
            dimension_names=dimension_names(layer, len(shape)),
        )
    group.create_array("labels", shape=(num_samples,), chunks=(object_rows,), dtype="int64", fill_value=-1)
    group.create_array("valid", shape=(num_samples,), chunks=(object_rows,), dtype="bool", fill_value=False)
    group.create_array("done", shape=(-(-num_samples // object_rows),), chunks=(1,), dtype="bool", fill_value=False)
    return (EmptyCheckStore if empty_check else FeatureStore)(group, path)


class Case:
    def __init__(self, codec: str, threads: int, layout: str, target_mib: int, empty_check: bool = False) -> None:
        self.codec, self.threads, self.layout, self.target_mib = codec, threads, layout, target_mib
        self.empty_check = empty_check

    @property
    def key(self) -> str:
        check = "/empty-check" if self.empty_check else ""
        return f"{self.codec}/t{self.threads}/{self.layout}/{self.target_mib}MiB{check}"


class EmptyCheckStore(FeatureStore):
    """zarr's default ``write_empty_chunks=False``: every chunk is scanned for "all fill value" (NaN)."""

    def array(self, name: str) -> zarr.Array:
        if name not in self.opened:
            array: zarr.Array = self.group[name]  # type: ignore[assignment]
            self.opened[name] = array.with_config({"write_empty_chunks": False})
        return self.opened[name]


def run_case(case: Case, args: argparse.Namespace, data: dict[str, np.ndarray], workdir: Path) -> dict[str, float]:
    sample_bytes = max(math.prod(s) * 2 for s in SHAPES.values())
    chunk = min(MAX_CHUNK_SIZE, 2 ** int(math.log2(max(1, case.target_mib * 2**20 // sample_bytes))))
    rows = chunk * (SHARD_CHUNKS if case.layout == "shard" else 1)
    num_samples = max(args.samples, 2 * rows)
    store = create_store(workdir / "w.zarr", case.codec, case.layout, chunk, num_samples, case.empty_check)
    plan = Plan(num_samples, rows)
    staging = HostStaging(SHAPES, args.batch_size, torch.float16, torch.device("cpu"), slots=4)
    # Fill every slot once: the writer only reads them, so feeding costs no copies here.
    slots = [staging.acquire() for _ in range(staging.num_slots)]
    pool = len(next(iter(data.values())))
    for i, slot in enumerate(slots):
        for name, buffer in slot.buffers.items():
            start = (i * args.batch_size) % (pool - args.batch_size + 1)
            buffer.copy_(torch.from_numpy(data[name][start : start + args.batch_size]))
    for slot in slots:
        staging.release(slot)
    writer = ChunkWriter(store, staging, plan, SHAPES, threads=case.threads)
    labels = torch.zeros(args.batch_size, dtype=torch.int64)
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, num_samples, args.batch_size):
        n = min(args.batch_size, num_samples - start)
        slot = staging.acquire(writer.check)
        submit(writer, slot, torch.arange(start, start + n), labels[:n])
    writer.close()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    raw = num_samples * sum(math.prod(s) * 2 for s in SHAPES.values())
    stored = store.stored_bytes()
    return {
        "gb_per_s": raw / wall / 1e9,
        "cpu_s_per_gb": cpu / (raw / 1e9),
        "ratio": raw / stored,
        "chunk_samples": chunk,
        "object_samples": rows,
        "object_mib": rows * sum(math.prod(s) * 2 for s in SHAPES.values()) / 2**20,
        "files": sum(1 for f in (store.path / "features").rglob("*") if f.is_file()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layouts", nargs="+", default=["chunk", "shard"], choices=["chunk", "shard"])
    p.add_argument("--target-mib", type=int, default=16, help="chunk target (extract.job.plan: 16 MiB)")
    p.add_argument("--targets-mib", type=int, nargs="*", default=[4, 64], help="extra targets, zstd-1/t2/chunk")
    p.add_argument("--samples", type=int, default=256, help="samples written per case (at least 2 objects)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--no-empty-check-cases",
        dest="empty_check_cases",
        action="store_false",
        help="skip the cases with zarr's default write_empty_chunks=False (a scan of every chunk)",
    )
    p.add_argument("--workdir", default=None, help="where the store goes (default a temp dir, removed)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="extract-writer-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cases = [Case(c, t, lay, args.target_mib) for lay in args.layouts for c in args.codecs for t in args.threads]
    cases += [Case("zstd-1", 2, "chunk", mib) for mib in args.targets_mib if mib != args.target_mib]
    if args.empty_check_cases:
        cases += [Case(c, 2, "chunk", args.target_mib, empty_check=True) for c in ("zstd-1", "none")]
    data = {name: activations(64, shape, seed=i) for i, (name, shape) in enumerate(SHAPES.items())}
    zeros = float(np.mean([np.mean(v == 0) for v in data.values()]))
    print(f"{len(cases)} cases x {args.repeats} repeats; activations {zeros:.0%} zeros", flush=True)

    samples: dict[str, list[dict[str, float]]] = {c.key: [] for c in cases}
    try:
        run_case(cases[0], args, data, workdir)  # warm-up
        for repeat in range(args.repeats):
            shift = repeat * len(cases) // max(1, args.repeats)
            for case in cases[shift:] + cases[:shift]:
                samples[case.key].append(run_case(case, args, data, workdir))
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    rows = {}
    for case in cases:
        runs = samples[case.key]
        rows[case.key] = {
            "codec": case.codec,
            "threads": case.threads,
            "layout": case.layout,
            "target_mib": case.target_mib,
            "empty_check": case.empty_check,
            **{k: runs[0][k] for k in ("chunk_samples", "object_samples", "object_mib", "files", "ratio")},
            "gb_per_s": statistics.median(r["gb_per_s"] for r in runs),
            "cpu_s_per_gb": statistics.median(r["cpu_s_per_gb"] for r in runs),
            "gb_per_s_all": [r["gb_per_s"] for r in runs],
        }
    print()
    print(f"{'codec':<18} {'thr':>3} {'layout':<6} {'object':>10} {'GB/s':>6} {'CPU s/GB':>9} {'ratio':>6}  note")
    for row in rows.values():
        obj = f"{row['object_samples']}x ({row['object_mib']:.0f}M)"
        print(
            f"{row['codec']:<18} {row['threads']:>3} {row['layout']:<6} {obj:>10} "
            f"{row['gb_per_s']:>6.2f} {row['cpu_s_per_gb']:>9.2f} {row['ratio']:>6.2f}"
            + ("  write_empty_chunks=False" if row["empty_check"] else "")
        )
    result = {
        "environment": {
            "python": platform.python_version(),
            "zarr": zarr.__version__,
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "args": vars(args),
        "zeros_fraction": zeros,
        "shapes": SHAPES,
        "results": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
