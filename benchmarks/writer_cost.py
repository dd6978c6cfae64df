"""What writing costs, per GB stored, against zarr alone (issue 45): CPU-seconds per GB and GB/s.

Variants, on the same rows (float32 activations, cast to the storage dtype), token stores' chunks (a
power of two of rows, about 16 MiB: the job's default), uncompressed (token stores' default codec chain:
``bytes`` + ``crc32c``), into a fresh directory on local disk:

    zarr     zarr alone: ``array[a:b] = rows`` chunk after chunk, rows already in the storage dtype, zarr's
             own ``crc32c`` codec (``google_crc32c``), one thread (zarr's loop), ``write_empty_chunks``
    zarrx    the same with extract's ``crc32c`` codec (``extract/store/checksum.py``, same bytes)
    file     a plain file write of each chunk's bytes, one file per chunk
    writer   ``HostStaging`` (the cast of float32 batches into the slots, the overflow check) +
             ``ChunkWriter`` + ``FeatureStore.write_chunk`` into a token store (features, ``token_ids``,
             ``special``, statistics, digests, ``done``), ``--threads`` writer threads; ``writer-image``:
             an image store (``labels`` and ``valid`` per chunk instead of the token columns)
    job      ``extract`` on a GPT-2 config with no blocks (``n_layer=0``: the forward is the embedding
             lookup), capturing ``transformer.wte`` per token, over pre-tokenized documents of 128 tokens
             (``input_ids``, no tokenizer run), in this process (warm imports); the CPU of a run of
             ``--job-megabytes`` minus that of a run of a quarter of it, over the difference in GB: what
             the job adds per GB stored, its fixed costs (model, store creation) left out. ``job-docs``:
             the same as a document store (``--pool mean``) of documents of 8 tokens

Each variant runs in a worker process (``--worker``) that imports ``extract`` from ``--tree`` (default
this checkout; ``--base-tree`` another one, e.g. ``git archive main`` unpacked, for before/after in the
same run: its workers alternate with this tree's), runs every case in a rotating order and prints JSON.
CPU time is the process's (all its threads: the writer's, zarr's loop) over the timed part only.

    python benchmarks/writer_cost.py --base-tree /tmp/extract-base --repeats 3 --json writer_cost.json
    python benchmarks/writer_cost.py --variants writer --threads 1 2 4 --dtypes bfloat16 --widths 8192
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 128
DTYPES = ("float16", "bfloat16", "float32")
WIDTHS = (768, 4096, 8192)
VARIANTS = ("zarr", "zarrx", "file", "writer", "writer-image", "job", "job-docs")
TARGET = 16 * 2**20
ITEM = {"float16": 2, "bfloat16": 2, "float32": 4}


def chunk_rows(width: int, dtype: str) -> int:
    """The job's token chunk: a power of two of rows, about 16 MiB (``extract/job/plan.py``)."""
    return 2 ** int(math.log2(max(1, TARGET // (width * ITEM[dtype]))))


# ---------------------------------------------------------------- worker (imports numpy, torch, extract)


def _rows(width: int, rows: int, seed: int = 0) -> Any:
    """float32 activations: a log-normal scale per channel (a few massive channels within float16's range)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    scales = np.exp(rng.normal(0.0, 1.0, width)).astype(np.float32)
    scales[:3] = 3000.0
    return torch.from_numpy(rng.standard_normal((rows, width), dtype=np.float32) * scales)


def _stored(values: Any, dtype: str) -> Any:
    import torch

    from extract.store.dtypes import host_values

    return host_values(values.to(getattr(torch, dtype)))


def _timed(run: Any) -> tuple[float, float, float]:
    """Wall seconds, user and system CPU seconds of the process (all its threads) over ``run()``."""
    wall, before = time.perf_counter(), os.times()
    run()
    after = os.times()
    return time.perf_counter() - wall, after.user - before.user, after.system - before.system


def case_zarr(source: Any, dtype: str, total_rows: int, chunk: int, root: Path, ours: bool) -> tuple[float, ...]:
    import zarr

    qualname = "extract.store.checksum.Crc32cCodec" if ours else "zarr.codecs.crc32c_.Crc32cCodec"
    rows = _stored(source, dtype)
    with zarr.config.set({"codecs.crc32c": qualname}):
        codec_class = zarr.registry.get_codec_class("crc32c")
        array = zarr.create_array(
            root / "z.zarr", shape=(total_rows, rows.shape[1]), chunks=(chunk, rows.shape[1]),
            dtype=rows.dtype, compressors=[codec_class()], fill_value=0,
        )  # fmt: skip
        array = zarr.open_array(root / "z.zarr", mode="r+").with_config({"write_empty_chunks": True})
        assert type(array.metadata.codecs[-1]).__module__.startswith("extract" if ours else "zarr")

        def run() -> None:
            for start in range(0, total_rows, chunk):
                array[start : start + chunk] = rows[: min(chunk, total_rows - start)]

        return _timed(run)


def case_file(source: Any, dtype: str, total_rows: int, chunk: int, root: Path) -> tuple[float, ...]:
    rows = _stored(source, dtype)
    (root / "f").mkdir()

    def run() -> None:
        for k, start in enumerate(range(0, total_rows, chunk)):
            with open(root / "f" / str(k), "wb") as f:
                f.write(memoryview(rows[: min(chunk, total_rows - start)]))

    return _timed(run)


def case_writer(
    source: Any, dtype: str, total_rows: int, chunk: int, root: Path, threads: int, kind: str, batch: int,
    device: str = "cpu",
) -> tuple[float, ...]:
    import numpy as np
    import torch

    from extract.capture.staging import HostStaging
    from extract.store.chunks import Plan
    from extract.store.store import FeatureStore, TextArrays
    from extract.store.writer import ChunkWriter

    width = source.shape[1]
    text = None
    if kind == "tokens":
        text = TextArrays(
            offsets=np.arange(total_rows // CONTEXT + 1, dtype=np.int64) * CONTEXT,
            labels=np.full(total_rows // CONTEXT, -1, dtype=np.int64),
            valid=np.ones(total_rows // CONTEXT, dtype=bool),
        )
    store = FeatureStore.create(
        root / "w.zarr", shapes={"h": (width,)}, num_samples=total_rows, chunk_size=chunk, dtype=dtype,
        compressor="none", attrs={"status": "running", "layers": ["h"], "num_samples": total_rows,
        "chunk_size": chunk}, kind=kind, text=text,
    )  # fmt: skip
    store.integrity.digests_array(), store.stats_layers()  # the existence checks, outside the timing
    plan = Plan(total_rows, chunk)
    # a tree from before statistics on the device has no ``stats`` to give the staging
    extra = {"stats": store.stats_axes(), "chunk_size": chunk} if hasattr(store, "stats_axes") else {}
    staging = HostStaging({"h": (width,)}, batch, getattr(torch, dtype), torch.device(device), slots=4, **extra)
    source = source.to(device)
    writer = ChunkWriter(store, staging, plan, {"h": (width,)}, threads=threads)
    columns = {"token_ids": np.ones(chunk, dtype=np.int32), "special": np.zeros(chunk, dtype=bool)}
    labels = torch.zeros(batch, dtype=torch.int64)

    def run() -> None:
        for start in range(0, total_rows, batch):
            n = min(batch, total_rows - start)
            slot = staging.acquire(writer.check)
            staging.rows = np.arange(start, start + n)  # on a GPU: the statistics of whole blocks there
            staging.stage("h", source[:n])
            staging.seal(slot)
            if kind == "tokens":
                writer.submit_rows(slot, np.arange(start, start + n))
                for k in range(start // chunk, (start + n - 1) // chunk + 1):
                    a, b = plan.bounds(k)
                    if start < b <= start + n:  # the batch that ends the chunk brings its token rows
                        writer.submit_columns(k, {name: c[: b - a] for name, c in columns.items()})
            else:
                writer.submit(slot, torch.arange(start, start + n), labels[:n], np.ones(n, dtype=bool))
        writer.close()

    return _timed(run)


def _gpt2(directory: Path, width: int) -> Path:
    """A GPT-2 config with no blocks (the forward is the embedding lookup), saved with a word-level
    tokenizer of 512 ids."""
    model_dir = directory / f"gpt2-{width}"
    if (model_dir / "config.json").exists():
        return model_dir
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = GPT2Config(n_layer=0, n_embd=width, n_head=width // 64, vocab_size=512, n_positions=1024)
    GPT2LMHeadModel(config).save_pretrained(model_dir)
    vocab = {f"w{i}": i for i in range(511)} | {"<|endoftext|>": 511}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    ).save_pretrained(model_dir)
    return model_dir


def _documents(path: Path, documents: int, length: int) -> Path:
    if not path.exists():
        import numpy as np

        ids = np.random.default_rng(1).integers(0, 511, (documents, length))
        with open(path, "w") as f:
            for row in ids:
                f.write(json.dumps({"input_ids": row.tolist()}) + "\n")
    return path


def case_job(dtype: str, width: int, megabytes: float, root: Path, workdir: Path, docs: bool, threads: int | None):
    """(wall, CPU, GB stored) of the job at ``megabytes`` and at a quarter of it: the margin."""
    from extract.cli.extract import main

    model = _gpt2(workdir, width)
    length = 8 if docs else CONTEXT
    runs = []
    for size in (megabytes / 4, megabytes):
        rows = int(size * 2**20 / (width * ITEM[dtype]))
        documents = max(16, rows if docs else rows // CONTEXT)
        data = _documents(workdir / f"docs-{documents}x{length}.jsonl", documents, length)
        out = root / f"job-{size}.zarr"
        args = [
            "--model", f"hf:{model}", "--layers", "transformer.wte", "--data", f"text:{data}",
            "--dtype", dtype, "--context-length", str(length), "--out", str(out),
            "--batch-size", "64", "--tokens-per-batch", "8192",
        ]  # fmt: skip
        args += ["--pool", "mean"] if docs else []
        args += ["--writer-threads", str(threads)] if threads else []
        wall, user, system = _timed(lambda args=args: main(args))
        stored = sum(f.stat().st_size for f in (out / "features").rglob("*") if f.is_file())
        runs.append((wall, user, system, stored / 1e9))
        shutil.rmtree(out)
    return tuple(large - small for small, large in zip(*runs, strict=True))


def worker(args: argparse.Namespace) -> None:
    import torch

    from extract.job.memory import keep_freed_memory

    if args.device == "cpu":
        keep_freed_memory()  # as a CPU job does (extract/job/memory.py), for every variant alike
    try:
        from extract.store import checksum  # noqa: F401 - this tree's codec (zarrx); a tree before it has none
    except ImportError:
        pass

    torch.manual_seed(0)
    results = []
    cases = json.loads(args.worker)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sources: dict[int, Any] = {}
    # first a small untimed run of each case: imports, lazy initialisations and thread pools are not per GB
    warm = {(c["variant"], c["dtype"]): {**c, "warm": True} for c in cases if not c["variant"].startswith("job")}
    jobs = [c for c in cases if c["variant"].startswith("job")]
    if jobs:  # a first job pays the lazy imports (transformers, tokenizers) and the model's first build
        warm[("job", "warm")] = {**jobs[0], "warm": True}
    for case in [*warm.values(), *cases]:
        variant, dtype, width, threads = case["variant"], case["dtype"], case["width"], case.get("threads")
        root = Path(tempfile.mkdtemp(dir=workdir))
        try:
            if variant.startswith("job"):
                megabytes = 16 if case.get("warm") else args.job_megabytes
                wall, user, system, gb = case_job(dtype, width, megabytes, root, workdir, variant == "job-docs", threads)
            else:
                chunk = chunk_rows(width, dtype)
                total = max(2 * chunk, int(args.megabytes * 2**20 / (width * ITEM[dtype])) // chunk * chunk)
                total = 2 * chunk if case.get("warm") else total
                batch = max(1, min(chunk, 8192 * 768 // width))
                if width not in sources:
                    sources[width] = _rows(width, max(batch, chunk))
                source = sources[width]
                gb = total * width * ITEM[dtype] / 1e9
                if variant in ("zarr", "zarrx"):
                    wall, user, system = case_zarr(source, dtype, total, chunk, root, variant == "zarrx")
                elif variant == "file":
                    wall, user, system = case_file(source, dtype, total, chunk, root)
                else:
                    kind = "images" if variant == "writer-image" else "tokens"
                    wall, user, system = case_writer(
                        source[:batch], dtype, total, chunk, root, threads or 2, kind, batch
                    )
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if case.get("warm"):
            continue
        results.append({**case, "wall": wall, "user": user, "system": system, "cpu": user + system, "gb": gb})
    print("RESULT " + json.dumps(results))


# ---------------------------------------------------------------- orchestrator


def run_worker(tree: Path, cases: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [
        sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cases), "--workdir", args.workdir,
        "--megabytes", str(args.megabytes), "--job-megabytes", str(args.job_megabytes), "--device", args.device,
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"worker on {tree} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
    parser.add_argument("--threads", nargs="+", type=int, default=[2], help="writer threads (writer variants)")
    parser.add_argument("--job-dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--job-width", type=int, default=4096)
    parser.add_argument("--megabytes", type=float, default=256, help="stored per case (writer, zarr, file)")
    parser.add_argument("--job-megabytes", type=float, default=512, help="stored by the larger job run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base-tree", type=Path, help="another checkout, measured in the same run (before)")
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--workdir", default="/tmp/extract-writer-cost")
    parser.add_argument("--worker-per-case", action="store_true", help="a fresh worker process for every case")
    parser.add_argument("--device", default="cpu", help="where the writer's batches come from (cuda: D2H copies)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    variants = args.variants.split(",")
    cases: list[dict[str, Any]] = []
    for variant in variants:
        if variant.startswith("job"):
            dtypes = args.job_dtypes if variant == "job" else args.job_dtypes[:1]
            cases += [{"variant": variant, "dtype": d, "width": args.job_width} for d in dtypes]
            continue
        for dtype, width in itertools.product(args.dtypes, args.widths):
            for threads in args.threads if variant.startswith("writer") else [None]:
                cases.append({"variant": variant, "dtype": dtype, "width": width, "threads": threads})
    trees = [("after", args.tree)] + ([("before", args.base_tree)] if args.base_tree else [])
    raw: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        order = cases[repeat % len(cases) :] + cases[: repeat % len(cases)]  # rotate the order each repeat
        for name, tree in trees if repeat % 2 == 0 else trees[::-1]:
            own = [c for c in order if name == "after" or c["variant"] not in ("zarrx",)]
            if name == "before":  # zarr and file are the same code in both trees
                own = [c for c in own if c["variant"] not in ("zarr", "file")]
            # one worker per case: in a worker that ran zarr or file cases first, the writer's cases took up to
            # twice the user CPU (cause not found), in both trees alike
            for group in [[c] for c in own] if args.worker_per_case else [own]:
                for result in run_worker(tree, group, args):
                    raw.append({**result, "tree": name, "repeat": repeat})
                    print(json.dumps(raw[-1]), flush=True)
    table = summarize(raw)
    report(table)
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine(), "args": sys.argv[1:], "raw": raw, "table": table}, indent=1)
        )


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()}


def summarize(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in raw:
        groups.setdefault((r["tree"], r["variant"], r["dtype"], r["width"], r.get("threads")), []).append(r)
    rows = []
    for (tree, variant, dtype, width, threads), runs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        rows.append({
            "tree": tree, "variant": variant, "dtype": dtype, "width": width, "threads": threads,
            "gb_per_s": statistics.median(r["gb"] / r["wall"] for r in runs if r["wall"] > 0),
            "cpu_s_per_gb": statistics.median(r["cpu"] / r["gb"] for r in runs),
            "user_s_per_gb": statistics.median(r["user"] / r["gb"] for r in runs),
            "runs": len(runs),
        })  # fmt: skip
    for measure in ("cpu", "user"):  # against zarr alone on the same dtype and width (jobs: same dtype, any width)
        zarr = {(r["dtype"], r["width"]): r[f"{measure}_s_per_gb"] for r in rows if r["variant"] == "zarr"}
        for r in rows:
            same = [v for (d, _), v in zarr.items() if d == r["dtype"]]
            base = zarr.get((r["dtype"], r["width"]), statistics.median(same) if same else math.nan)
            r[f"x_zarr_{measure}"] = r[f"{measure}_s_per_gb"] / base
    return rows


def report(table: list[dict[str, Any]]) -> None:
    print(f"\n{'tree':<7} {'variant':<13} {'dtype':<9} {'width':>5} {'thr':>3} {'GB/s':>6} {'CPU-s/GB':>8} "
          f"{'x zarr':>6} {'user/GB':>7} {'x zarr':>6}")  # fmt: skip
    for r in table:
        print(
            f"{r['tree']:<7} {r['variant']:<13} {r['dtype']:<9} {r['width']:>5} {r['threads'] or '':>3} "
            f"{r['gb_per_s']:>6.2f} {r['cpu_s_per_gb']:>8.3f} {r['x_zarr_cpu']:>6.2f} {r['user_s_per_gb']:>7.3f} "
            f"{r['x_zarr_user']:>6.2f}"
        )


if __name__ == "__main__":
    main()
