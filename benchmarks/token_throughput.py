"""Tokens stored per second of a per-token job on CPU, against the usual ways of caching a language
model's residual stream, with the same model, hook point and tokens.

Variants, interleaved in rounds (the order rotates every round), medians of the rounds:

    a    bare      full forward with ``output_hidden_states=True``, nothing stored
    a'   stopped   forward stopped right after the hooked layer (a forward hook raising), nothing stored
    p    padded    (a') on extract's own batches of the documents (``TextBatches``: padding and attention
                   mask included), nothing stored: what extract's packing leaves of (a')
    b    naive     forward hook keeping ``output.cpu()``, full forward, ``np.save`` at the end (float32)
    c    saelens   SAELens ``CacheActivationsRunner`` (``model_class_name="AutoModelForCausalLM"``, a local
                   directory) in a subprocess with another venv's python (``--sae-python``; float32)
    e    extract   ``python -m extract ... --dtype float32`` in a subprocess: tokens/s from the store's summary
    e16  extract   the same job with the default ``--dtype float16``

The model is GPT-2 width (n_embd 768, 12 heads, 4 layers, n_positions 1024, random weights, seed 0)
with a byte-level BPE tokenizer of 8000 tokens trained here; the hook is ``transformer.h.1`` (the
residual stream after block 1). The text is real: standard-library docstrings (``inspect.getdoc``)
and the licence and README (METADATA) texts of the installed packages, in a seeded order, taken
until ``--tokens`` tokens are stored at ``--context-length`` 128. Each document is tokenized as
extract does (``tokenizer(text, truncation=True, max_length=T)``); extract runs the documents
(ragged, padded within its length-sorted batches), the others run the same tokens concatenated and
cut into full contexts of T (no padding), which is what SAELens caches.

    python benchmarks/token_throughput.py --json token.json                 # ~100k tokens, 3 rounds
    python benchmarks/token_throughput.py --tokens 4000 --rounds 1          # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extract.data.tokenize import ArrayRows  # noqa: E402
from extract.job.text import TextBatch, TextBatches  # noqa: E402
from extract.store.chunks import Plan  # noqa: E402

LAYER = "transformer.h.1"
HIDDEN_INDEX = 2  # hidden_states[2] is the output of block 1 (hidden_states[0] is the embeddings)
VARIANTS = ("a", "a'", "p", "b", "c", "e", "e16")
DESCRIPTIONS = {
    "a": "bare forward, output_hidden_states=True, nothing stored",
    "a'": "forward stopped after transformer.h.1 (hook raises), nothing stored",
    "p": "(a') on extract's padded batches of the documents, nothing stored",
    "b": "naive loop: forward hook, .cpu(), np.save at the end (float32)",
    "c": "SAELens CacheActivationsRunner (float32)",
    "e": "extract CLI, --dtype float32",
    "e16": "extract CLI, --dtype float16 (default)",
}
STDLIB = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac",
    "html.parser", "http.client", "http.server", "imaplib", "importlib", "inspect", "io", "ipaddress",
    "itertools", "json", "logging", "lzma", "mailbox", "math", "multiprocessing", "numbers", "operator",
    "optparse", "os", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "pprint", "queue", "random",
    "re", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket", "sqlite3", "ssl",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "traceback", "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings",
    "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zoneinfo",
)  # fmt: skip


# --------------------------------------------------------------------------------------- the corpus


def stdlib_docstrings() -> list[str]:
    """The docstrings of the modules above, their members and their classes' methods."""
    import importlib
    import inspect

    docs: list[str] = []
    seen: set[str] = set()

    def add(member: Any) -> None:
        doc = inspect.getdoc(member)
        if doc and doc not in seen:
            seen.add(doc)
            docs.append(doc)

    for name in STDLIB:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        add(module)
        for _, member in sorted(vars(module).items()):
            if not (callable(member) and (getattr(member, "__module__", None) or "").startswith(name)):
                continue
            add(member)
            if inspect.isclass(member):
                for _, method in sorted(vars(member).items()):
                    if callable(method):
                        add(method)
    return docs


def package_texts() -> list[str]:
    """Licence files and READMEs (the body of METADATA) of the packages installed next to torch."""
    site = Path(torch.__file__).resolve().parent.parent
    texts: list[str] = []
    for info in sorted(site.glob("*.dist-info")):
        files = sorted(p for p in info.rglob("*") if p.is_file() and re.match(r"(LICEN[CS]E|COPYING|NOTICE)", p.name))
        for path in files:
            texts.append(path.read_text(errors="replace"))
        metadata = info / "METADATA"
        if metadata.is_file():
            _, _, body = metadata.read_text(errors="replace").partition("\n\n")
            texts.append(body)
    return [t.strip() for t in dict.fromkeys(texts) if t.strip()]


def corpus_pool() -> list[str]:
    """Every document, in a fixed (seeded) order."""
    import random

    pool = stdlib_docstrings() + package_texts()
    random.Random(0).shuffle(pool)
    return pool


def build_model(directory: Path, pool: list[str], vocab_size: int) -> Path:
    """A GPT-2-width model (random weights, seed 0) and a byte-level BPE tokenizer trained on ``pool``,
    saved with ``save_pretrained``; kept in ``directory`` across runs."""
    if (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(pool, trainer)
    tokenizer = tf.GPT2TokenizerFast(
        tokenizer_object=raw, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=len(tokenizer), n_positions=1024, n_embd=768, n_layer=4, n_head=12,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    scratch = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    tf.GPT2LMHeadModel(config).eval().save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    shutil.rmtree(directory, ignore_errors=True)
    scratch.rename(directory)
    return directory


def select_documents(pool: list[str], tokenizer: Any, tokens: int, context: int) -> tuple[list[str], list[list[int]]]:
    """Documents from the pool, in order, until ``tokens`` tokens are stored (each truncated to
    ``context`` as extract does), with their token ids."""
    documents, ids, stored = [], [], 0
    for document in pool:
        encoded = tokenizer(document, truncation=True, max_length=context)["input_ids"]
        if not encoded:
            continue
        documents.append(document)
        ids.append(encoded)
        stored += len(encoded)
        if stored >= tokens:
            return documents, ids
    raise SystemExit(f"the corpus holds only {stored} tokens at context {context}: ask for fewer --tokens")


# ------------------------------------------------------------------------------ in-process variants


class StopForward(Exception):
    """Raised by the hook of (a'): the rest of the forward is not run."""


def _block_output(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def run_bare(model: Any, contexts: torch.Tensor, batch_size: int) -> dict[str, Any]:
    """(a): the full forward with every hidden state returned; nothing kept."""
    with torch.inference_mode():
        for start in range(0, len(contexts), batch_size):
            out = model(input_ids=contexts[start : start + batch_size], output_hidden_states=True)
            assert out.hidden_states[HIDDEN_INDEX].shape[-1] == model.config.n_embd
    return {}


def run_stopped(model: Any, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """(a') and (p): a forward hook on the layer raises, so the blocks after it and the LM head never run."""

    def stop(module: Any, args: Any, output: Any) -> None:
        raise StopForward

    handle = model.get_submodule(LAYER).register_forward_hook(stop)
    try:
        with torch.inference_mode():
            for inputs in batches:
                try:
                    model(**inputs)
                except StopForward:
                    pass
    finally:
        handle.remove()
    return {}


def extract_batches(ids: list[list[int]], batch_size: int, tokens_per_batch: int, itemsize: int) -> list[dict]:
    """The batches extract's job makes of these documents: ``TextBatches`` over one rank's chunks, with
    the chunk size the job picks for a d=768 layer of ``itemsize`` bytes (the store's, see padding_waste)."""
    from extract.job.plan import MAX_TOKEN_CHUNK_SIZE, default_chunk_size

    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(i) for i in ids], out=offsets[1:])
    flat = np.concatenate([np.asarray(i, dtype=np.int32) for i in ids])
    plan = Plan(int(offsets[-1]), default_chunk_size(int(offsets[-1]), 768 * itemsize, 1, MAX_TOKEN_CHUNK_SIZE))
    batches = TextBatches.for_job(
        offsets, ArrayRows(flat), plan, range(plan.num_chunks), per_token=True, tokens_per_batch=tokens_per_batch, pad_id=0,
        row_bytes=768 * itemsize,
    )  # fmt: skip
    return [batch.inputs for batch in batches if isinstance(batch, TextBatch)]


def run_naive(model: Any, contexts: torch.Tensor, batch_size: int, path: Path) -> dict[str, Any]:
    """(b): what a user writes first: keep each batch's ``output.cpu()``, full forward, ``np.save``."""
    kept: list[torch.Tensor] = []
    handle = model.get_submodule(LAYER).register_forward_hook(lambda m, a, o: kept.append(_block_output(o).cpu()))
    try:
        with torch.inference_mode():
            for start in range(0, len(contexts), batch_size):
                model(input_ids=contexts[start : start + batch_size])
    finally:
        handle.remove()
    activations = torch.cat(kept).reshape(-1, model.config.n_embd).numpy()
    np.save(path, activations)
    size = path.stat().st_size
    path.unlink()
    return {"bytes_written": size}


# ------------------------------------------------------------------------------- subprocess variants


def _run(command: list[str], env: dict[str, str] | None = None) -> tuple[str, float]:
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout + proc.stderr, wall


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def extract_command(args: argparse.Namespace, model_dir: Path, docs: Path, out: Path, dtype: str) -> list[str]:
    return [
        sys.executable, "-m", "extract", "--model", f"hf:{model_dir}", "--layers", LAYER, "--data", f"text:{docs}",
        "--context-length", str(args.context_length), "--batch-size", str(args.batch_size),
        "--tokens-per-batch", str(args.batch_size * args.context_length), "--dtype", dtype,
        "--out", str(out), "--overwrite",
    ]  # fmt: skip


def run_extract(args: argparse.Namespace, model_dir: Path, docs: Path, out: Path, dtype: str) -> dict[str, Any]:
    """(e): the CLI job; tokens/s from the store's summary (the loop: forward, capture, write), wall
    time of the whole process (start-up, model load and tokenizing included)."""
    import zarr

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    shutil.rmtree(out, ignore_errors=True)
    output, wall = _run(extract_command(args, model_dir, docs, out, dtype), env)
    group = zarr.open_group(out, mode="r")
    summary = dict(group.attrs["summary"])
    result = {
        "tokens": summary["samples"],
        "seconds": summary["seconds"],
        "wall_seconds": wall,
        "bytes_written": directory_bytes(out),
        "feature_bytes": summary["bytes_stored"],
        "compression_ratio": summary["compression_ratio"],
        "summary_line": next((m for m in output.splitlines() if m.startswith("extract: ") and " tokens in " in m), ""),
    }
    return result


def run_saelens(args: argparse.Namespace, model_dir: Path, dataset: Path, out: Path, tokens: int) -> dict[str, Any]:
    """(c): ``benchmarks/token_throughput_sae.py`` with the SAELens venv's python; it times
    ``CacheActivationsRunner.run()`` (the runner is built, and the model loaded, before)."""
    shutil.rmtree(out, ignore_errors=True)
    command = [
        args.sae_python, str(ROOT / "benchmarks" / "token_throughput_sae.py"), "--model", str(model_dir),
        "--dataset", str(dataset), "--out", str(out), "--hook", LAYER, "--d-in", "768",
        "--context-length", str(args.context_length), "--batch-size", str(min(args.batch_size, tokens // args.context_length)),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled")
    output, wall = _run(command, env)
    line = next((m for m in output.splitlines() if m.startswith("SAELENS_RESULT ")), None)
    if line is None:
        raise RuntimeError(f"SAELens printed no result:\n{output[-3000:]}")
    result = json.loads(line.removeprefix("SAELENS_RESULT "))
    result["wall_seconds"] = wall
    result["bytes_written"] = directory_bytes(out)
    return result


def save_sae_dataset(contexts: np.ndarray, path: Path) -> Path:
    """The contexts as a ``datasets`` dataset of ``input_ids``, saved with ``save_to_disk``."""
    if path.is_dir():
        shutil.rmtree(path)
    import datasets

    datasets.Dataset.from_dict({"input_ids": contexts.astype(np.int64).tolist()}).save_to_disk(str(path))
    return path


# ----------------------------------------------------------------------------------------- padding


def padding_waste(store: Path, batch_size: int, tokens_per_batch: int) -> dict[str, Any]:
    """The batches the job ran, rebuilt with extract's own ``TextBatches`` from the store (offsets, token
    ids and chunk size; one rank holds every chunk): tokens computed, padding included, per token stored."""
    import zarr

    group = zarr.open_group(store, mode="r")
    offsets = np.asarray(group["offsets"][:])
    plan = Plan(int(offsets[-1]), int(group.attrs["chunk_size"]))
    row_bytes = 768 * np.dtype(group[f"features/{LAYER}"].dtype).itemsize
    batches = TextBatches.for_job(
        offsets, ArrayRows(group["token_ids"]), plan, range(plan.num_chunks), per_token=True,
        tokens_per_batch=tokens_per_batch, pad_id=0, row_bytes=row_bytes,
    )  # fmt: skip
    computed = stored = forwards = 0
    widths = []
    for batch in batches:
        if not isinstance(batch, TextBatch):  # a chunk's token rows
            continue
        b, t = batch.input_ids.shape
        computed, stored, forwards = computed + b * t, stored + len(batch.rows), forwards + 1
        widths.append(b)
    return {
        "tokens_stored": stored,
        "tokens_computed": computed,
        "computed_per_stored": computed / stored,
        "forwards": forwards,
        "sequences_per_forward_median": statistics.median(widths),
        "tokens_per_forward_mean": computed / forwards,
        "chunk_size": plan.chunk_size,
    }


def document_stats(ids: list[list[int]], context: int) -> dict[str, Any]:
    lengths = np.array([len(i) for i in ids])
    return {
        "documents": len(ids),
        "tokens": int(lengths.sum()),
        "length_median": float(np.median(lengths)),
        "length_mean": float(lengths.mean()),
        "length_p10_p90": [float(np.percentile(lengths, 10)), float(np.percentile(lengths, 90))],
        "truncated_documents": int((lengths == context).sum()),
    }


# -------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=100_000, help="tokens stored per variant (default 100000)")
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64, help="sequences per forward (extract: --batch-size, "
                   "with --tokens-per-batch batch-size x context)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument("--warmup", type=int, default=1, help="batches of (a) run before timing")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--sae-python", default="/work/venv-sae/bin/python",
                   help="python of a venv with sae-lens; (c) is skipped when it is absent")  # fmt: skip
    p.add_argument("--workdir", type=Path, default=Path("/tmp/extract-token-bench"))
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import transformers as tf

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    if "c" in args.variants and not Path(args.sae_python).is_file():
        notes.append(f"(c) skipped: no SAELens python at {args.sae_python} (--sae-python)")
        args.variants.remove("c")

    started = time.perf_counter()
    pool = corpus_pool()
    model_dir = build_model(work / f"gpt2-768x4-v{args.vocab_size}", pool, args.vocab_size)
    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    documents, ids = select_documents(pool, tokenizer, args.tokens, args.context_length)
    docs = work / "docs.jsonl"
    with docs.open("w", encoding="utf-8") as f:
        for document in documents:
            f.write(json.dumps({"text": document}) + "\n")
    flat = np.concatenate([np.asarray(i, dtype=np.int64) for i in ids])
    # whole batches of full contexts: SAELens drops a buffer it cannot fill
    n_full = len(flat) // args.context_length
    n_contexts = n_full - n_full % args.batch_size if n_full >= args.batch_size else n_full
    contexts = flat[: n_contexts * args.context_length].reshape(n_contexts, args.context_length)
    context_tokens = contexts.size
    dataset = save_sae_dataset(contexts, work / "sae-dataset") if "c" in args.variants else None
    stats = document_stats(ids, args.context_length)
    print(
        f"corpus: {stats['documents']} documents, {stats['tokens']} tokens stored at context {args.context_length} "
        f"(median length {stats['length_median']:.0f}, {stats['truncated_documents']} truncated); "
        f"{n_contexts} full contexts ({context_tokens} tokens) for a/a'/b/c; prepared in "
        f"{time.perf_counter() - started:.0f} s",
        flush=True,
    )

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    batches = torch.from_numpy(contexts)
    with torch.inference_mode():  # warm-up: allocator and kernels
        for _ in range(args.warmup):
            model(input_ids=batches[: args.batch_size])

    contexts_in_batches = [
        {"input_ids": batches[i : i + args.batch_size]} for i in range(0, n_contexts, args.batch_size)
    ]
    padded = (
        extract_batches(ids, args.batch_size, args.batch_size * args.context_length, 4) if "p" in args.variants else []
    )
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "a": lambda: run_bare(model, batches, args.batch_size),
        "a'": lambda: run_stopped(model, contexts_in_batches),
        "p": lambda: {**run_stopped(model, padded), "tokens": stats["tokens"]},
        "b": lambda: run_naive(model, batches, args.batch_size, work / "naive.npy"),
        "c": lambda: run_saelens(args, model_dir, dataset, work / "sae-cache", context_tokens),
        "e": lambda: run_extract(args, model_dir, docs, work / "e32.zarr", "float32"),
        "e16": lambda: run_extract(args, model_dir, docs, work / "e16.zarr", "float16"),
    }
    variants = args.variants
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    load = [os.getloadavg()]
    for round_ in range(args.rounds):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        for v in order:
            t0 = time.perf_counter()
            result = runners[v]()
            elapsed = time.perf_counter() - t0
            result.setdefault("tokens", context_tokens)
            result.setdefault("seconds", elapsed)
            result["tokens_per_second"] = result["tokens"] / result["seconds"]
            if "wall_seconds" in result:
                result["wall_tokens_per_second"] = result["tokens"] / result["wall_seconds"]
            runs[v].append(result)
            print(f"round {round_ + 1} {v:>4}: {result['tokens_per_second']:8.1f} tok/s", flush=True)
        load.append(os.getloadavg())

    table = {}
    for v in variants:
        rs = runs[v]
        row = {
            "description": DESCRIPTIONS[v],
            "tokens": rs[0]["tokens"],
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in rs),
            "tokens_per_second_all": [round(r["tokens_per_second"], 1) for r in rs],
        }
        if "wall_seconds" in rs[0]:
            row["wall_tokens_per_second"] = statistics.median(r["wall_tokens_per_second"] for r in rs)
        if "bytes_written" in rs[0]:
            row["bytes_written"] = rs[-1]["bytes_written"]
            row["bytes_per_token"] = rs[-1]["bytes_written"] / rs[-1]["tokens"]
        for key in ("compression_ratio", "feature_bytes", "summary_line"):
            if key in rs[-1]:
                row[key] = rs[-1][key]
        table[v] = row

    ratios = {}
    tps = {v: table[v]["tokens_per_second"] for v in table}
    for e in ("e", "e16"):
        for base in ("c", "a'", "p", "a", "b"):
            if e in tps and base in tps:
                ratios[f"{e}/{base}"] = tps[e] / tps[base]
    padding = {}  # per extract variant: its store's chunk size sets the sort windows
    for v, name in (("e", "e32.zarr"), ("e16", "e16.zarr")):
        if v in variants:
            import zarr

            padding[v] = padding_waste(work / name, args.batch_size, args.batch_size * args.context_length)
            stored_ids = np.asarray(zarr.open_group(work / name, mode="r")["token_ids"][:])
            if not np.array_equal(stored_ids, flat):
                notes.append(f"({v}) extract's stored token_ids differ from the benchmark's tokenization")

    print()
    print(f"{'':5} {'variant':70} {'tok/s':>8} {'wall tok/s':>10} {'B/token':>8}")
    for v, row in table.items():
        wall = f"{row['wall_tokens_per_second']:10.1f}" if "wall_tokens_per_second" in row else f"{'':10}"
        per = f"{row['bytes_per_token']:8.0f}" if "bytes_per_token" in row else f"{'':8}"
        print(f"{v:5} {row['description']:70} {row['tokens_per_second']:8.1f} {wall} {per}")
    for k, r in ratios.items():
        print(f"{k}: {r:.3f}")
    for v, waste in padding.items():
        print(
            f"padding ({v}, chunk {waste['chunk_size']}): {waste['tokens_computed']} tokens computed for "
            f"{waste['tokens_stored']} stored ({waste['computed_per_stored']:.3f} per token) in {waste['forwards']} forwards"
        )
    print(f"load average (1, 5, 15 min) before {load[0]}, after {load[-1]}")
    for n in notes:
        print("note:", n)

    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": tf.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
        },
        "corpus": stats,
        "context_tokens": context_tokens,
        "variants": table,
        "runs": runs,
        "ratios": ratios,
        "padding": padding,
        "load_average": load,
        "notes": notes,
        "command": " ".join([sys.executable, *sys.argv]),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=float))
    return result


if __name__ == "__main__":
    main()
