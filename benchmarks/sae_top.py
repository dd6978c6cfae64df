"""Each latent's top contexts (``extract.analysis.top``): the streaming pass over synthetic sparse codes
against a brute-force dense baseline. Not run by the tests.

    python benchmarks/sae_top.py --rows 10000000 --dense-rows 8192 --json sae_top.json

Synthetic codes: ``--latents`` latents (16384), ``--active`` distinct latents per row (64), float16 values,
generated chunk by chunk (``--chunk`` rows) so that the input never exists whole: memory is the pass's
own. Each variant runs in a fresh subprocess, so its peak RSS (``resource.getrusage``, ``ru_maxrss``) is
its own; the parent prints one line per variant and ``SAE_TOP_RESULT {json}``.

- ``stream``: ``top_contexts`` over ``--rows`` rows, on ``--device`` (cpu, or cuda where there is one).
- ``stream-small``: the same pass over ``--dense-rows`` rows, the baseline's input.
- ``dense``: the same ``--dense-rows`` rows scattered into a dense (rows x latents) float32 matrix, then
  every latent's top k by ``np.argsort`` over its column, frequency and ``np.histogram``: what one does
  when the codes fit in memory. It checks that both agree (rows and values of every latent's top k).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np
import torch


def chunks(rows: int, latents: int, active: int, chunk: int, seed: int = 0):
    """Rows of ``active`` distinct latents each (a random start and an odd stride modulo a power of two,
    or any stride coprime with ``latents``), largest first, as the store yields them."""
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        base = torch.randint(0, latents, (n, 1), generator=generator)
        stride = 2 * torch.randint(0, latents // 2, (n, 1), generator=generator) + 1
        index = (base + stride * torch.arange(active)) % latents
        value = torch.empty(n, active).exponential_(generator=generator).to(torch.float16)
        value, order = value.sort(dim=1, descending=True)
        yield start, index.gather(1, order).to(torch.int32), value


def run_stream(args: argparse.Namespace, rows: int) -> dict:
    """The pass alone: the time spent generating the chunks is measured apart and left out."""
    from extract.analysis.top import top_contexts

    device = torch.device(args.device)
    spent = {"wall": 0.0, "cpu": 0.0}

    def generated():
        source = chunks(rows, args.latents, args.active, args.chunk)
        while True:
            wall, cpu = time.perf_counter(), time.process_time()
            item = next(source, None)
            if item is not None:
                item = (item[0], item[1].to(device), item[2].to(device))
            spent["wall"] += time.perf_counter() - wall
            spent["cpu"] += time.process_time() - cpu
            if item is None:
                return
            yield item

    wall, cpu = time.perf_counter(), time.process_time()
    top = top_contexts(generated(), args.latents, args.k, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - wall - spent["wall"]
    out = {
        "rows": rows,
        "seconds": seconds,
        "cpu_seconds": time.process_time() - cpu - spent["cpu"],
        "generate_seconds": spent["wall"],
        "rows_per_s": rows / seconds,
        "nonzeros_per_s": rows * args.active / seconds,
        "threads": torch.get_num_threads(),
    }
    if args.check:
        np.savez(args.check, rows=top.rows, values=top.values, counts=top.counts, histogram=top.histogram)
    return out


def run_dense(args: argparse.Namespace, rows: int) -> dict:
    from extract.analysis.top import DEFAULT_EDGES

    started, cpu = time.perf_counter(), time.process_time()
    dense = np.zeros((rows, args.latents), dtype=np.float32)
    for start, index, value in chunks(rows, args.latents, args.active, args.chunk):
        r = np.arange(start, start + len(index))[:, None]
        dense[r, index.numpy()] = value.float().numpy()
    built = time.perf_counter()
    # value descending, then the lower row: a stable sort of the negated column keeps rows in order
    best = np.argsort(-dense, axis=0, kind="stable")[: args.k].T  # (latents, k)
    values = np.take_along_axis(dense.T, best, axis=1)
    best = np.where(values > 0, best, -1)
    counts = (dense > 0).sum(0)
    bins = np.concatenate([[-np.inf], DEFAULT_EDGES, [np.inf]])
    histogram = np.stack([np.histogram(dense[dense[:, i] > 0, i], bins=bins)[0] for i in range(args.latents)])
    done = time.perf_counter()
    out = {
        "rows": rows,
        "seconds": done - started,
        "cpu_seconds": time.process_time() - cpu,
        "build_seconds": built - started,
        "rows_per_s": rows / (done - started),
    }
    if args.check:
        stream = np.load(args.check)
        same = np.array_equal(stream["rows"], best) and np.array_equal(stream["counts"], counts)
        same = same and np.array_equal(np.nan_to_num(stream["values"]), np.where(best >= 0, values, 0))
        out["agrees_with_stream"] = bool(same and np.array_equal(stream["histogram"], histogram))
    return out


def child(args: argparse.Namespace) -> None:
    result = (run_dense if args.variant == "dense" else run_stream)(args, args.rows)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.device.startswith("cuda"):
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("CHILD " + json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dense-rows", type=int, default=8192)
    p.add_argument("--latents", type=int, default=16384)
    p.add_argument("--active", type=int, default=64)
    p.add_argument("--k", type=int, default=20, help="contexts per latent")
    p.add_argument("--chunk", type=int, default=65536)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--check", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        return child(args)
    check = "/tmp/sae_top_check.npz"
    plan = [("stream", args.rows, None), ("stream-small", args.dense_rows, check), ("dense", args.dense_rows, check)]
    results = {}
    for name, rows, check_path in plan:
        command = [sys.executable, __file__, "--variant", name, "--rows", str(rows), "--latents", str(args.latents)]
        command += [
            "--active",
            str(args.active),
            "--k",
            str(args.k),
            "--chunk",
            str(args.chunk),
            "--device",
            args.device,
        ]
        command += ["--check", check_path] if check_path else []
        line = next(
            x
            for x in subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
            if x.startswith("CHILD ")
        )
        results[name] = json.loads(line[6:])
        print(name, results[name], flush=True)
    print("SAE_TOP_RESULT " + json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
