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
    f  sources       several sources of the same tokens, in-process with 2 threads (issue 31): a second
                     layer in the store (``transcoder``: ``TokenStream(store, [L, L2])``, a dict) and a
                     second store of the same tokens (``crosscoder``: ``TokenStream([store, other], L,
                     stack=True)``, one (batch, 2, D) tensor, after the stores' alignment check), each
                     against ``codec_pair``, the codec decoding both arrays in order
    g  patches       an image store of ``--images`` x 197 tokens x D float16 (a ViT-B/16 block at 224 px kept
                     whole, ``--pool none``; about ``--megabytes`` too), one epoch of ``TokenStream(store,
                     layer, exclude="first:1")`` (every (image, patch) row but the CLS tokens), against
                     ``codec_vit``, the codec alone on that array

GB/s are of stored-dtype (float16) bytes read (both arrays for f), 1 GB = 1e9 B, and tokens/s of rows delivered; GB/CPU-s divides
by the CPU time the variant used (all threads and reaped worker processes). Everything is read warm:
the files were just written and each variant runs once untimed first, so all come from the page cache.

    python benchmarks/token_stream.py --json stream.json [--megabytes 300] [--dim 768] [--repeats 3]
    python benchmarks/token_stream.py --direct [--megabytes 80.25] [--repeats 7]   # issue 37: see direct_main
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
from extract.read.direct import direct_chunks  # noqa: E402
from extract.read.features import _read, open_features  # noqa: E402
from extract.read.tokens import TokenStream, _convert  # noqa: E402
from extract.store.chunks import Plan  # noqa: E402
from extract.store.store import FeatureStore  # noqa: E402
from extract.store.text_arrays import TextArrays  # noqa: E402

LAYER = "blocks.6.hook_resid_post"
LAYER2 = "blocks.7.hook_resid_post"  # the transcoder pair's second layer, in the same store
CONTEXT = 128
PATCHES = 197  # a ViT-B/16's tokens at 224 px: CLS and 14 x 14 patches


def activations(rows: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """Residual-stream-like float16 rows: N(0, 1) with a few dimensions 20x larger (GPT-2's outlier dims)."""
    values = rng.standard_normal((rows, dim), dtype=np.float32)
    values[:, :: max(1, dim // 4)] *= 20
    return values.astype(np.float16)


def token_store(
    path: Path,
    plan: Plan,
    dim: int,
    token_ids: np.ndarray,
    special: np.ndarray,
    layers: list[str],
    seed: int,
    dtype: str = "float16",
    compressor: str = "zstd",
) -> np.ndarray:
    """A complete token store of ``layers`` over ``token_ids``, in contexts of ``CONTEXT``; returns its
    first layer's rows as stored (bfloat16: the bits, ``uint16``)."""
    num_tokens, contexts = plan.num_samples, plan.num_samples // CONTEXT
    text = TextArrays(
        offsets=np.arange(contexts + 1, dtype=np.int64) * CONTEXT,
        labels=np.full(contexts, -1, dtype=np.int64),
        valid=np.ones(contexts, dtype=bool),
    )
    store = FeatureStore.create(
        path,
        shapes=dict.fromkeys(layers, (dim,)),
        num_samples=num_tokens,
        chunk_size=plan.chunk_size,
        dtype=dtype,
        compressor=compressor,
        attrs={"status": "running", "layers": layers, "num_samples": num_tokens, "chunk_size": plan.chunk_size},
        kind="tokens",
        text=text,
    )
    rng = np.random.default_rng(seed)
    first = np.empty((num_tokens, dim), dtype=np.uint16 if dtype == "bfloat16" else np.float16)
    for chunk in range(plan.num_chunks):
        start, stop = plan.bounds(chunk)
        values = {layer: stored(activations(stop - start, dim, rng), dtype) for layer in layers}
        first[start:stop] = values[layers[0]]
        columns = {"token_ids": token_ids[start:stop], "special": special[start:stop]}
        store.write_chunk(chunk, start, stop, values, None, None, columns)
    store.update_attrs(status="complete")
    return first


def stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """float16 ``values`` as a layer of ``dtype`` stores them (bfloat16: its bits)."""
    if dtype == "bfloat16":
        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16).view(torch.uint16).numpy()
    return values.astype(dtype)


def patch_store(path: Path, megabytes: float, dim: int) -> tuple[int, int]:
    """A complete image store of one ViT block kept whole, (N, PATCHES, dim) float16 in layout NLC, with
    the job's default chunk size; returns (N, chunk size)."""
    image_bytes = PATCHES * dim * 2
    images = max(4, int(megabytes * 1e6) // image_bytes)
    plan = Plan(images, default_chunk_size(images, image_bytes))
    store = FeatureStore.create(
        path,
        shapes={LAYER: (PATCHES, dim)},
        num_samples=images,
        chunk_size=plan.chunk_size,
        dtype="float16",
        compressor="zstd",
        attrs={"status": "running", "layers": [LAYER], "num_samples": images, "chunk_size": plan.chunk_size},
        layouts={LAYER: "NLC"},
    )
    rng = np.random.default_rng(2)
    for chunk in range(plan.num_chunks):
        start, stop = plan.bounds(chunk)
        values = activations((stop - start) * PATCHES, dim, rng).reshape(stop - start, PATCHES, dim)
        labels, valid = np.zeros(stop - start, dtype=np.int64), np.ones(stop - start, dtype=bool)
        store.write_chunk(chunk, start, stop, {LAYER: values}, labels, valid)
    store.update_attrs(status="complete")
    return images, plan.chunk_size


def make_data(
    folder: Path, megabytes: float, dim: int, chunk_size: int | None, sources: bool
) -> tuple[Path, Path, Path, int, int]:
    """The token store (with a second layer and a second store of the same tokens when ``sources``),
    the ``.npy`` and the arrow cache of its first layer."""
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
    layers = [LAYER, LAYER2] if sources else [LAYER]
    npy = np.lib.format.open_memmap(npy_path, mode="w+", dtype=np.float16, shape=(num_tokens, dim))
    npy[:] = token_store(store_path, plan, dim, token_ids, special, layers, seed=0)
    npy.flush()
    del npy
    if sources:  # another model's rows of the same tokens
        token_store(folder / "other.zarr", plan, dim, token_ids, special, [LAYER], seed=1)
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
    p.add_argument("--no-sources", action="store_true", help="leave out the f_ and g_ variants and their data")
    p.add_argument("--dir", type=Path, help="where to write the data (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--direct", action="store_true", help="only the h_ variants: the direct read of uncompressed stores (issue 37)"
    )
    args = p.parse_args(argv)
    if args.direct:
        return direct_main(args)
    torch.set_num_threads(os.cpu_count() or 1)
    load_before = round(os.getloadavg()[0], 2)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        import datasets

        datasets.disable_progress_bars()
        sources = not args.no_sources
        store_path, npy_path, arrow_path, num_tokens, chunk_size = make_data(
            Path(tmp), args.megabytes, args.dim, args.chunk_size, sources
        )
        features = open_features(store_path)
        raw_bytes = features.array(LAYER).nbytes
        stored_bytes = features.store.stored_bytes()
        ratio = sum(features.array(layer).nbytes for layer in features.layers) / stored_bytes  # every layer's
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

        extra, read_bytes, codec_of = source_variants(Path(tmp), args, epochs) if sources else ({}, {}, {})
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
            **extra,
        }
        if args.variants:
            variants = {name: run for name, run in variants.items() if name in args.variants.split(",")}
        seconds, cpu = timed(variants, args.repeats)

    nbytes = {name: read_bytes.get(name, (raw_bytes, 0))[0] for name in seconds}
    rows = {name: read_bytes.get(name, (0, num_tokens))[1] for name in seconds}
    rates = {name: nbytes[name] / s / 1e9 for name, s in seconds.items()}
    tokens_per_s = {name: rows[name] / s for name, s in seconds.items()}
    per_cpu = {name: nbytes[name] / max(s, 1e-9) / 1e9 for name, s in cpu.items()}
    reference = {name: rates.get(codec_of.get(name, "a_codec_float16")) for name in seconds}
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
        "compression_ratio": round(ratio, 3),
        "batch_size": args.batch_size,
        "window": args.window,
        "repeats": args.repeats,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "gb_per_s": {k: round(v, 3) for k, v in rates.items()},
        "tokens_per_s": {k: round(v) for k, v in tokens_per_s.items()},
        "cpu_seconds": {k: round(v, 4) for k, v in cpu.items()},
        "gb_per_cpu_second": {k: round(v, 3) for k, v in per_cpu.items()},
        "stream_over_codec": {
            k: round(v / reference[k], 3) for k, v in rates.items() if k.startswith(("b_", "f_", "g_")) and reference[k]
        },
    }
    print(
        f"{num_tokens} tokens x {args.dim} float16 = {raw_bytes / 1e6:.0f} MB raw a layer, {stored_bytes / 1e6:.0f} MB "
        f"stored ({len(features.layers)} layer{'s' if len(features.layers) > 1 else ''}) "
        f"(zstd-1, {result['compression_ratio']}x), {features.num_chunks} chunks of {chunk_size}, batch "
        f"{args.batch_size}, window {args.window}"
    )
    print(f"{'variant':<22} {'seconds':>8} {'GB/s':>7} {'Mtok/s':>7} {'CPU s':>7} {'GB/CPU-s':>9} {'/codec':>7}")
    for name, s in seconds.items():
        ratio = f"{rates[name] / reference[name]:>7.2f}" if reference[name] else ""
        print(
            f"{name:<22} {s:>8.3f} {rates[name]:>7.2f} {tokens_per_s[name] / 1e6:>7.2f} {cpu[name]:>7.3f} "
            f"{per_cpu[name]:>9.2f} {ratio}"
        )
    print(f"1-min load average {load_before} -> {result['load_average_1min']['after']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def source_variants(
    folder: Path, args: argparse.Namespace, epochs: Iterator[int]
) -> tuple[dict[str, Callable[[], Any]], dict[str, tuple[int, int]], dict[str, str]]:
    """The f_ and g_ variants (see the module's docstring): {name: run}, {name: (bytes read, rows
    delivered)}, {name: the codec variant it is compared with}."""
    store, other = folder / "tokens.zarr", folder / "other.zarr"
    images, image_chunk = patch_store(folder / "vit.zarr", args.megabytes, args.dim)
    features = [open_features(store), open_features(other), open_features(folder / "vit.zarr")]
    pair = [features[0].array(LAYER), features[0].array(LAYER2), features[1].array(LAYER)]
    vit = features[2].array(LAYER)
    num_tokens, chunk_size = features[0].num_samples, features[0].chunk_size
    buffers = [np.empty((args.window * chunk_size, args.dim), np.float16) for _ in range(2)]
    vit_buffer = np.empty((args.window * image_chunk, PATCHES, args.dim), np.float16)

    def codec_pair() -> None:
        for start in range(0, num_tokens, len(buffers[0])):
            for array, buffer in zip(pair[:2], buffers, strict=True):
                _read(array, slice(start, min(start + len(buffer), num_tokens)), buffer)

    def codec_vit() -> None:
        for start in range(0, images, len(vit_buffer)):
            _read(vit, slice(start, min(start + len(vit_buffer), images)), vit_buffer)

    def stream(make: Callable[[], TokenStream], rows: int) -> Callable[[], None]:
        tokens = make()

        def epoch() -> None:
            tokens.set_epoch(next(epochs))
            assert sum(len(batch) for batch in tokens) == rows

        return epoch

    common = {"window": args.window, "threads": 2}
    patch_rows = images * (PATCHES - 1)
    variants = {
        "f_codec_pair": codec_pair,
        "f_transcoder_pair_w0_t2": stream(
            lambda: _Single(TokenStream(store, [LAYER, LAYER2], args.batch_size, **common)), num_tokens
        ),
        "f_crosscoder_stack_w0_t2": stream(
            lambda: TokenStream([store, other], LAYER, args.batch_size, stack=True, **common), num_tokens
        ),
        "g_codec_vit": codec_vit,
        "g_vit_patches_w0_t2": stream(
            lambda: TokenStream(folder / "vit.zarr", LAYER, args.batch_size, exclude="first:1", **common), patch_rows
        ),
    }
    pair_bytes, vit_bytes = 2 * pair[0].nbytes, vit.nbytes
    read_bytes = {
        "f_codec_pair": (pair_bytes, num_tokens),
        "f_transcoder_pair_w0_t2": (pair_bytes, num_tokens),
        "f_crosscoder_stack_w0_t2": (pair_bytes, num_tokens),
        "g_codec_vit": (vit_bytes, images * PATCHES),
        "g_vit_patches_w0_t2": (vit_bytes, patch_rows),
    }
    codec_of = {name: "f_codec_pair" if name.startswith("f_") else "g_codec_vit" for name in read_bytes}
    return variants, read_bytes, codec_of


class _Single:
    """A dict-yielding stream counted by its rows: ``len`` of one of its tensors."""

    def __init__(self, stream: TokenStream) -> None:
        self.stream = stream

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (batch[LAYER] for batch in self.stream)


class _ThroughZarr(TokenStream):
    """The stream as it was before the direct read: every chunk decoded by zarr."""

    def _direct_chunks(self, features: Any, layer: str) -> None:
        return None


def direct_variants(
    folder: Path, args: argparse.Namespace, epochs: Iterator[int], dtype: str
) -> tuple[dict[str, Callable[[], Any]], int, int]:
    """The h_ variants of one stored ``dtype`` (the docstring of ``direct_main``): {name: run}, the rows and
    the chunk size."""
    row_bytes = args.dim * 2
    num_tokens = max(CONTEXT, int(args.megabytes * 1e6) // row_bytes // CONTEXT * CONTEXT)
    plan = Plan(num_tokens, args.chunk_size or default_chunk_size(num_tokens, row_bytes, largest=MAX_TOKEN_CHUNK_SIZE))
    token_ids = np.random.default_rng(0).integers(1, 50000, num_tokens, dtype=np.int32)
    special = np.zeros(num_tokens, dtype=bool)
    path, npy_path = folder / f"{dtype}.zarr", folder / f"{dtype}.npy"
    rows = token_store(path, plan, args.dim, token_ids, special, [LAYER], 0, dtype, compressor="none")
    other = folder / f"{dtype}-other.zarr"  # another model's rows of the same tokens, for the stacked pair
    token_store(other, plan, args.dim, token_ids, special, [LAYER], 1, dtype, compressor="none")
    np.save(npy_path, rows)
    del rows
    array = open_features(path).array(LAYER)
    reader = direct_chunks(array)
    assert reader is not None, "the uncompressed store must take the direct read"
    window_rows, batch = args.window * plan.chunk_size, args.batch_size
    reused = np.empty((window_rows, args.dim), dtype=array.dtype)
    memmap_window = np.empty((window_rows, args.dim), dtype=array.dtype)

    def stream(kind: type[TokenStream], stores: Any = path, threads: int = 2, out: str = dtype) -> Callable[[], None]:
        stack = not isinstance(stores, Path)
        tokens = kind(stores, LAYER, batch, window=args.window, threads=threads, dtype=out, stack=stack)

        def epoch() -> None:
            tokens.set_epoch(next(epochs))
            assert sum(len(b) for b in tokens) == num_tokens

        return epoch

    def npy_memmap() -> None:
        """The chunks in a shuffled order, ``window`` at a time copied from the memmap into one window,
        its rows permuted and gathered into fresh batches of the stored dtype (as the stream does; the
        rest of a window is emitted short, which the stream carries instead)."""
        source = np.load(npy_path, mmap_mode="r")
        rng = np.random.default_rng(next(epochs))
        order = rng.permutation(plan.num_chunks)
        delivered = 0
        for w in range(0, len(order), args.window):
            at = 0
            for chunk in order[w : w + args.window]:
                start, stop = plan.bounds(int(chunk))
                memmap_window[at : at + stop - start] = source[start:stop]
                at += stop - start
            permuted = rng.permutation(at)
            for b in range(0, at, batch):
                delivered += len(np.take(memmap_window, permuted[b : b + batch], axis=0))
        assert delivered == num_tokens

    def npy_memmap_float32(inline: bool = False) -> None:
        """``npy_memmap``, each batch converted to float32 by torch as it is gathered (numpy converts
        float16 in scalar code, several times slower); ``inline``: in the pieces torch converts on the
        calling thread, as the stream converts (``tokens._convert``), not on torch's intra-op threads."""
        source = np.load(npy_path, mmap_mode="r")
        rng = np.random.default_rng(next(epochs))
        order = rng.permutation(plan.num_chunks)
        delivered = 0
        for w in range(0, len(order), args.window):
            at = 0
            for chunk in order[w : w + args.window]:
                start, stop = plan.bounds(int(chunk))
                memmap_window[at : at + stop - start] = source[start:stop]
                at += stop - start
            permuted = rng.permutation(at)
            for b in range(0, at, batch):
                rows = torch.from_numpy(np.take(memmap_window, permuted[b : b + batch], axis=0))
                rows = rows.view(torch.bfloat16) if dtype == "bfloat16" else rows
                if inline:
                    converted = torch.empty(rows.shape, dtype=torch.float32)
                    _convert(converted, rows)
                else:
                    converted = rows.float()
                delivered += len(converted)
        assert delivered == num_tokens

    def codec_in_order() -> None:
        for start in range(0, num_tokens, window_rows):
            _read(array, slice(start, min(start + window_rows, num_tokens)), reused)

    def direct_in_order() -> None:
        for chunk in range(plan.num_chunks):
            reader.read(chunk, reused, fallback=lambda: None)

    variants = {
        f"h_stream_direct_{dtype}": stream(TokenStream),
        f"h_stream_direct_t1_{dtype}": stream(TokenStream, threads=1),
        f"h_stream_direct_t0_{dtype}": stream(TokenStream, threads=0),
        f"h_stream_zarr_{dtype}": stream(_ThroughZarr),
        f"h_npy_memmap_{dtype}": npy_memmap,
        f"h_stream_direct_f32_{dtype}": stream(TokenStream, out="float32"),
        f"h_stream_direct_f32_t0_{dtype}": stream(TokenStream, threads=0, out="float32"),
        f"h_npy_memmap_f32_{dtype}": npy_memmap_float32,
        f"h_npy_memmap_f32_inline_{dtype}": lambda: npy_memmap_float32(inline=True),
        f"h_zarr_read_in_order_{dtype}": codec_in_order,
        f"h_direct_read_in_order_{dtype}": direct_in_order,
        f"h_stack_direct_{dtype}": stream(TokenStream, [path, other]),
        f"h_stack_zarr_{dtype}": stream(_ThroughZarr, [path, other]),
    }
    return variants, num_tokens, plan.chunk_size


def direct_main(args: argparse.Namespace) -> int:
    """Issue 37, the direct read (``extract/read/direct.py``), float16 and bfloat16 stores written with
    ``--compressor none`` (bytes + crc32c), one epoch each, interleaved:

        h_stream_direct   TokenStream(batch_size, window, threads=2, dtype=the stored dtype): chunks read
                          straight into the window, crc32c checked in place
        h_stream_zarr     the same stream with every chunk decoded by zarr, as before (``_ThroughZarr``)
        h_npy_memmap      a ``.npy`` memmap of the same rows: the same shuffled chunks and windows, rows
                          permuted and gathered into fresh batches of the stored dtype
        h_stream_direct_f32, h_stream_direct_f32_t0, h_npy_memmap_f32: the same with float32 batches (the
                          memmap's gathered batches converted by torch), each against the memmap's;
                          h_npy_memmap_f32_inline converts them as the stream does (torch, inline pieces)
        h_zarr_read_in_order, h_direct_read_in_order: the chunks in order into one reused window, through
                          zarr and through the direct read: the floors, no shuffle, no batches
        h_stack_direct, h_stack_zarr: ``TokenStream([store, other], L, stack=True)`` over a second store of
                          the same tokens, direct and through zarr (GB/s of both stores' bytes)
    """
    torch.set_num_threads(os.cpu_count() or 1)
    load_before = round(os.getloadavg()[0], 2)
    epochs = iter(range(10**6))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        variants: dict[str, Callable[[], Any]] = {}
        for dtype in ("float16", "bfloat16"):
            made, num_tokens, chunk_size = direct_variants(Path(tmp), args, epochs, dtype)
            variants |= made
        if args.variants:
            variants = {name: run for name, run in variants.items() if name in args.variants.split(",")}
        seconds, cpu = timed(variants, args.repeats)
    nbytes = num_tokens * args.dim * 2
    read = {name: nbytes * (2 if name.startswith("h_stack_") else 1) for name in seconds}  # a pair: both stores
    rates = {name: read[name] / s / 1e9 for name, s in seconds.items()}
    cpu_per_gb = {name: c / (read[name] / 1e9) for name, c in cpu.items()}
    # each variant against the memmap delivering batches of the same dtype (float32: ``_f32_``)
    memmap = {name: f"h_npy_memmap_{'f32_' * ('_f32_' in name)}{name.rpartition('_')[2]}" for name in seconds}
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "versions": {"torch": torch.__version__, "zarr": zarr.__version__, "numpy": np.__version__},
        "load_average_1min": {"before": load_before, "after": round(os.getloadavg()[0], 2)},
        "num_tokens": num_tokens,
        "dim": args.dim,
        "chunk_size": chunk_size,
        "bytes": nbytes,
        "batch_size": args.batch_size,
        "window": args.window,
        "repeats": args.repeats,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "gb_per_s": {k: round(v, 3) for k, v in rates.items()},
        "cpu_seconds_per_gb": {k: round(v, 3) for k, v in cpu_per_gb.items()},
    }
    print(
        f"{num_tokens} tokens x {args.dim} ({nbytes / 1e6:.0f} MB a dtype), chunks of {chunk_size}, "
        f"batch {args.batch_size}, window {args.window}, --compressor none"
    )
    print(f"{'variant':<32} {'seconds':>8} {'GB/s':>7} {'CPU-s/GB':>9} {'GB/s / memmap':>14} {'CPU / memmap':>13}")
    for name, s in seconds.items():
        base = memmap[name]
        versus = (
            f"{rates[name] / rates[base]:>14.2f} {cpu_per_gb[name] / cpu_per_gb[base]:>13.2f}" if base in rates else ""
        )
        print(f"{name:<32} {s:>8.3f} {rates[name]:>7.2f} {cpu_per_gb[name]:>9.3f} {versus}")
    print(f"1-min load average {load_before} -> {result['load_average_1min']['after']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
