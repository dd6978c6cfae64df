"""Memory per rank of a mixture-of-experts model under --tensor-parallel N on the CPU (gloo), issue 48.

A Qwen3-MoE of about 1 GB in float32 (hidden 768, 10 layers, 12 heads of 64 and 4 KV heads, 32 experts of
width 256, top-8, vocab 32000: 254M parameters, 74% of them experts), random weights from seed 0, saved with
``save_pretrained``, is run as an extract job on real text (standard-library docstrings) by 1 process and by
2 processes with ``--tensor-parallel 2``, where transformers' expert-parallel plan gives each rank half the
experts. Per rank: the parameter bytes of the run record (``runs[-1].parameter_bytes``), the peak RSS
(VmHWM, as the process exits) and the largest RssAnon and RssFile sampled every 0.05 s (the measurement of
``benchmarks/tensor_parallel.py``, whose code this reuses), with the split the plan predicts: each parameter
of a module the tensor or expert plan names held 1/N, every other one whole.

    python benchmarks/moe_memory.py --json moe_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tensor_parallel import KIB, MIB, ROOT, run_job  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))


def save_moe(directory: Path, args: argparse.Namespace) -> tuple[int, int]:
    """The Qwen3-MoE from the flags, random init (seed 0), saved in float32: its parameters, and those of
    its experts."""
    import torch
    import transformers as tf
    from helpers.text_models import llama_tokenizer

    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, moe_intermediate_size=args.expert_width,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, num_experts=args.experts, num_experts_per_tok=args.top_k,
        max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = tf.Qwen3MoeForCausalLM(config).eval()
    count = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    return count, experts


def expected_ratio(directory: Path, size: int) -> float:
    """Parameter bytes per rank at ``size`` over one process's, from the model's own plans: a parameter the
    tensor or the expert plan splits is held 1/size, every other one (norms, routers) whole."""
    import torch
    import transformers as tf
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    config = tf.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    plans = {**(model.tp_plan or {}), **(model.ep_plan or {})}
    whole = local = 0
    for name, parameter in model.named_parameters():
        pattern = replace_layer_number_by_wildcard(name)
        module = pattern.rsplit(".", 1)[0]
        split = pattern in plans or module in plans
        whole += parameter.numel()
        local += parameter.numel() / size if split else parameter.numel()
    return local / whole


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/extract-moe-bench"))
    parser.add_argument("--documents", type=int, default=32, help="docstrings in the corpus")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per job")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from helpers.text_models import real_documents, write_jsonl

    args.workdir.mkdir(parents=True, exist_ok=True)
    documents = write_jsonl(args.workdir / "docs.jsonl", real_documents(args.documents, seed=3))
    model = args.workdir / "qwen3-moe"
    parameters, experts = save_moe(model, args)
    print(f"Qwen3-MoE: {parameters / 1e6:.1f}M parameters ({experts / parameters:.2f} experts), "
          f"{parameters * 4 / 1e9:.2f} GB float32")  # fmt: skip
    layers = [f"model.layers.{args.layers // 2}", f"model.layers.{args.layers // 2}.mlp@router"]
    runs = {}
    for name, processes in (("N=1", 1), ("N=2", 2)):
        out = args.workdir / f"{name}.zarr"
        job = ["--model", f"hf:{model}", "--layers", *layers, "--data", f"text:{documents}", "--dtype", "float32",
               "--context-length", "128", "--overwrite", "--out", str(out),
               *(["--tensor-parallel", str(processes)] if processes > 1 else [])]  # fmt: skip
        runs[name] = run_job(f"moe-{name}", processes, job, args.workdir, args.timeout)
        print(f"{name}: {runs[name].seconds:.1f} s")
    one = runs["N=1"].parameter_bytes[0]
    print(
        "\n| run | rank | parameter bytes (MiB) | / N=1 | predicted | peak RSS (VmHWM) | RssAnon | RssFile | wall s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    predicted = {"N=1": 1.0, "N=2": expected_ratio(model, 2)}
    for name, run in runs.items():
        for rank, size in enumerate(run.parameter_bytes):
            print(f"| {name} | {rank} | {size / MIB:.1f} | {size / one:.3f} | {predicted[name]:.3f} | "
                  f"{run.peak_kib.get(rank, 0) / KIB:.0f} | {run.anon_kib.get(rank, 0) / KIB:.0f} | "
                  f"{run.file_kib.get(rank, 0) / KIB:.0f} | {run.seconds:.1f} |")  # fmt: skip
    if args.json:
        record = {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "parameters": parameters, "experts": experts, "predicted": predicted,
            "runs": {name: asdict(run) for name, run in runs.items()},
        }  # fmt: skip
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
