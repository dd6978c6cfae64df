"""Hook overhead and end-to-end throughput of ``extract`` against the usual ways of getting activations.

Variants, timed in one process, interleaved (the order rotates every repeat), median of the repeats:

    a  plain      full forward, no hooks
    b  fx         torchvision ``create_feature_extractor`` for the layers (truncated graph, outputs on device)
    c  tutorial   ``register_forward_hook`` doing ``output.clone().cpu()`` synchronously, full forward
    d  capture    ``Capture(stop=True, sink=HostStaging.stage)``, slots released as soon as they are ready
    e  store      (d) + ``ChunkWriter`` + ``FeatureStore`` on local disk (float16, zstd: the job defaults)
    f  cli        ``python -m extract ... --data synthetic:N`` in a subprocess (data loading included)

On CUDA, ``--copy compute`` (or ``both``) adds d/e with a sink that copies on the compute stream
(``value.to('cpu')``, synchronous) instead of ``HostStaging``'s side stream.

    python benchmarks/hook_overhead.py --json hook.json
    python benchmarks/hook_overhead.py --rss-check --json rss.json   # peak RSS of (f) at N=256 vs N=2048
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extract.capture.hooks import Capture  # noqa: E402
from extract.capture.staging import HostStaging  # noqa: E402
from extract.job.plan import default_chunk_size  # noqa: E402
from extract.job.resources import default_writer_threads  # noqa: E402
from extract.job.spec import DEFAULT_COMPRESSORS, JobSpec  # noqa: E402
from extract.store.chunks import Plan  # noqa: E402
from extract.store.store import FeatureStore  # noqa: E402
from extract.store.writer import ChunkWriter  # noqa: E402


def submit(writer: ChunkWriter, slot: Any, indices: torch.Tensor, labels: torch.Tensor) -> None:
    """``ChunkWriter.submit`` with every sample valid."""
    writer.submit(slot, indices, labels, np.ones(len(indices), dtype=bool))


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
STORE_DTYPE = JobSpec.dtype  # "float16"
STORE_COMPRESSOR = DEFAULT_COMPRESSORS["images"]  # "zstd"


# ---------------------------------------------------------------------------------------------- timing


class Clock:
    """Wall time of a block; on CUDA measured with events on the current stream after a synchronize."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    @contextlib.contextmanager
    def measure(self, out: list[float], cpu: list[float]):
        """Appends the block's wall seconds to ``out`` and the process's CPU seconds (all threads) to ``cpu``."""
        c0 = time.process_time()
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            yield
            out.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)


# -------------------------------------------------------------------------------------------- variants


class Variant:
    """``setup()`` before each timed repeat (untimed), ``run(batch)`` per batch, ``finish()`` at the end (timed)."""

    name = ""
    label = ""
    bytes_per_image = 0  # bytes that reach the host per image (CUDA report)

    def setup(self) -> None:
        pass

    def run(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class Plain(Variant):
    name, label = "a", "plain forward, no hooks"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def run(self, x):
        self.model(x)


class FeatureExtractor(Variant):
    name, label = "b", "torchvision create_feature_extractor"

    def __init__(self, model: nn.Module, layers: list[str]) -> None:
        self.fx = create_feature_extractor(model, return_nodes={layer: layer for layer in layers})

    def run(self, x):
        self.outputs = self.fx(x)


class Tutorial(Variant):
    name, label = "c", "tutorial hook: output.clone().cpu(), full forward"

    def __init__(self, model: nn.Module, layers: list[str], bytes_per_image: int) -> None:
        self.model, self.layers, self.outputs = model, layers, {}
        self.bytes_per_image = bytes_per_image
        self.handles = []

    def setup(self):
        modules = dict(self.model.named_modules())
        for layer in self.layers:

            def hook(module, inputs, output, layer=layer):
                self.outputs[layer] = output.clone().cpu()

            self.handles.append(modules[layer].register_forward_hook(hook))

    def run(self, x):
        self.model(x)

    def close(self):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def compute_stream_sink(staging: HostStaging) -> Callable[[str, torch.Tensor], None]:
    """Copy on the compute stream, synchronously: ``value.to('cpu')`` into the current slot."""

    def sink(name: str, value: torch.Tensor) -> None:
        slot = staging.current
        slot.buffers[name][: value.shape[0]].copy_(value.to("cpu"))
        slot.rows = value.shape[0]

    return sink


class CaptureOnly(Variant):
    """(d): the capture hooks and host staging, no storage: a slot is released once its copies are done."""

    def __init__(self, model, layers, shapes, batch_size, device, copy: str) -> None:
        self.name = "d" if copy == "side" else "d_compute"
        self.label = "extract Capture + HostStaging, no storage" + ("" if copy == "side" else " (compute-stream copy)")
        self.staging = HostStaging(shapes, batch_size, getattr(torch, STORE_DTYPE), device)
        sink = self.staging.stage if copy == "side" else compute_stream_sink(self.staging)
        self.capture = Capture(model, layers, stop=True, sink=sink)
        self.sealed: deque = deque()
        self.bytes_per_image = bytes_per_sample(shapes)

    def setup(self):
        self.capture.__enter__()

    def run(self, x):
        while len(self.sealed) >= self.staging.num_slots - 1:
            self._release()
        slot = self.staging.acquire()
        self.capture.forward(x)
        self.staging.seal(slot)
        self.sealed.append(slot)

    def _release(self):
        slot = self.sealed.popleft()
        HostStaging.wait(slot)
        self.staging.release(slot)

    def finish(self):
        while self.sealed:
            self._release()

    def close(self):
        self.capture.remove()


class CaptureStore(Variant):
    """(e): the capture hooks, host staging and the chunk writer into a fresh zarr store each repeat."""

    def __init__(self, model, layers, shapes, batch_size, device, copy, num_samples, workdir, writer_threads) -> None:
        self.name = "e" if copy == "side" else "e_compute"
        self.label = "extract Capture + HostStaging + ChunkWriter + zarr" + (
            "" if copy == "side" else " (compute-stream copy)"
        )
        self.shapes, self.batch_size, self.workdir = shapes, batch_size, Path(workdir)
        self.writer_threads = writer_threads
        self.plan = Plan(num_samples, default_chunk_size(num_samples, max_sample_bytes(shapes)))
        self.staging = HostStaging(shapes, batch_size, getattr(torch, STORE_DTYPE), device)
        sink = self.staging.stage if copy == "side" else compute_stream_sink(self.staging)
        self.capture = Capture(model, layers, stop=True, sink=sink)
        self.bytes_per_image = bytes_per_sample(shapes)
        self.stored = self.raw = 0

    def setup(self):
        self.capture.__enter__()
        path = self.workdir / f"{self.name}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        self.store = FeatureStore.create(
            path,
            shapes=self.shapes,
            num_samples=self.plan.num_samples,
            chunk_size=self.plan.chunk_size,
            dtype=STORE_DTYPE,
            compressor=STORE_COMPRESSOR,
            attrs={"layers": list(self.shapes)},
        )
        self.writer = ChunkWriter(self.store, self.staging, self.plan, self.shapes, threads=self.writer_threads)
        self.next = 0

    def run(self, x):
        rows = len(x)
        slot = self.staging.acquire(self.writer.check)
        self.capture.forward(x)
        self.staging.seal(slot)
        indices = torch.arange(self.next, self.next + rows)
        submit(self.writer, slot, indices, torch.zeros(rows, dtype=torch.int64))
        self.next += rows

    def finish(self):
        self.writer.close()
        assert self.next == self.plan.num_samples and not self.store.pending_chunks()
        self.stored = self.store.stored_bytes()
        self.raw = self.plan.num_samples * self.bytes_per_image

    def close(self):
        self.capture.remove()


def bytes_per_sample(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(max_sample_bytes({k: v}) for k, v in shapes.items())


def max_sample_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    itemsize = torch.empty((), dtype=getattr(torch, STORE_DTYPE)).element_size()
    return max(math.prod(shape) * itemsize for shape in shapes.values())


# ---------------------------------------------------------------------------------- hook micro-benchmark


def micro(calls: int = 20000, repeats: int = 7) -> dict[str, Any]:
    """Per-call cost (µs) of one hooked ``nn.Identity`` on a (4, 16) CPU tensor: no hook, a no-op hook,
    extract's capture hook (stop=True, HostStaging sink) and the clone-keeping capture."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity())
    x = torch.randn(4, 16)
    staging = HostStaging({"0": (16,)}, 4, torch.float16, torch.device("cpu"), slots=1)
    staging.acquire()

    def bare():
        return lambda: model(x)

    @contextlib.contextmanager
    def noop_hook():
        handle = model[0].register_forward_hook(lambda m, i, o: None)
        try:
            yield lambda: model(x)
        finally:
            handle.remove()

    @contextlib.contextmanager
    def capture_sink():
        with Capture(model, ["0"], stop=True, sink=staging.stage) as cap:
            yield lambda: cap.forward(x)

    @contextlib.contextmanager
    def capture_clone():
        with Capture(model, ["0"]) as cap:
            yield lambda: cap.forward(x)

    cases: dict[str, Callable[[], Any]] = {
        "no hook": lambda: contextlib.nullcontext(bare()),
        "no-op hook": noop_hook,
        "capture (stop + staging sink)": capture_sink,
        "capture (keep clone)": capture_clone,
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for name, make in cases.items():
                with make() as call:
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        call()
                    if repeat:  # the first round is warm-up
                        samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "tensor": [4, 16],
        "calls": calls,
        "repeats": repeats,
        "us_per_call": med,
        "capture_minus_noop_us": med["capture (stop + staging sink)"] - med["no-op hook"],
    }


# ------------------------------------------------------------------------------------------ CLI (f)


def run_cli(
    args: argparse.Namespace, num_samples: int, out: Path, model: str, image_size: int, batch_size: int
) -> dict[str, Any]:
    """``python -m extract`` in a subprocess; img/s from the store's summary, peak RSS from ``wait4``."""
    command = [
        sys.executable,
        "-m",
        "extract",
        "--model",
        model,
        "--weights",
        "none",
        "--layers",
        *args.layers,
        "--data",
        f"synthetic:{num_samples}",
        "--image-size",
        str(image_size),
        "--batch-size",
        str(batch_size),
        "--out",
        str(out),
        "--overwrite",
    ]
    if args.precision:
        command += ["--precision", args.precision]
    if args.channels_last:
        command += ["--channels-last"]
    if args.writer_threads:
        command += ["--writer-threads", str(args.writer_threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{output[-3000:]}")
    line = next((m for m in output.splitlines() if re.match(r"extract: \d+ samples in", m)), "")
    import zarr

    summary = dict(zarr.open_group(out, mode="r").attrs["summary"])
    return {
        "command": " ".join(command),
        "num_samples": num_samples,
        "images_per_second": summary["images_per_second"],
        "seconds": summary["seconds"],
        "compression_ratio": summary["compression_ratio"],
        # ru_maxrss: KiB on Linux; the largest of the process and its waited-for children (DataLoader workers)
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "summary_line": line,
    }


def rss_check(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = args.model if args.model_given else "resnet18"
    size = args.image_size if args.image_size_given else 64
    runs = {}
    for n in args.rss_n:
        runs[n] = run_cli(args, n, workdir / f"rss{n}.zarr", model, size, args.batch_size or JobSpec.batch_size)
        print(
            f"(f) N={n:>6}: {runs[n]['images_per_second']:8.1f} img/s  peak RSS {runs[n]['peak_rss_mib']:8.1f} MiB",
            flush=True,
        )
    small, large = runs[min(runs)], runs[max(runs)]
    growth = large["peak_rss_mib"] / small["peak_rss_mib"] - 1
    print(f"peak RSS N={max(runs)} vs N={min(runs)}: {growth:+.1%} (target within 10%)")
    return {"model": model, "image_size": size, "runs": runs, "rss_growth": growth, "within_10pct": abs(growth) <= 0.10}


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--weights", default="none", choices=["none"], help="random init only (no downloads)")
    p.add_argument("--layers", nargs="+", default=["layer3", "layer4"])
    p.add_argument("--batch-size", type=int, default=None, help="default 32 on CPU, 256 on CUDA")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None, help="default fp32 CPU, bf16 CUDA")
    p.add_argument("--batches", type=int, default=None, help="batches per timed repeat (default 8 CPU, 20 CUDA)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed batches per variant before the repeats")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--writer-threads", type=int, default=None, help="default: what a job uses on this device")
    p.add_argument("--copy", choices=["side", "compute", "both"], default="side", help="CUDA: d/e copy path(s)")
    p.add_argument("--variants", default="abcdef", help="subset of abcdef to run")
    p.add_argument("--cli-samples", type=int, default=None, help="N for (f) (default batches x batch size x 2)")
    p.add_argument("--no-micro", dest="micro", action="store_false")
    p.add_argument("--rss-check", action="store_true", help="only (f) at --rss-n sizes; resnet18 at 64 px by default")
    p.add_argument("--rss-n", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--device", default=None, help="default: cuda if available else cpu")
    p.add_argument("--workdir", default=None, help="where stores go (default a temp dir, removed)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.model_given = "--model" in (argv if argv is not None else sys.argv)
    args.image_size_given = "--image-size" in (argv if argv is not None else sys.argv)
    return args


def environment(device: torch.device) -> dict[str, Any]:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    with contextlib.suppress(ImportError):
        import zarr

        env["zarr"] = zarr.__version__
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="extract-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"environment": environment(device), "args": {k: v for k, v in vars(args).items()}}
    try:
        if args.rss_check:
            result["rss_check"] = rss_check(args, workdir)
        else:
            result.update(benchmark(args, device, workdir))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return result


def benchmark(args: argparse.Namespace, device: torch.device, workdir: Path) -> dict[str, Any]:
    cuda = device.type == "cuda"
    batch_size = args.batch_size or (256 if cuda else 32)
    batches = args.batches or (20 if cuda else 8)
    precision = args.precision or ("bf16" if cuda else "fp32")
    writer_threads = args.writer_threads or default_writer_threads(device)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    autocast = (
        torch.autocast(device.type, dtype=AUTOCAST[precision]) if precision != "fp32" else contextlib.nullcontext()
    )
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None).eval().to(device, memory_format=memory_format)
    x = torch.randn(batch_size, 3, args.image_size, args.image_size, device=device).to(memory_format=memory_format)

    with torch.inference_mode(), autocast:
        probe = Capture(model, args.layers)
        with probe:
            model(x[:2])
    shapes = {name: tuple(v.shape[1:]) for name, v in probe.outputs.items()}
    out_itemsize = probe.outputs[args.layers[0]].element_size()
    tutorial_bytes = sum(math.prod(s) for s in shapes.values()) * out_itemsize
    num_samples = batch_size * batches
    config = {
        "model": args.model,
        "layers": args.layers,
        "shapes": shapes,
        "batch_size": batch_size,
        "image_size": args.image_size,
        "precision": precision,
        "channels_last": args.channels_last,
        "batches": batches,
        "repeats": args.repeats,
        "store": {
            "dtype": STORE_DTYPE,
            "compressor": STORE_COMPRESSOR,
            "chunk_size": default_chunk_size(num_samples, max_sample_bytes(shapes)),
            "writer_threads": writer_threads,
        },
    }
    print(json.dumps(config, default=str), flush=True)

    copies = {"side": ["side"], "compute": ["compute"], "both": ["side", "compute"]}[args.copy] if cuda else ["side"]
    variants: list[Variant] = []
    wanted = set(args.variants)
    if "a" in wanted:
        variants.append(Plain(model))
    if "b" in wanted:
        variants.append(FeatureExtractor(model, args.layers))
    if "c" in wanted:
        variants.append(Tutorial(model, args.layers, tutorial_bytes))
    for copy in copies:
        if "d" in wanted:
            variants.append(CaptureOnly(model, args.layers, shapes, batch_size, device, copy))
        if "e" in wanted:
            variants.append(
                CaptureStore(model, args.layers, shapes, batch_size, device, copy, num_samples, workdir, writer_threads)
            )
    # Every variant registers its hooks in setup() and removes them in close(): only its own are on.
    clock = Clock(device)
    seconds: dict[str, list[float]] = {v.name: [] for v in variants}
    cpu_seconds: dict[str, list[float]] = {v.name: [] for v in variants}
    with torch.inference_mode(), autocast:
        for v in variants:  # warm-up
            v.setup()
            for _ in range(max(1, args.warmup)):
                if isinstance(v, CaptureStore):
                    break  # its store takes exactly num_samples; warmed up by a full untimed round below
                v.run(x)
            if isinstance(v, CaptureStore):
                for _ in range(batches):
                    v.run(x)
            v.finish()
            v.close()
        for repeat in range(args.repeats):
            order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
            for v in order:
                v.setup()
                with clock.measure(seconds[v.name], cpu_seconds[v.name]):
                    for _ in range(batches):
                        v.run(x)
                    v.finish()
                v.close()
            print(
                f"repeat {repeat + 1}/{args.repeats}: "
                + "  ".join(f"{v.name} {num_samples / seconds[v.name][-1]:.1f}" for v in variants),
                flush=True,
            )

    rows: dict[str, Any] = {}
    for v in variants:
        ips = [num_samples / s for s in seconds[v.name]]
        med = statistics.median(ips)
        rows[v.name] = {
            "label": v.label,
            "images_per_second": med,
            "images_per_second_all": ips,
            # CPU seconds of the whole process per image: less sensitive than wall time to other
            # processes on the machine, but it counts what the writer threads take from the forward.
            "cpu_ms_per_image": statistics.median(c / num_samples * 1e3 for c in cpu_seconds[v.name]),
            "host_bytes_per_second": med * v.bytes_per_image if cuda else None,
        }
        if isinstance(v, CaptureStore) and v.stored:
            rows[v.name]["compression_ratio"] = v.raw / v.stored

    if "f" in wanted:
        n = args.cli_samples or num_samples * 2
        f = run_cli(args, n, workdir / "cli.zarr", args.model, args.image_size, batch_size)
        rows["f"] = {"label": "python -m extract, synthetic data, end to end", **f}

    def ratio(p: str, q: str) -> float | None:
        if p in rows and q in rows:
            return rows[p]["images_per_second"] / rows[q]["images_per_second"]
        return None

    ratios = {"d/b": ratio("d", "b"), "e/b": ratio("e", "b"), "e/c": ratio("e", "c"), "a/b": ratio("a", "b")}
    if "d_compute" in rows:
        ratios["d/d_compute"] = ratio("d", "d_compute")
    if "e_compute" in rows:
        ratios["e/e_compute"] = ratio("e", "e_compute")
    result = {"config": config, "results": rows, "ratios": ratios}
    if args.micro:
        result["micro"] = micro()
    print_table(result, cuda)
    return result


def print_table(result: dict[str, Any], cuda: bool) -> None:
    print()
    header = f"{'':<10} {'variant':<62} {'img/s':>9} {'CPU ms/img':>11}"
    if cuda:
        header += f" {'host GB/s':>10}"
    print(header)
    for name, row in result["results"].items():
        cpu_ms = f"{row['cpu_ms_per_image']:>11.1f}" if "cpu_ms_per_image" in row else f"{'':>11}"
        line = f"{name:<10} {row['label']:<62} {row['images_per_second']:>9.1f} {cpu_ms}"
        if cuda and row.get("host_bytes_per_second"):
            line += f" {row['host_bytes_per_second'] / 1e9:>10.2f}"
        if "peak_rss_mib" in row:
            line += f"   peak RSS {row['peak_rss_mib']:.0f} MiB (N={row['num_samples']})"
        print(line)
    print("ratios: " + "  ".join(f"{k} {v:.3f}" for k, v in result["ratios"].items() if v is not None))
    if "micro" in result:
        m = result["micro"]
        print("hook micro-benchmark, nn.Identity on a (4, 16) tensor, µs per call:")
        for k, v in m["us_per_call"].items():
            print(f"    {k:<32} {v:8.2f}")
        print(f"    capture hook - no-op hook:       {m['capture_minus_noop_us']:8.2f}")


if __name__ == "__main__":
    main()
