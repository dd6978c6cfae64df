"""Time to start a job on a 200,000-file ImageFolder with 1 and 3 ranks, before and after the
listing is made once per job.

Per run: ``wall_s`` (launch to exit), ``to_loop_s`` (run() to the loop, slowest rank), ``dataset_s``
(building the dataset: listing, sharing, hashing; slowest rank) and ``create_s`` (the store, with its
``keys`` array after), and their CPU seconds summed over ranks (``*_cpu_s``: the work all ranks did).

"Start" is from launching ``accelerate launch -m extract``-equivalent processes to the moment every
rank would enter its forward loop: imports, process group, model, listing (and, after, its broadcast,
hash and the store's ``keys`` array), store creation. The loop itself is replaced by an exit, so
the files may be empty. "before" runs the same command against another source tree (e.g. the
commit before this change, unpacked with ``git archive``), "after" against this one; the variants
alternate and each is repeated, medians reported.

    git archive cbea9b5 | tar -x -C /tmp/extract-before
    python benchmarks/listing_startup.py --before-tree /tmp/extract-before --files 200000 --ranks 1 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_tree(root: Path, files: int, classes: int) -> None:
    marker = root / f".complete-{files}-{classes}"
    if marker.exists():
        return
    per_class = files // classes
    for c in range(classes):
        folder = root / f"n{c:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (folder / f"img_{c:04d}_{i:06d}.JPEG").touch()
    marker.touch()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(args: argparse.Namespace) -> None:
    """One rank: run the job until its loop would start, then report the seconds since run() and
    those spent building the dataset (listing) and creating the store."""
    from extract.job import runner

    entered = time.perf_counter()
    spent = {"dataset_s": 0.0, "dataset_cpu_s": 0.0, "create_s": 0.0, "create_cpu_s": 0.0}

    def timed(function, name):
        def call(*a, **k):
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*a, **k)
            finally:
                spent[name] += time.perf_counter() - start
                spent[name.replace("_s", "_cpu_s")] += time.process_time() - cpu

        return call

    runner.build_dataset = timed(runner.build_dataset, "dataset_s")
    runner.FeatureStore.create = timed(runner.FeatureStore.create, "create_s")

    def stop_at_loop(job, *rest, **kwargs):
        report = {"to_loop_s": time.perf_counter() - entered, **spent}
        (args.out.parent / f"{args.out.name}.rank{job.state.process_index}.json").write_text(json.dumps(report))
        job.state.wait_for_everyone()
        raise SystemExit(0)

    runner.image_loop = stop_at_loop
    from extract.job.spec import JobSpec

    spec = JobSpec(
        model="resnet18", weights="none", layers=["conv1"], data=f"imagefolder:{args.data}", out=str(args.out),
        image_size=32, num_workers=0, overwrite=True,
    )  # fmt: skip
    runner.run(spec)


def launch(tree: Path, ranks: int, data: Path, out: Path) -> dict:
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu" if ranks > 1 else "--cpu",
        "--num_processes", str(ranks), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), str(Path(__file__).resolve()), "--child", "--data", str(data),
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree, timeout=1800)
    wall = time.perf_counter() - start
    files = [out.parent / f"{out.name}.rank{rank}.json" for rank in range(ranks)]
    if result.returncode != 0 or not all(f.is_file() for f in files):
        raise SystemExit(f"{tree} with {ranks} ranks failed:\n{result.stderr[-3000:]}")
    reports = [json.loads(f.read_text()) for f in files]
    for f in files:
        f.unlink()
    # wall times: the slowest rank (all wait for it); CPU times: summed over ranks (the total work)
    return {"wall_s": wall, **{k: (sum if "cpu" in k else max)(r[k] for r in reports) for k in reports[0]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, default=Path("/tmp/extract-listing-200k"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/extract-listing.zarr"))
    parser.add_argument("--before-tree", type=Path, required=False)
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.child:
        return child(args)
    make_tree(args.data, args.files, args.classes)
    trees = {"after": ROOT, **({"before": args.before_tree} if args.before_tree else {})}
    results: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for ranks in args.ranks:
            order = list(trees.items())
            for name, tree in order if repeat % 2 == 0 else order[::-1]:
                timing = launch(tree, ranks, args.data, args.out)
                results.setdefault(f"{name}/{ranks}", []).append(timing)
                print(f"{name:6s} ranks={ranks}: " + ", ".join(f"{k} {v:.2f}" for k, v in timing.items()), flush=True)
    print(f"load average {os.getloadavg()}")
    summary = {
        key: {m: round(statistics.median(t[m] for t in runs), 3) for m in runs[0]} for key, runs in results.items()
    }
    for key, values in summary.items():
        print(f"{key:10s} median " + ", ".join(f"{k} {v:.2f}" for k, v in values.items()))
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "median": summary, "load": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
