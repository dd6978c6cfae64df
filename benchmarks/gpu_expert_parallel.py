"""--tensor-parallel on GPUs (NCCL) for a mixture of experts (issue 48): a Qwen3-MoE saved from a config,
its experts split over the group by transformers' expert plan (all-to-all dispatch), run by 2 processes as
one group of 2 (and, with 4 or more GPUs, 2 groups of 2), against the same job in one process on one GPU.
Checks: every run exits 0, verify is clean, token ids are identical, the residual stream, the MoE block's
output and the gathered heads are within 1e-3 of their scale and the router logits within 1e-3, the top-k
experts are the same for at least 99% of the tokens (the rest are near ties), and each rank holds at most
0.52 of the parameter bytes of one process; prints tok/s. Skipped (exit 0) with fewer than 2 GPUs.

    python benchmarks/gpu_expert_parallel.py --workdir /tmp/extract-gpu-ep --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_tensor_parallel import free_port  # noqa: E402

ROUTER = "model.layers.1.mlp@router"
LAYERS = ["model.layers.1", "model.layers.1.mlp", "model.layers.0.self_attn.o_proj@input", ROUTER]


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/extract-gpu-ep"))
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"expert parallel: skipped ({gpus} GPU; it needs 2 or more)")
        return 0
    import transformers as tf
    import zarr
    from helpers.text_models import llama_tokenizer, real_documents, write_jsonl

    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=512, moe_intermediate_size=256,
                               num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                               num_experts=16, num_experts_per_tok=4, max_position_embeddings=512,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    tf.Qwen3MoeForCausalLM(config).eval().save_pretrained(work / "moe")
    tokenizer.save_pretrained(work / "moe")
    write_jsonl(work / "docs.jsonl", list(real_documents(min(args.documents, 300))))
    common = ["--model", f"hf:{work / 'moe'}", "--layers", *LAYERS, "--data", f"text:{work / 'docs.jsonl'}",
              "--dtype", "float32", "--precision", "fp32", "--context-length", "256"]  # fmt: skip
    runs = {"one": (1, None), "one_group": (2, 2)}
    if gpus >= 4:
        runs["two_groups"] = (4, 2)
    report: dict[str, dict] = {}
    for name, (processes, tensor) in runs.items():
        out = work / f"{name}.zarr"
        job = ["-m", "extract", *common, "--out", str(out), *(["--tensor-parallel", str(tensor)] if tensor else [])]
        launcher = [sys.executable]
        if processes > 1:
            launcher += ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                         "--main_process_port", str(free_port())]  # fmt: skip
        started = time.time()
        result = subprocess.run([*launcher, *job], capture_output=True, text=True, timeout=150)
        seconds = time.time() - started
        print(
            f"== {name}: {processes} processes, --tensor-parallel {tensor or 1}: exit {result.returncode} in {seconds:.1f} s"
        )
        print(result.stderr[-1500:])
        if result.returncode != 0:
            return 1
        verify = subprocess.run([sys.executable, "-m", "extract", "verify", str(out)], capture_output=True, text=True)
        group = zarr.open_group(out, mode="r")
        run = group.attrs["runs"][-1]
        report[name] = {"seconds": round(seconds, 1), "verify": verify.returncode, "summary": group.attrs["summary"],
                        "parameter_bytes": run.get("parameter_bytes"), "mesh": run.get("mesh")}  # fmt: skip
        if verify.returncode != 0:
            print(verify.stdout, verify.stderr)
            return 1
    reference = zarr.open_group(work / "one.zarr", mode="r")
    whole = report["one"]["parameter_bytes"][0]
    failed = False
    for name in runs:
        if name == "one":
            continue
        group = zarr.open_group(work / f"{name}.zarr", mode="r")
        same_ids = bool(np.array_equal(group["token_ids"][:], reference["token_ids"][:]))
        differences = {}
        for layer in LAYERS:
            got, expected = group["features"][layer][:], reference["features"][layer][:]
            scale = 1.0 if layer == ROUTER else max(1.0, float(np.abs(expected).max()))
            differences[layer] = float(np.abs(got - expected).max()) / scale
        experts = [np.sort(g[f"latents/{ROUTER}/indices"][:], axis=1) for g in (group, reference)]
        same_experts = float((experts[0] == experts[1]).all(axis=1).mean())
        share = max(report[name]["parameter_bytes"]) / whole
        report[name].update(same_token_ids=same_ids, relative_difference=differences, same_experts=same_experts,
                            largest_share_of_parameters=share)  # fmt: skip
        print(
            f"{name}: token ids identical {same_ids}; largest difference / scale {differences}; same top-k "
            f"experts for {same_experts:.4f} of tokens; largest rank holds {share:.3f} of the parameters"
        )
        failed |= not same_ids or any(v > 1e-3 for v in differences.values()) or same_experts < 0.99 or share > 0.52
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
