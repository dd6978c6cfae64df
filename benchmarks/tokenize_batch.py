"""Tokenizing a corpus one document at a time (the text path before issue 28) against the batch encoder
(``TextModel.encode_many``, the tokenizer's Rust threads), reading the same .jsonl through the same
``text:`` source. Prints CPU-seconds and wall seconds per million tokens, and checks the ids agree.

    python benchmarks/tokenize_batch.py [--tokens 2000000] [--context-length 512] [--repeats 3]

The tokenizer is the suite's GPT-2-shaped byte-level BPE trained on the standard library's docstrings
(tests/helpers/text_models.py); the text is real prose: every docstring of the standard library, repeated.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pkgutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def docstrings() -> list[str]:
    """Every docstring of the standard library's importable top-level modules and their members."""
    import importlib

    found: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in sorted(m.name for m in pkgutil.iter_modules() if m.module_finder.path.startswith(sys.prefix)):  # type: ignore[union-attr]
            if module.startswith(("_", "test", "idlelib", "tkinter", "turtle", "antigravity", "this")):
                continue
            try:
                imported = importlib.import_module(module)
            except Exception:  # noqa: BLE001 - a module that does not import here
                continue
            for member in [imported, *vars(imported).values()]:
                doc = inspect.getdoc(member) if callable(member) or member is imported else None
                if doc and len(doc) > 40:
                    found.append(doc)
    return list(dict.fromkeys(found))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from helpers.text_models import save_text_model

    from extract.data.source import DataOptions, DataRequest
    from extract.data.text import open_text
    from extract.data.tokenize import encoded_documents
    from extract.models import build_model

    work = Path(tempfile.mkdtemp(prefix="tokenize-batch-"))
    model_dir = save_text_model("gpt2", work / "gpt2")
    model = build_model(f"hf:{model_dir}", "none", None, 0, None)
    texts = docstrings()
    per_text = sum(len(model.encode(t, None, 10**9).ids) for t in texts[:200]) / 200
    copies = max(1, int(args.tokens / (per_text * len(texts))) + 1)
    corpus = work / "corpus.jsonl"
    with corpus.open("w") as f:
        for _ in range(copies):
            for text in texts:
                f.write(json.dumps({"text": text}) + "\n")
    source = open_text(str(corpus), DataRequest(f"text:{corpus}", DataOptions(None, None, "pil", False)))
    context = args.context_length

    def one_at_a_time() -> tuple[int, list[int]]:
        lengths = []
        for document in source.documents(0, len(source)):
            lengths.append(len(model.encode(document.text, None, context).ids))
        return sum(lengths), lengths

    def batched() -> tuple[int, list[int]]:
        lengths = [len(e.ids) for _, e in encoded_documents(source, model, context, 0, len(source))]
        return sum(lengths), lengths

    results: dict[str, list[tuple[float, float]]] = {"one at a time": [], "batch encoder": []}
    tokens = 0
    reference: list[int] | None = None
    for _ in range(args.repeats):  # interleaved, so that both see the same machine
        for name, work_fn in (("one at a time", one_at_a_time), ("batch encoder", batched)):
            cpu, wall = time.process_time(), time.perf_counter()
            tokens, lengths = work_fn()
            results[name].append((time.process_time() - cpu, time.perf_counter() - wall))
            assert reference is None or lengths == reference, "the two paths tokenized differently"
            reference = lengths
    print(f"# {len(source)} documents, {tokens} tokens, --context-length {context}, {os.cpu_count()} CPUs")
    print("| path | CPU-s per M tokens (min / median) | wall s per M tokens (min / median) |")
    print("| --- | --- | --- |")
    for name, runs in results.items():
        cpus = sorted(c / tokens * 1e6 for c, _ in runs)
        walls = sorted(w / tokens * 1e6 for _, w in runs)
        print(
            f"| {name} | {cpus[0]:.2f} / {cpus[len(cpus) // 2]:.2f} | {walls[0]:.2f} / {walls[len(walls) // 2]:.2f} |"
        )


if __name__ == "__main__":
    main()
