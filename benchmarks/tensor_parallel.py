"""--tensor-parallel N on the CPU (gloo): memory per rank, rounding against one process, and the bytes a
gather of a sharded layer moves per token for a 70B-class shape (issue 36).

1. Memory per rank. A Llama-shaped model (default hidden 1024, MLP 2816, 16 layers, 16 heads of 64, 8 KV
   heads, vocab 32000: about 250M parameters, 1 GB of float32), random weights from seed 0, saved with
   ``save_pretrained``, run as an extract job on real text (standard-library docstrings) by 1 process and
   by 2 processes with ``--tensor-parallel 2``. Per rank: the parameter bytes the run record keeps
   (``runs[-1].parameter_bytes``), the peak RSS (VmHWM, written by each process itself as it exits, from a
   sitecustomize.py on the job's PYTHONPATH) and the largest RssAnon and RssFile seen by sampling
   /proc/PID/status every 0.05 s.
2. Rounding. The same job on the tiny Llama of the tests and on the large model: each stored layer at N=2
   against N=1 (largest |difference|, and that over the layer's largest magnitude), and a second N=2 run
   against the first, which must be byte-identical.
3. Gathered bytes per token, arithmetic from ``--shape`` (default Llama 3 70B in bf16): each sharded
   layer's row, what an all-gather makes each rank receive at each ``--sizes`` N, against the forward's
   own all-reduces.

    python benchmarks/tensor_parallel.py --json tp.json
    python benchmarks/tensor_parallel.py --layers 4 --json tp.json          # a smaller large model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

KIB, MIB = 1024, 1024 * 1024

AT_EXIT = """\
import atexit, json, os


def _tp_bench_peak():  # benchmarks/tensor_parallel.py: this process's peak RSS as it exits
    folder = os.environ.get("TP_BENCH_PEAKS")
    if not folder:
        return
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        record = {"pid": os.getpid(), "rank": os.environ.get("RANK"),
                  **{key: int(status[key].split()[0]) for key in ("VmHWM", "RssAnon", "RssFile")}}
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump(record, f)
    except Exception:
        pass


atexit.register(_tp_bench_peak)
"""


# ------------------------------------------------------------------------------ models and data


def save_large_llama(directory: Path, args: argparse.Namespace) -> int:
    """The large Llama from the shape flags, random init (seed 0), saved in float32; its parameter count.
    The tokenizer is the tests' 400-token BPE: the token ids only use the first 400 rows of the embedding,
    which changes nothing in the memory or the arithmetic of the layers."""
    import torch
    import transformers as tf
    from helpers.text_models import llama_tokenizer

    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(config).eval()
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    return count


def expected_ratio(directory: Path, size: int) -> float:
    """Parameter bytes per rank at ``size`` over those of one process, from the model's own plan: a
    parameter of a module the plan names is split ``size`` ways, every other one (embedding, norms) is
    held whole by every rank."""
    import fnmatch

    import torch
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    plan = {f"model.{k}": v for k, v in (config.base_model_tp_plan or {}).items()} | dict(model._tp_plan or {})
    whole = local = 0
    for name, parameter in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        split = any(fnmatch.fnmatchcase(module, pattern) for pattern in plan)
        whole += parameter.numel()
        local += parameter.numel() / size if split else parameter.numel()
    return local / whole


# ------------------------------------------------------------------------------ one job, watched


@dataclass
class Run:
    name: str
    processes: int
    seconds: float = 0.0
    parameter_bytes: list[int] = field(default_factory=list)
    peak_kib: dict[int, int] = field(default_factory=dict)  # rank -> VmHWM at exit
    anon_kib: dict[int, int] = field(default_factory=dict)  # rank -> largest RssAnon sampled
    file_kib: dict[int, int] = field(default_factory=dict)  # rank -> largest RssFile sampled
    launcher_peak_kib: int = 0  # accelerate's own process (wait4), N > 1 only


def _status(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            variables = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"extract" not in f.read():
                return None
    except OSError:
        return None
    return int(variables.get(b"RANK", b"0"))


def run_job(name: str, processes: int, job: list[str], workdir: Path, timeout: float) -> Run:
    from helpers.launches import descendants, launcher

    peaks = workdir / f"peaks-{name}"
    shutil.rmtree(peaks, ignore_errors=True)
    peaks.mkdir(parents=True)
    site = workdir / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(AT_EXIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "TP_BENCH_PEAKS": str(peaks),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # fmt: skip
    command = [*launcher(processes), "extract", *job] if processes > 1 else [sys.executable, "-m", "extract", *job]
    run = Run(name, processes)
    started = time.time()
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()

    def sample() -> None:  # RssAnon has no high-water mark of its own in /proc: sample it
        while not stop.is_set():
            for pid in [child.pid, *descendants(child.pid)]:
                rank = _rank_of(pid) if pid != child.pid or processes == 1 else None
                status = _status(pid) if rank is not None else None
                if status is None or "RssAnon" not in status:
                    continue
                run.anon_kib[rank] = max(run.anon_kib.get(rank, 0), int(status["RssAnon"].split()[0]))
                run.file_kib[rank] = max(run.file_kib.get(rank, 0), int(status["RssFile"].split()[0]))
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _, stderr = child.communicate(timeout=timeout)
    finally:
        stop.set()
        sampler.join()
    run.seconds = time.time() - started
    if child.returncode != 0:
        raise SystemExit(f"{name}: exit {child.returncode}\n{stderr[-3000:]}")
    for record in peaks.glob("*.json"):
        entry = json.loads(record.read_text())
        if entry["rank"] is None and processes > 1:
            run.launcher_peak_kib = entry["VmHWM"]
        else:
            run.peak_kib[int(entry["rank"] or 0)] = entry["VmHWM"]
    import zarr

    run.parameter_bytes = zarr.open_group(job[job.index("--out") + 1], mode="r").attrs["runs"][-1]["parameter_bytes"]
    return run


def job_flags(model: Path, documents: Path, layers: list[str], out: Path, tensor: int | None) -> list[str]:
    return [
        "--model", f"hf:{model}", "--layers", *layers, "--data", f"text:{documents}", "--dtype", "float32",
        "--context-length", "128", "--out", str(out), *(["--tensor-parallel", str(tensor)] if tensor else []),
    ]  # fmt: skip


def stored_layers(layer: int) -> list[str]:
    """The residual stream after ``layer``, and its two gathered layers: the attention's per-head output
    (o_proj's input) and the MLP's hidden activation (down_proj's input)."""
    prefix = f"model.layers.{layer}"
    return [prefix, f"{prefix}.self_attn.o_proj@input", f"{prefix}.mlp.down_proj@input"]


def compare(one: Path, two: Path, again: Path, layers: list[str]) -> dict[str, dict]:
    """Each layer: N=2 against N=1 (largest |difference|, over the layer's largest |value|) and N=2 against
    its rerun (the largest |difference| and whether the arrays are the same bytes)."""
    import zarr

    stores = [zarr.open_group(path, mode="r") for path in (one, two, again)]
    if not all(np.array_equal(stores[0]["token_ids"][:], store["token_ids"][:]) for store in stores[1:]):
        raise SystemExit("the runs stored different token ids")
    result = {}
    for layer in layers:
        reference, tensor, rerun = (store["features"][layer][:] for store in stores)
        difference = np.abs(tensor.astype(np.float64) - reference.astype(np.float64))
        scale = float(np.abs(reference).max())
        result[layer] = {
            "rows": int(reference.shape[0]), "width": int(reference.shape[-1]), "scale": scale,
            "max_abs": float(difference.max()), "max_relative_to_scale": float(difference.max()) / scale,
            "rerun_max_abs": float(np.abs(tensor - rerun).max()),
            "rerun_same_bytes": tensor.dtype == rerun.dtype and tensor.tobytes() == rerun.tobytes(),
        }  # fmt: skip
    return result


# ------------------------------------------------------------------------------ bytes per token


def gather_arithmetic(args: argparse.Namespace) -> dict:
    """Per token, from the shape: a sharded layer's row is width × b bytes; an all-gather gives each rank the
    other N-1 slices, (N-1)/N of the row. The forward all-reduces the residual (hidden × b) after o_proj and
    after down_proj, 2 per layer, plus the embedding's (split by vocabulary); a ring all-reduce makes each
    rank send and receive 2(N-1)/N of it: (2L + 1) × 2(N-1)/N × hidden × b per token for the whole forward."""
    b, hidden = args.shape_bytes, args.shape_hidden
    widths = {
        "model.layers.N (replicated)": (hidden, False),
        "self_attn.o_proj@input (z)": (args.shape_heads * args.shape_head_dim, True),
        "self_attn.q_proj": (args.shape_heads * args.shape_head_dim, True),
        "self_attn.k_proj, v_proj": (args.shape_kv_heads * args.shape_head_dim, True),
        "mlp.down_proj@input (hidden)": (args.shape_intermediate, True),
    }
    rows = {}
    for name, (width, sharded) in widths.items():
        rows[name] = {"width": width, "row_bytes": width * b,
                      **{f"received_N{n}": (width * b * (n - 1) / n if sharded else 0) for n in args.sizes}}  # fmt: skip
    # Llama's plan also splits the embedding by vocabulary ("embedding_rowwise"): one more all-reduce
    all_reduces = 2 * args.shape_layers + args.shape_embedding_all_reduces
    forward = {
        n: {"per_all_reduce": 2 * (n - 1) / n * hidden * b,
            "per_layer": 2 * 2 * (n - 1) / n * hidden * b,
            "per_token": all_reduces * 2 * (n - 1) / n * hidden * b}
        for n in args.sizes
    }  # fmt: skip
    return {"shape": {k[6:]: v for k, v in vars(args).items() if k.startswith("shape_")}, "rows": rows,
            "forward": forward}  # fmt: skip


def _size(value: float) -> str:
    if value == 0:
        return "0"
    if value >= MIB:
        return f"{value / MIB:.3g} MiB"
    return f"{value / KIB:.3g} KiB"


def print_arithmetic(report: dict, sizes: list[int]) -> None:
    shape = report["shape"]
    print(f"\n## Gathered bytes per token: hidden {shape['hidden']}, MLP {shape['intermediate']}, {shape['heads']} "
          f"heads x {shape['head_dim']} ({shape['kv_heads']} KV), {shape['layers']} layers, {shape['bytes']} B a value")  # fmt: skip
    print("| layer | width | row | " + " | ".join(f"received per rank at N = {n}" for n in sizes) + " |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in sizes) + " |")
    for name, row in report["rows"].items():
        cells = " | ".join(_size(row[f"received_N{n}"]) for n in sizes)
        print(f"| `{name}` | {row['width']} | {_size(row['row_bytes'])} | {cells} |")
    print("\n| forward's all-reduces (ring) | " + " | ".join(f"N = {n}" for n in sizes) + " |")
    print("| --- | " + " | ".join("---:" for _ in sizes) + " |")
    for key, label in (("per_all_reduce", "one all-reduce of the residual"), ("per_layer", "per layer (2)"),
                       ("per_token", f"per token, {shape['layers']} layers + {shape['embedding_all_reduces']}")):  # fmt: skip
        print(f"| {label} | " + " | ".join(_size(report["forward"][n][key]) for n in sizes) + " |")
    hidden = report["rows"]["mlp.down_proj@input (hidden)"]
    for n in sizes:
        gathered, forward = hidden[f"received_N{n}"], report["forward"][n]
        print(f"N = {n}: gathering down_proj@input once is {gathered / forward['per_layer']:.2f}x one layer's "
              f"all-reduces and {100 * gathered / forward['per_token']:.2f}% of the whole forward's")  # fmt: skip


# ------------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/extract-tp-bench"))
    parser.add_argument("--documents", type=int, default=48, help="docstrings in the corpus")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--shape-hidden", type=int, default=8192)
    parser.add_argument("--shape-intermediate", type=int, default=28672)
    parser.add_argument("--shape-heads", type=int, default=64)
    parser.add_argument("--shape-head-dim", type=int, default=128)
    parser.add_argument("--shape-kv-heads", type=int, default=8)
    parser.add_argument("--shape-layers", type=int, default=80)
    parser.add_argument(
        "--shape-embedding-all-reduces",
        type=int,
        default=1,
        help="all-reduces outside the layers (Llama's plan: the embedding's, 1)",
    )
    parser.add_argument("--shape-bytes", type=int, default=2, help="bytes per value (bf16: 2)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8], help="tensor-parallel sizes for part 3")
    parser.add_argument("--skip-jobs", action="store_true", help="part 3 only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    report: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
                                "load_at_start": os.getloadavg()}}  # fmt: skip
    if not args.skip_jobs:
        from helpers.text_models import real_documents, save_text_model, write_jsonl

        work = args.workdir
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        documents = work / "docs.jsonl"
        write_jsonl(documents, list(real_documents(args.documents, seed=5)))
        tiny = save_text_model("llama", work / "tiny")
        large = work / "large"
        parameters = save_large_llama(large, args)
        print(f"large model: {parameters / 1e6:.1f}M parameters, {parameters * 4 / 1e9:.2f} GB float32")
        report["large_parameters"] = parameters
        for model_name, model, layer in (("tiny", tiny, 1), ("large", large, args.layers // 2)):
            layers = stored_layers(layer)
            runs = {}
            for name, processes, tensor in (("N1", 1, None), ("N2", 2, 2), ("N2_rerun", 2, 2)):
                out = work / f"{model_name}-{name}.zarr"
                runs[name] = run_job(f"{model_name}-{name}", processes, job_flags(model, documents, layers, out, tensor),
                                     work, args.timeout)  # fmt: skip
                print(f"{model_name} {name}: {runs[name].seconds:.1f} s")
            rounding = compare(*(work / f"{model_name}-{name}.zarr" for name in runs), layers)
            report[model_name] = {
                "layers": layers, "rounding": rounding, "expected_ratio_N2": expected_ratio(model, 2),
                "runs": {name: vars(run) for name, run in runs.items()},
            }  # fmt: skip
            print_model(model_name, report[model_name])
        report["load_at_end"] = os.getloadavg()
    arithmetic = gather_arithmetic(args)
    report["gather"] = arithmetic
    print_arithmetic(arithmetic, args.sizes)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


def print_model(name: str, entry: dict) -> None:
    runs = entry["runs"]
    one = runs["N1"]["parameter_bytes"][0]
    print(f"\n## {name}: memory per rank (MiB; RssAnon, RssFile: largest sampled)")
    print("| run | rank | parameter bytes | / N=1 | peak RSS (VmHWM) | RssAnon | RssFile | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for run_name, run in runs.items():
        for rank, size in enumerate(run["parameter_bytes"]):
            print(f"| {run_name} | {rank} | {size / MIB:.1f} | {size / one:.3f} | {run['peak_kib'].get(rank, 0) / KIB:.0f} | "
                  f"{run['anon_kib'].get(rank, 0) / KIB:.0f} | {run['file_kib'].get(rank, 0) / KIB:.0f} | {run['seconds']:.1f} |")  # fmt: skip
    print(f"expected parameter ratio at N=2 from the plan: {entry['expected_ratio_N2']:.4f}")
    print(f"\n## {name}: N=2 against N=1, and N=2 against its rerun")
    print("| layer | rows x width | largest abs | / layer scale | scale | rerun largest abs | rerun same bytes |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for layer, row in entry["rounding"].items():
        print(f"| `{layer}` | {row['rows']} x {row['width']} | {row['max_abs']:.3g} | {row['max_relative_to_scale']:.3g} | "
              f"{row['scale']:.3g} | {row['rerun_max_abs']:.3g} | {row['rerun_same_bytes']} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
