"""``--sae`` on CUDA against the same job on the CPU: a GPT-2 of width 256 (4 blocks, random weights, saved
locally) and a standard SAE of 4096 latents on ``blocks.1.hook_resid_post`` (built with sae_lens, saved
locally), top 32 codes per token, float32 compute and storage, over real documents (standard-library
docstrings). Each job runs in a process of its own (the CPU one with ``CUDA_VISIBLE_DEVICES=``).

Checks: token ids identical; per token, the kept latents' indices the same set on at least 99% of the rows
(a code at the top-k's edge may swap with its neighbour under another summation order); the values of the
latents both kept within 1e-3 of the row's largest code; every chunk's statistics row (count, sum, max, rows;
``latents/<layer>/stats``) within 1e-3 of the CPU's scale per column. Exits 1 when a check fails.

    python benchmarks/gpu_sae.py --json gpu_sae.json                 # on a GPU
    python benchmarks/gpu_sae.py --device cpu --documents 20         # tests the script without one
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

HOOK = "blocks.1.hook_resid_post"


def _model(directory: Path, width: int) -> Path:
    import torch
    import transformers as tf
    from helpers.text_models import gpt2_tokenizer

    tokenizer = gpt2_tokenizer()
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=len(tokenizer), n_positions=256, n_embd=width, n_layer=4, n_head=4,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    tf.GPT2LMHeadModel(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _sae(directory: Path, d_in: int, d_sae: int) -> Path:
    import sae_lens
    import torch
    from sae_lens.saes.sae import SAEMetadata

    torch.manual_seed(1)
    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=d_in, d_sae=d_sae, metadata=SAEMetadata(hook_name=HOOK)))
    with torch.no_grad():
        sae.W_enc.normal_(0, d_in**-0.5)
        sae.b_enc.fill_(-0.5)  # a few hundred latents active on a row: top-k cuts, as with a real SAE
    sae.save_model(directory)
    return directory


def _job(work: Path, model: Path, sae: Path, out: str, device: str, k: int) -> float:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [
        sys.executable, "-m", "extract", "--model", f"hf:{model}", "--layers", HOOK, "--data",
        f"text:{work / 'docs.jsonl'}", "--out", str(work / out), "--dtype", "float32", "--precision", "fp32",
        "--context-length", "128", "--chunk-size", "512", "--sae", f"{HOOK}={sae}", "--sae-k", str(k),
    ]  # fmt: skip
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    seconds = time.time() - started
    print(f"== {out} on {device}: exit {result.returncode} in {seconds:.1f} s")
    if result.returncode != 0:
        print(result.stderr[-3000:])
        raise SystemExit(1)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: both jobs on the CPU")
    parser.add_argument("--documents", type=int, default=120)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--d-sae", type=int, default=4096)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/extract-gpu-sae"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch
    import zarr
    from helpers.text_models import real_documents, write_jsonl

    from extract.names.latents import indices_path, stats_path, values_path

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_sae: no CUDA device (torch.cuda.is_available() is False); use --device cpu to test the script")
        return 1
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    write_jsonl(work / "docs.jsonl", list(real_documents(args.documents, seed=2)))
    model = _model(work / "model", args.width)
    sae = _sae(work / "sae", args.width, args.d_sae)
    seconds = {"device": _job(work, model, sae, "device.zarr", args.device, args.k)}
    seconds["cpu"] = _job(work, model, sae, "cpu.zarr", "cpu", args.k)
    device, cpu = zarr.open_group(work / "device.zarr", mode="r"), zarr.open_group(work / "cpu.zarr", mode="r")
    same_ids = bool(np.array_equal(device["token_ids"][:], cpu["token_ids"][:]))
    got_i, want_i = device[indices_path(HOOK)][:], cpu[indices_path(HOOK)][:]
    got_v, want_v = device[values_path(HOOK)][:].astype(np.float64), cpu[values_path(HOOK)][:].astype(np.float64)
    same_set = np.array([set(a) == set(b) for a, b in zip(got_i.tolist(), want_i.tolist(), strict=True)])
    scale = np.maximum(np.abs(want_v).max(1), 1e-12)
    value_error = 0.0
    for r in np.flatnonzero(same_set):
        order_got, order_want = np.argsort(got_i[r]), np.argsort(want_i[r])
        value_error = max(value_error, float(np.abs(got_v[r][order_got] - want_v[r][order_want]).max() / scale[r]))
    stats_got, stats_want = device[stats_path(HOOK)][:], cpu[stats_path(HOOK)][:]
    column_scale = np.maximum(np.abs(stats_want).max(0), 1.0)
    stats_error = float((np.abs(stats_got - stats_want) / column_scale).max())
    report = {
        "device": args.device, "tokens": int(len(got_i)), "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "same_token_ids": same_ids, "rows_same_latents": round(float(same_set.mean()), 5),
        "largest_value_error_over_row_scale": value_error, "largest_stats_error_over_column_scale": stats_error,
    }  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    failed = not same_ids or same_set.mean() < 0.99 or value_error > 1e-3 or stats_error > 1e-3
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
