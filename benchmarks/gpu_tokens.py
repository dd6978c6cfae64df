"""A per-token job on CUDA in bf16 against the fp32 CPU run of the same job (``gpu_check.sh`` runs it).

The model and text are those of ``token_throughput.py`` (GPT-2 width, 4 layers, random weights, a BPE
tokenizer of 8000 trained here; stdlib docstrings and package licences/READMEs), hook
``transformer.h.1``, context 128, ``--dtype float32`` storage on both sides. The CUDA job runs
``--tokens`` tokens (tokens/s from the store's summary); the CPU job (``CUDA_VISIBLE_DEVICES=``,
``--precision fp32``) runs the documents of its first ``--compare-tokens`` tokens. Checked:

- ``offsets``, ``token_ids`` and ``special`` of the CPU store equal the first documents' of the CUDA
  store (tokenizing does not depend on the device);
- every stored row within ``--tolerance`` (5e-2) of the row's scale: max |a - b| over the row's max |b|
  (bf16 keeps 8 bits of mantissa; two blocks of a random GPT-2 drift by under a percent); the mean
  over rows and the smallest cosine are reported too.

``--device cpu`` runs the "CUDA" side on the CPU as well (bf16 there too), which tests this script
on a machine without a GPU; the throughput it reports is then the CPU's.

    python benchmarks/gpu_tokens.py --json gpu_tokens.json
    python benchmarks/gpu_tokens.py --device cpu --tokens 3000 --compare-tokens 1500   # no GPU

``--device-map`` loads the tested job's model with ``--device-map auto`` (accelerate's dispatch over
the GPUs the process sees; with one GPU every module is on it, behind accelerate's hooks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from token_throughput import LAYER, ROOT, build_model, corpus_pool, select_documents  # noqa: E402

CONTEXT = 128


def run_job(
    model_dir: Path, docs: Path, out: Path, precision: str, cuda: bool, batch_size: int, extra: list[str] | None = None
) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["HF_HUB_OFFLINE"] = "1"
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [
        sys.executable, "-m", "extract", "--model", f"hf:{model_dir}", "--layers", LAYER, "--data", f"text:{docs}",
        "--context-length", str(CONTEXT), "--batch-size", str(batch_size), "--dtype", "float32",
        "--precision", precision, "--out", str(out), "--overwrite", *(extra or []),
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    import zarr

    summary = dict(zarr.open_group(out, mode="r").attrs["summary"])
    return {"command": " ".join(command), "wall_seconds": time.perf_counter() - started, **summary}


def compare(test: Path, reference: Path, tolerance: float) -> dict:
    """The reference store (fewer documents) against the first documents of the tested one."""
    import zarr

    a, b = zarr.open_group(test, mode="r"), zarr.open_group(reference, mode="r")
    offsets_b = np.asarray(b["offsets"][:])
    documents, rows = len(offsets_b) - 1, int(offsets_b[-1])
    same = {
        "offsets": bool(np.array_equal(np.asarray(a["offsets"][: documents + 1]), offsets_b)),
        "token_ids": bool(np.array_equal(np.asarray(a["token_ids"][:rows]), np.asarray(b["token_ids"][:]))),
        "special": bool(np.array_equal(np.asarray(a["special"][:rows]), np.asarray(b["special"][:]))),
    }
    x = np.asarray(a[f"features/{LAYER}"][:rows], dtype=np.float64)
    y = np.asarray(b[f"features/{LAYER}"][:], dtype=np.float64)
    scale = np.maximum(np.abs(y).max(axis=1), 1e-12)
    relative = np.abs(x - y).max(axis=1) / scale
    cosine = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1) + 1e-12)
    worst = int(relative.argmax())
    report = {
        "documents": documents,
        "rows": rows,
        "identical": same,
        "row_relative_error_max": float(relative.max()),
        "row_relative_error_mean": float(relative.mean()),
        "worst_row": worst,
        "min_cosine": float(cosine.min()),
        "tolerance": tolerance,
    }
    report["ok"] = all(same.values()) and rows > 0 and report["row_relative_error_max"] <= tolerance
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where the bf16 job runs")
    p.add_argument("--tokens", type=int, default=100_000, help="tokens of the bf16 job (default 100000)")
    p.add_argument("--compare-tokens", type=int, default=8192, help="tokens of the fp32 CPU job (default 8192)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--tolerance", type=float, default=5e-2)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/extract-gpu-tokens"))
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--device-map", action="store_true", help="the tested job loads the model with --device-map auto (dispatched)"
    )
    args = p.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_tokens: no CUDA device; run with --device cpu to test the script on the CPU")
    from transformers import AutoTokenizer

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    pool = corpus_pool()
    model_dir = build_model(work / "gpt2-768x4-v8000", pool, 8000)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    documents, _ = select_documents(pool, tokenizer, args.tokens, CONTEXT)
    head, _ = select_documents(pool, tokenizer, min(args.compare_tokens, args.tokens), CONTEXT)
    files = {}
    for name, docs in (("all", documents), ("head", head)):
        files[name] = work / f"{name}.jsonl"
        with files[name].open("w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)

    mapped = ["--device-map", "auto"] if args.device_map else []
    tested = run_job(
        model_dir, files["all"], work / "bf16.zarr", "bf16", args.device == "cuda", args.batch_size, mapped
    )
    reference = run_job(model_dir, files["head"], work / "fp32.zarr", "fp32", False, args.batch_size)
    report = {
        "device": args.device,
        "bf16": tested,
        "fp32_cpu": reference,
        "comparison": compare(work / "bf16.zarr", work / "fp32.zarr", args.tolerance),
    }
    c = report["comparison"]
    print(
        f"{args.device} bf16: {tested['samples']} tokens, {tested['rows_per_second']:.0f} tok/s "
        f"(wall {tested['wall_seconds']:.1f} s); cpu fp32: {reference['samples']} tokens, "
        f"{reference['rows_per_second']:.0f} tok/s"
    )
    print(
        f"{c['rows']} rows of {c['documents']} documents: identical {c['identical']}; row relative error max "
        f"{c['row_relative_error_max']:.4f} (mean {c['row_relative_error_mean']:.4f}, tolerance {args.tolerance}), "
        f"min cosine {c['min_cosine']:.5f}: {'ok' if c['ok'] else 'FAILED'}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if c["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
