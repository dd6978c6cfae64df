"""Training-read throughput of ``TokenStream`` on a token store, against the codec alone, a ``.npy``
memmap of the same rows and a ``datasets`` arrow cache of them read as SAELens reads its cached
activations.

A token store of one layer of (N_tokens, D) float16 rows (D=768 by default; residual-stream-like: a
Gaussian with a few large-magnitude dimensions, as GPT-2's have) is written through ``FeatureStore``
with the job defaults (chunk size from ``default_chunk_size``, zstd level 1, crc32c), in contexts of
128 tokens whose first is flagged special; the same rows go to a ``.npy`` and to a ``datasets``
arrow dataset saved with ``save_to_disk`` in SAELens's cache layout (one row per context, the layer
an ``Array2D(context, D)`` column, ``token_ids`` beside it). Then, median of ``--repeats``
interleaved epochs each (the order of the variants rotates every repeat):

    a  codec         zarr reads and decodes the layer in order, ``window`` chunks a call (decoded
                     concurrently, on every core) into one reused buffer: the codec alone on these cores
       load          ``open_features(...).load(layer, dtype=None)``, and into float32: the reader's whole-layer
                     read, into a fresh (page-faulting) array
    b  stream        one epoch of ``TokenStream(batch_size, window, dtype=float32)`` with W DataLoader
                     workers (``DataLoader(stream, batch_size=None, num_workers=W)``; W=0 in-process) and
                     T reading threads per process; ``f16`` keeps the stored float16
    c  npy           ``np.load(mmap_mode="r")``: the chunks in a shuffled order, copied to float32, shuffled
                     across windows of the same size and cut into batches as the stream does
    d  arrow         ``datasets.load_from_disk(...).with_format("torch", dtype=float32)`` read in slices of
                     32 contexts, in order, as SAELens's ``ActivationsStore`` reads a cache
                     (``_load_raw_llm_batch_from_cached``), then the same window shuffle (SAELens mixes in
                     its ``mixing_buffer``)
    e  ipc floor     a DataLoader worker yielding as many fresh float32 batches, gathered from a window in
                     memory (no store): what moving the batches between processes costs by itself

GB/s are of stored-dtype (float16) bytes, 1 GB = 1e9 B, and tokens/s of rows delivered; GB/CPU-s divides
by the CPU time the variant used (all threads and reaped worker processes). Everything is read warm:
the files were just written and each variant runs once untimed first, so all come from the page cache.

    python benchmarks/token_stream.py --json stream.json [--megabytes 300] [--dim 768] [--repeats 3]
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extract.job.plan import MAX_TOKEN_CHUNK_SIZE, default_chunk_size  # noqa: E402
from extract.read.features import _read, open_features  # noqa: E402
from extract.read.tokens import TokenStream  # noqa: E402
from extract.store.chunks import Plan  # noqa: E402
from extract.store.store import FeatureStore  # noqa: E402
from extract.store.text_arrays import TextArrays  # noqa: E402

LAYER = "blocks.6.hook_resid_post"
CONTEXT = 128


def activations(rows: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """Residual-stream-like float16 rows: N(0, 1) with a few dimensions 20x larger (GPT-2's outlier dims)."""
    values = rng.standard_normal((rows, dim), dtype=np.float32)
    values[:, :: max(1, dim // 4)] *= 20
    return values.astype(np.float16)


def make_data(folder: Path, megabytes: float, dim: int, chunk_size: int | None) -> tuple[Path, Path, Path, int, int]:
    import datasets

    row_bytes = dim * 2
    num_tokens = max(CONTEXT, int(megabytes * 1e6) // row_bytes // CONTEXT * CONTEXT)
    contexts = num_tokens // CONTEXT
    plan = Plan(num_tokens, chunk_size or default_chunk_size(num_tokens, row_bytes, largest=MAX_TOKEN_CHUNK_SIZE))
    store_path, npy_path, arrow_path = folder / "tokens.zarr", folder / "tokens.npy", folder / "arrow"
    rng = np.random.default_rng(0)
    token_ids = rng.integers(1, 50000, num_tokens, dtype=np.int32)
    special = np.zeros(num_tokens, dtype=bool)
    special[::CONTEXT] = True
    token_ids[special] = 0
    text = TextArrays(
        offsets=np.arange(contexts + 1, dtype=np.int64) * CONTEXT,
        labels=np.full(contexts, -1, dtype=np.int64),
        valid=np.ones(contexts, dtype=bool),
    )
    store = FeatureStore.create(
        store_path,
        shapes={LAYER: (dim,)},
        num_samples=num_tokens,
        chunk_size=plan.chunk_size,
        dtype="float16",
        compressor="zstd",
        attrs={"status": "running", "layers": [LAYER], "num_samples": num_tokens, "chunk_size": plan.chunk_size},
        kind="tokens",
        text=text,
    )
    npy = np.lib.format.open_memmap(npy_path, mode="w+", dtype=np.float16, shape=(num_tokens, dim))
    for chunk in range(plan.num_chunks):
        start, stop = plan.bounds(chunk)
        npy[start:stop] = values = activations(stop - start, dim, rng)
        columns = {"token_ids": token_ids[start:stop], "special": special[start:stop]}
        store.write_chunk(chunk, start, stop, {LAYER: values}, None, None, columns)
    npy.flush()
    del npy
    store.update_attrs(status="complete")
    features = datasets.Features(
        {
            LAYER: datasets.Array2D(shape=(CONTEXT, dim), dtype="float16"),
            "token_ids": datasets.Sequence(datasets.Value("int32"), length=CONTEXT),
        }
    )

    def rows() -> Iterator[dict[str, Any]]:
        source = np.load(npy_path, mmap_mode="r")
        for c in range(contexts):
            yield {
                LAYER: source[c * CONTEXT : (c + 1) * CONTEXT],
                "token_ids": token_ids[c * CONTEXT : (c + 1) * CONTEXT],
            }

    datasets.Dataset.from_generator(rows, features=features, cache_dir=str(folder / "hf-cache")).save_to_disk(
        str(arrow_path)
    )
    return store_path, npy_path, arrow_path, num_tokens, plan.chunk_size


def shuffled_batches(blocks: Iterator[torch.Tensor], window_rows: int, batch: int, rng: np.random.Generator) -> int:
    """The stream's shuffle for the baselines: gather ``window_rows`` rows, permute them, cut batches of
    ``batch`` (fresh tensors, as a consumer gets them), carry the rest; the rows delivered."""
    delivered, pending, rows = 0, [], 0
    for block in [*blocks, None]:
        if block is not None:
            pending.append(block)
            rows += len(block)
            if rows < window_rows:
                continue
        if not pending:
            break
        window = torch.cat(pending) if len(pending) > 1 else pending[0]
        order = torch.from_numpy(rng.permutation(len(window)))
        full = len(order) // batch * batch if block is not None else len(order)
        for at in range(0, full, batch):
            delivered += len(window.index_select(0, order[at : at + batch]))
        pending = [window.index_select(0, order[full:])] if full < len(order) else []
        rows = len(order) - full
    return delivered


class Batches(torch.utils.data.IterableDataset):
    """The DataLoader's own cost: fresh (batch, D) float32 batches gathered from one in-memory window, as
    many rows as the store has, no reading at all. Through a worker this is the IPC floor."""

    def __init__(self, num_tokens: int, batch: int, dim: int, window_rows: int) -> None:
        self.num_tokens, self.batch, self.dim, self.window_rows = num_tokens, batch, dim, window_rows

    def __iter__(self) -> Iterator[torch.Tensor]:
        window = torch.zeros((self.window_rows, self.dim))
        order = torch.randperm(self.window_rows)
        for at in range(0, self.num_tokens, self.batch):
            rows = min(self.batch, self.num_tokens - at)
            yield window.index_select(0, order[at % (self.window_rows - rows + 1) :][:rows])


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (DataLoader workers), all threads."""
    return sum(
        r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def timed(variants: dict[str, Callable[[], Any]], repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and CPU seconds per variant, interleaved with the order rotating each repeat; each runs
    once untimed first (page cache, zarr's event loop and threads, DataLoader imports)."""
    for run in variants.values():
        run()
    names = list(variants)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            start, start_cpu = time.perf_counter(), cpu_seconds()
            variants[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(cpu_seconds() - start_cpu)
    median = statistics.median
    return {name: median(v) for name, v in wall.items()}, {name: median(v) for name, v in cpu.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=300, help="raw float16 size of the layer (default 300)")
    p.add_argument("--dim", type=int, default=768, help="D, values per token (default 768)")
    p.add_argument("--chunk-size", type=int, help="tokens per chunk (default: what a job would choose)")
    p.add_argument("--batch-size", type=int, default=4096, help="tokens per batch (default 4096)")
    p.add_argument("--window", type=int, default=4, help="TokenStream window, chunks (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed epochs per variant, median reported (default 3)")
    p.add_argument("--variants", help="comma-separated names to run (default: all)")
    p.add_argument("--dir", type=Path, help="where to write the data (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    load_before = round(os.getloadavg()[0], 2)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        import datasets

        datasets.disable_progress_bars()
        store_path, npy_path, arrow_path, num_tokens, chunk_size = make_data(
            Path(tmp), args.megabytes, args.dim, args.chunk_size
        )
        features = open_features(store_path)
        raw_bytes = features.array(LAYER).nbytes
        stored_bytes = features.store.stored_bytes()
        window_rows = args.window * chunk_size
        epochs = iter(range(10**6))

        def stream(workers: int, threads: int, dtype: str = "float32") -> Callable[[], None]:
            tokens = TokenStream(store_path, LAYER, args.batch_size, window=args.window, threads=threads, dtype=dtype)

            def epoch() -> None:
                tokens.set_epoch(next(epochs))
                batches = DataLoader(tokens, batch_size=None, num_workers=workers) if workers else tokens
                assert sum(len(batch) for batch in batches) == num_tokens

            return epoch

        def npy_windows() -> None:
            array = np.load(npy_path, mmap_mode="r")
            rng = np.random.default_rng(next(epochs))
            order = rng.permutation(features.num_chunks)
            blocks = (
                torch.from_numpy(np.asarray(array[c * chunk_size : (c + 1) * chunk_size], dtype=np.float32))
                for c in order
            )
            assert shuffled_batches(blocks, window_rows, args.batch_size, rng) == num_tokens

        def arrow_sae() -> None:
            cache = datasets.load_from_disk(str(arrow_path))
            cache.set_format(type="torch", columns=[LAYER, "token_ids"], dtype=torch.float32)
            prompts = 32  # store_batch_size_prompts: contexts per slice
            blocks = (
                cache[start : start + prompts][LAYER].reshape(-1, args.dim) for start in range(0, len(cache), prompts)
            )
            assert (
                shuffled_batches(blocks, window_rows, args.batch_size, np.random.default_rng(next(epochs)))
                == num_tokens
            )

        array = features.array(LAYER)
        reused = np.empty((window_rows, args.dim), dtype=np.float16)

        def codec() -> None:
            for start in range(0, num_tokens, window_rows):
                _read(array, slice(start, min(start + window_rows, num_tokens)), reused)

        def loader_floor(workers: int) -> None:
            batches = Batches(num_tokens, args.batch_size, args.dim, window_rows)
            assert sum(len(b) for b in DataLoader(batches, batch_size=None, num_workers=workers)) == num_tokens

        variants: dict[str, Callable[[], Any]] = {
            "a_codec_float16": codec,
            "a_load_float16": lambda: features.load(LAYER, dtype=None),
            "a_load_float32": lambda: features.load(LAYER),
            "b_stream_w0_t0": stream(0, 0),
            "b_stream_w0_t2": stream(0, 2),
            "b_stream_w1_t2": stream(1, 2),
            "b_stream_w2_t1": stream(2, 1),
            "b_stream_w2_t2": stream(2, 2),
            "b_stream_f16_w0_t2": stream(0, 2, "float16"),
            "b_stream_f16_w1_t2": stream(1, 2, "float16"),
            "c_npy_mmap_windows": npy_windows,
            "e_ipc_floor_w1": lambda: loader_floor(1),
            "d_arrow_sae_slices": arrow_sae,
        }
        if args.variants:
            variants = {name: run for name, run in variants.items() if name in args.variants.split(",")}
        seconds, cpu = timed(variants, args.repeats)

    rates = {name: raw_bytes / s / 1e9 for name, s in seconds.items()}
    tokens_per_s = {name: num_tokens / s for name, s in seconds.items()}
    per_cpu = {name: raw_bytes / max(s, 1e-9) / 1e9 for name, s in cpu.items()}
    codec = rates.get("a_codec_float16")
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "versions": {"torch": torch.__version__, "zarr": zarr.__version__, "numpy": np.__version__},
        "load_average_1min": {"before": load_before, "after": round(os.getloadavg()[0], 2)},
        "num_tokens": num_tokens,
        "dim": args.dim,
        "chunk_size": chunk_size,
        "num_chunks": features.num_chunks,
        "raw_bytes": raw_bytes,
        "stored_bytes": stored_bytes,
        "compression_ratio": round(raw_bytes / stored_bytes, 3),
        "batch_size": args.batch_size,
        "window": args.window,
        "repeats": args.repeats,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "gb_per_s": {k: round(v, 3) for k, v in rates.items()},
        "tokens_per_s": {k: round(v) for k, v in tokens_per_s.items()},
        "cpu_seconds": {k: round(v, 4) for k, v in cpu.items()},
        "gb_per_cpu_second": {k: round(v, 3) for k, v in per_cpu.items()},
        "stream_over_codec": {k: round(v / codec, 3) for k, v in rates.items() if k.startswith("b_") and codec},
    }
    print(
        f"{num_tokens} tokens x {args.dim} float16 = {raw_bytes / 1e6:.0f} MB raw, {stored_bytes / 1e6:.0f} MB stored "
        f"(zstd-1, {result['compression_ratio']}x), {features.num_chunks} chunks of {chunk_size}, batch "
        f"{args.batch_size}, window {args.window}"
    )
    print(f"{'variant':<22} {'seconds':>8} {'GB/s':>7} {'Mtok/s':>7} {'CPU s':>7} {'GB/CPU-s':>9} {'/codec':>7}")
    for name, s in seconds.items():
        ratio = f"{rates[name] / codec:>7.2f}" if codec else ""
        print(
            f"{name:<22} {s:>8.3f} {rates[name]:>7.2f} {tokens_per_s[name] / 1e6:>7.2f} {cpu[name]:>7.3f} "
            f"{per_cpu[name]:>9.2f} {ratio}"
        )
    print(f"1-min load average {load_before} -> {result['load_average_1min']['after']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
