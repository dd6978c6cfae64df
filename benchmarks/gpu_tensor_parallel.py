"""--tensor-parallel on GPUs (NCCL): a Llama-shaped model saved from a config, run by 2 processes as one
group of 2 (and, with 4 or more GPUs, 2 groups of 2), against the same job in one process on one GPU.
Checks: every run exits 0, verify is clean, token ids are identical, and each layer's rows (the residual
stream, o_proj@input and down_proj@input, gathered over the group) are within 1e-3 of their scale in
float32 compute; prints tok/s and each rank's parameter bytes. Skipped (exit 0) with fewer than 2 GPUs.
While each job runs, ``nvidia-smi --query-compute-apps`` is sampled: every process must hold memory on one GPU
only, and no GPU may hold two of the job's processes (a rank's writer thread without a device guard makes a
context on GPU 0: issue 49).

    python benchmarks/gpu_tensor_parallel.py --workdir /tmp/extract-gpu-tp --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

LAYERS = ["model.layers.1", "model.layers.0.self_attn.o_proj@input", "model.layers.0.mlp.down_proj@input"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compute_apps() -> list[tuple[str, str]]:
    """(pid, GPU uuid) of every process holding GPU memory now, as nvidia-smi lists them (none without it)."""
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [line.split(",") for line in listed.stdout.splitlines() if line.count(",") == 1]
    return [(pid.strip(), gpu.strip()) for pid, gpu in rows]


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/extract-gpu-tp"))
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"tensor parallel: skipped ({gpus} GPU; it needs 2 or more)")
        return 0
    import transformers as tf
    from helpers.text_models import llama_tokenizer, real_documents, write_jsonl

    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    tf.LlamaForCausalLM(config).eval().save_pretrained(work / "llama")
    tokenizer.save_pretrained(work / "llama")
    documents = list(real_documents(min(args.documents, 300)))
    write_jsonl(work / "docs.jsonl", documents)
    common = ["--model", f"hf:{work / 'llama'}", "--layers", *LAYERS, "--data", f"text:{work / 'docs.jsonl'}",
              "--dtype", "float32", "--precision", "fp32", "--context-length", "256"]  # fmt: skip
    runs = {"one": (1, None)}
    runs["one_group"] = (2, 2)
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
        launch = [*launcher, *job]
        started = time.time()
        job = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen: dict[str, set[str]] = {}  # pid -> GPUs it held memory on, over the job's life
        most = 0  # the most compute processes one GPU held at once
        while job.poll() is None and time.time() - started < 150:
            apps = compute_apps()
            for pid, gpu in apps:
                seen.setdefault(pid, set()).add(gpu)
            most = max([most, *Counter(gpu for _, gpu in apps).values()])
            time.sleep(0.3)
        if job.poll() is None:
            job.kill()
        out, err = job.communicate()
        result = subprocess.CompletedProcess(launch, job.returncode, out, err)
        seconds = time.time() - started
        spread = {pid: sorted(gpus) for pid, gpus in seen.items() if len(gpus) > 1}
        gpu_check = {"processes_seen": len(seen), "most_processes_on_one_gpu": most, "on_several_gpus": spread}
        print(f"   nvidia-smi: {gpu_check}")
        if seen and (spread or most > 1):
            print(f"{name}: a process holds memory on several GPUs, or a GPU holds two of the job's processes")
            return 1
        print(f"== {name}: {processes} processes, --tensor-parallel {tensor or 1}: exit {result.returncode} in {seconds:.1f} s")
        print(result.stderr[-1500:])
        if result.returncode != 0:
            return 1
        verify = subprocess.run([sys.executable, "-m", "extract", "verify", str(out)], capture_output=True, text=True)
        import zarr

        group = zarr.open_group(out, mode="r")
        run = group.attrs["runs"][-1]
        report[name] = {"seconds": round(seconds, 1), "verify": verify.returncode, "summary": group.attrs["summary"],
                        "parameter_bytes": run.get("parameter_bytes"), "mesh": run.get("mesh"),
                        "gpus_per_process": gpu_check}  # fmt: skip
        if verify.returncode != 0:
            print(verify.stdout, verify.stderr)
            return 1
    import zarr

    reference = zarr.open_group(work / "one.zarr", mode="r")
    failed = False
    for name in runs:
        if name == "one":
            continue
        group = zarr.open_group(work / f"{name}.zarr", mode="r")
        same_ids = bool(np.array_equal(group["token_ids"][:], reference["token_ids"][:]))
        differences = {}
        for layer in LAYERS:
            got, expected = group["features"][layer][:], reference["features"][layer][:]
            scale = max(1.0, float(np.abs(expected).max()))
            differences[layer] = float(np.abs(got - expected).max()) / scale
        report[name].update(same_token_ids=same_ids, relative_difference=differences)
        print(f"{name}: token ids identical {same_ids}; largest difference / scale {differences}")
        failed |= not same_ids or any(value > 1e-3 for value in differences.values())
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
