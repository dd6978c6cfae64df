"""How a tensor-parallel group reaches the experts split over it (issue 48): transformers' two dispatches,
``ep_implementation="all_reduce"`` and ``"all_to_all"``, timed per batch on the CPU (gloo) at N = 2.

A Qwen3-MoE built from its config (hidden 256, 4 layers, 16 experts of width 256, top-k 2 and 8; random
weights, seed 0) is saved with ``save_pretrained``; both processes load it with
``DistributedConfig(tp_size=2, ep_size=2, ep_implementation=...)`` and time ``--repeats`` forwards of a
batch of ``T`` tokens (the median, after one warm-up), for each dispatch, top-k and batch size in turn, in
the same launch. Each forward's last hidden state is also compared with the other dispatch's.

    python benchmarks/moe_dispatch.py --json dispatch.json      # starts its own 2 processes (torchrun)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DISPATCHES = ("all_reduce", "all_to_all")


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results = []
    for top_k in args.top_k:
        folder = Path(args.folder) / f"top{top_k}"
        if rank == 0:
            torch.manual_seed(0)
            config = Qwen3MoeConfig(
                vocab_size=4096, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16,
                num_experts_per_tok=top_k, max_position_embeddings=8192,
            )  # fmt: skip
            Qwen3MoeForCausalLM(config).save_pretrained(folder)
        dist.barrier()
        last = {}
        for dispatch in DISPATCHES:
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32,
                distributed_config=DistributedConfig(tp_size=2, ep_size=2, ep_implementation=dispatch),
            ).eval()  # fmt: skip
            for tokens in args.tokens:
                ids = torch.randint(0, 4096, (tokens // 256, 256), generator=torch.Generator().manual_seed(1))
                times = []
                with torch.inference_mode():
                    for repeat in range(args.repeats + 1):
                        dist.barrier()
                        start = time.perf_counter()
                        out = model.model(input_ids=ids, use_cache=False).last_hidden_state
                        took = torch.tensor([time.perf_counter() - start])
                        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the group waits for its slowest rank
                        if repeat:
                            times.append(float(took))
                key = (top_k, tokens)
                difference = float((out - last[key]).abs().max()) if key in last else None
                last[key] = out
                results.append({"dispatch": dispatch, "top_k": top_k, "tokens": tokens,
                                "seconds": statistics.median(times), "max_abs_vs_all_reduce": difference})  # fmt: skip
            del model
    if rank == 0:
        print(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--top-k", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29617",
                   __file__, "--worker", "--folder", folder, "--repeats", str(args.repeats),
                   "--tokens", *map(str, args.tokens), "--top-k", *map(str, args.top_k)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        return done.returncode
    results = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{'dispatch':<11} {'top-k':>5} {'tokens':>6} {'s/batch':>8} {'max |diff|':>10}")
    for row in results:
        diff = "" if row["max_abs_vs_all_reduce"] is None else f"{row['max_abs_vs_all_reduce']:.1e}"
        print(f"{row['dispatch']:<11} {row['top_k']:>5} {row['tokens']:>6} {row['seconds']:>8.3f} {diff:>10}")
    if args.json:
        record = {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "results": results,
        }
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
