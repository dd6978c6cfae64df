"""``--sae`` (issue 32) on CPU: tokens per second of one job with and without an SAE of 16k latents on
the same layer of a small GPT-2, and the bytes per token of the codes stored sparse (k of them: int32 +
float16) against the dense float16 codes (d_sae x 2 bytes).

    python benchmarks/sae_codes.py [--documents 200] [--d-sae 16384] [--k 64]

Prints one line ``SAE_CODES {json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import zarr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from text_models import real_documents, write_jsonl  # noqa: E402

from extract import JobSpec, run  # noqa: E402

HOOK = "blocks.1.hook_resid_post"


def _model(directory: Path, width: int) -> Path:
    import transformers as tf
    from text_models import gpt2_tokenizer

    tokenizer = gpt2_tokenizer()
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=len(tokenizer), n_positions=256, n_embd=width, n_layer=4, n_head=4,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    tf.GPT2LMHeadModel(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _sae(directory: Path, d_in: int, d_sae: int) -> Path:
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata

    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=d_in, d_sae=d_sae, metadata=SAEMetadata(hook_name=HOOK)))
    with torch.no_grad():
        sae.W_enc.normal_(0, d_in**-0.5)
        sae.b_enc.zero_()  # about half the latents active on a row: more than a trained SAE, so top-k always cuts
    sae.save_model(directory)
    return directory


def _job(root: Path, model: Path, out: str, sae: list[str] | None, k: int) -> tuple[float, int]:
    spec = JobSpec(
        model=f"hf:{model}", layers=[HOOK], data=f"text:{root / 'docs.jsonl'}", out=str(root / out),
        context_length=128, tokens_per_batch=1024, sae=sae, sae_k=k,
    )  # fmt: skip
    started = time.perf_counter()
    summary = run(spec, log=lambda line: None)
    return time.perf_counter() - started, summary.samples


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--documents", type=int, default=200)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--d-sae", type=int, default=16384)
    p.add_argument("--k", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        write_jsonl(root / "docs.jsonl", list(real_documents(args.documents, seed=1)))
        model = _model(root / "model", args.width)
        sae = _sae(root / "sae", args.width, args.d_sae)
        plain, tokens = _job(root, model, "plain.zarr", None, args.k)
        coded, _ = _job(root, model, "codes.zarr", [f"{HOOK}={sae}"], args.k)
        group = zarr.open_group(root / "codes.zarr", mode="r")
        indices = group[f"latents/{HOOK}/indices"][:]
        stored = sum(group[f"latents/{HOOK}/{name}"].nbytes_stored() for name in ("indices", "values"))
        result = {
            "tokens": tokens, "width": args.width, "d_sae": args.d_sae, "k": args.k,
            "tokens_per_s_without_sae": round(tokens / plain, 1), "tokens_per_s_with_sae": round(tokens / coded, 1),
            "mean_active_kept": round(float((indices >= 0).sum(1).mean()), 1),
            "sparse_bytes_per_token": 6 * args.k, "sparse_stored_bytes_per_token": round(stored / tokens, 1),
            "dense_float16_bytes_per_token": 2 * args.d_sae,
        }  # fmt: skip
        print("SAE_CODES", json.dumps(result))


if __name__ == "__main__":
    main()
