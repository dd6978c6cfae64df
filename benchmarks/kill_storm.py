"""Kill storm: SIGKILL a job at many instants, rerun the same command once, compare with a clean run.

Every trial starts the job on a fresh ``--out``, kills it at a random instant drawn over the whole
run (start-up, creation, the loop, the final marking), reruns the same command once, and checks that
the store equals an uninterrupted run: status complete, every chunk done, features, labels and valid
identical. Single-process jobs are forked from this process (torch is imported once, so a trial costs
about a second), and the kill instant is uniform over a warm run. Multi-process ones use ``accelerate
launch --multi_gpu`` on CPU; the launcher's start-up varies too much with the load for wall-clock
instants, so each kill waits for a random point of the job's own progress (the lock taken, the store
created, k of the 24 chunks done, every chunk done) plus 0-0.2 s, and kills at random: the whole tree
(launcher's process group and the ranks, which run in sessions of their own), one rank, or the
launcher's process group alone (the ranks must notice and stop; the time they lived on is reported).

    python benchmarks/kill_storm.py --processes 1 --trials 100 --json storm1.json
    python benchmarks/kill_storm.py --processes 2 --trials 24 --json storm2.json
    python benchmarks/kill_storm.py --s3 --trials 60     # a store on S3 (moto's server on loopback)

``--s3`` runs ``tests/helpers/s3_forked.py storm`` (the suite's storm on S3, which kills at 10 points) with
``--trials`` points spread over every object a run writes, plus its targeted points.

Repeatable: ``--seed`` fixes the kill instants and kinds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import zarr

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "helpers" / "tiny_models.py"
JOB = ["--model", f"{TINY}:dict_net", "--layers", "heads.conv", "--image-size", "32", "--num-workers", "0",
       "--dtype", "float32", "--data", "synthetic:96", "--chunk-size", "4", "--batch-size", "4"]  # fmt: skip
ARRAYS = ("features/heads.conv", "labels", "valid")
SLOW_NET = """
import time, torch, sys
sys.path.insert(0, {tests!r})
from helpers.tiny_models import dict_net
class Slow(torch.nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.heads, self.seconds = dict_net().heads, seconds
    def forward(self, x):
        time.sleep(self.seconds)  # costs no CPU: a loop long enough to be hit, on a loaded machine too
        return self.heads(x)["pooled"]
def net():
    return Slow({seconds})
"""
CHUNKS = 24


def fork_run(out: Path, kill_after: float | None = None) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch

            torch.set_num_threads(1)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the child leaves through os._exit
            from extract.cli.extract import main

            code = main([*JOB, "--out", str(out)])
        finally:
            os._exit(code)
    reaped, status = 0, 0
    if kill_after is not None:
        deadline = time.time() + kill_after
        while time.time() < deadline and not reaped:
            reaped, status = os.waitpid(pid, os.WNOHANG)
            time.sleep(0.002)
        if not reaped:
            os.kill(pid, signal.SIGKILL)
    if not reaped:
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), "-m", "extract", *JOB, "--out", str(out),
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def ranks_of(launcher: int) -> list[int]:
    ranks = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == launcher:
                    ranks.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return ranks


def alive(pids: list[int]) -> list[int]:
    living = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                living.append(pid)
        except OSError:
            pass
    return living


def reached(out: Path, trigger: int) -> bool:
    """-2: the lock exists; -1: the store exists; k >= 0: k chunks are done."""
    if trigger == -2:
        return out.with_name(out.name + ".lock").exists()
    if trigger == -1:
        return (out / "zarr.json").exists()
    done = out / "done" / "c"
    return done.is_dir() and len(os.listdir(done)) >= trigger


def launch_run(processes: int, out: Path, trigger: int | None, delay: float, kind: str, rng: random.Random) -> dict:
    """Kill once ``trigger`` is reached (see ``reached``) and ``delay`` seconds more: wall-clock
    instants would mostly land in the start-up of a launcher, whose length varies with the load.
    Returns the exit code and how long the ranks lived on after the kill."""
    job = launch(processes, out)
    if trigger is None:
        _, err = job.communicate()
        return {"code": job.returncode, "err": err[-2000:]}
    while job.poll() is None and not reached(out, trigger):
        time.sleep(0.002)
    deadline = time.time() + delay
    while time.time() < deadline and job.poll() is None:
        time.sleep(0.002)
    ranks = ranks_of(job.pid)
    if kind.startswith("tree"):
        with_ranks = [job.pid, *ranks]
        for pid in with_ranks:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    elif kind.startswith("one-rank") and ranks:
        try:
            os.kill(rng.choice(ranks), signal.SIGKILL)
        except ProcessLookupError:
            pass
    else:  # the launcher's group only: orphaned ranks must stop by themselves
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed_at = time.time()
    job.communicate()
    while alive(ranks) and time.time() - killed_at < 60:
        time.sleep(0.05)
    return {"code": job.returncode, "orphans_lived_s": round(time.time() - killed_at, 2), "left": alive(ranks)}


def stage_of(out: Path, code: int) -> str:
    """Where the kill landed, read from what it left at ``--out``."""
    if code == 0:
        return "finished before the kill"
    if not (out / "zarr.json").exists():
        return "before the store existed (start-up, creation)"
    group = zarr.open_group(out, mode="r")
    if group.attrs.get("status") == "complete":
        return "after marking complete"
    done = int(group["done"][:].sum())
    if done == 0:
        return "store created, no chunk done"
    if done < group["done"].shape[0]:
        return "during the loop"
    return "every chunk done, before marking complete"


def same(got: Path, expected: Path) -> str | None:
    a, b = zarr.open_group(got, mode="r"), zarr.open_group(expected, mode="r")
    if a.attrs.get("status") != "complete" or not a["done"][:].all():
        return "not complete"
    for name in ARRAYS:
        if not np.array_equal(a[name][:], b[name][:], equal_nan=True):
            return f"{name} differs"
    return None


def s3_storm(points: int) -> None:
    """The storm of ``tests/helpers/s3_forked.py`` with ``points`` kills, against moto's server in this process
    (which makes no request through obstore: the storm forks its runs)."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line a request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}", "S3_BUCKET": "storm", "S3_STORM_POINTS": str(points)}  # fmt: skip
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="storm")  # fmt: skip
    started = time.time()
    try:
        subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "s3_forked.py"), "storm", "bench"],
                       env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, check=True)  # fmt: skip
    finally:
        server.stop()
    print(f"s3 storm: {time.time() - started:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--sleep",
        type=float,
        default=None,
        help="seconds each forward sleeps (default 0, or 0.05 with several processes)",
    )
    parser.add_argument("--s3", action="store_true", help="the storm on a store on S3 (moto on loopback)")
    args = parser.parse_args()
    if args.s3:
        s3_storm(args.trials)
        return
    sys.path.insert(0, str(ROOT))
    import extract.job.runner  # noqa: F401 - imported once here, so a forked trial's clock starts at the job itself

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kill-storm-"))
    seconds = args.sleep if args.sleep is not None else (0.05 if args.processes > 1 else 0.0)
    if seconds:
        (work / "slow.py").write_text(SLOW_NET.format(tests=str(ROOT / "tests"), seconds=seconds))
        JOB[1] = f"{work / 'slow.py'}:net"
    reference = work / "reference.zarr"
    if args.processes == 1:
        timings = []
        for _ in range(3):
            started = time.time()
            assert fork_run(work / "t.zarr") == 0
            timings.append(time.time() - started)
            shutil.rmtree(work / "t.zarr")
        assert fork_run(reference) == 0
    else:
        started = time.time()
        result = launch_run(args.processes, reference, None, 0, "", rng)
        assert result["code"] == 0, result
        timings = [time.time() - started]
    whole = min(timings)  # warm: the trials' runs are
    print(
        f"uninterrupted run: {whole:.2f} s; {args.trials} trials, {args.processes} process(es), forward sleeps {seconds} s",
        flush=True,
    )

    outcomes: Counter[str] = Counter()
    failures, orphan_times, trials = [], [], []
    for trial in range(args.trials):
        out = work / f"trial-{trial}.zarr"
        at = rng.uniform(0, whole)
        kind = rng.choice(["tree", "one-rank", "launcher"]) if args.processes > 1 else "process"
        if args.processes == 1:
            first = {"code": fork_run(out, at)}
        else:
            trigger, at = rng.randint(-2, CHUNKS), rng.uniform(0, 0.2)
            kind = f"{kind}, at trigger {trigger} + {at:.3f} s"
            first = launch_run(args.processes, out, trigger, at, kind, rng)
            if first.get("left"):
                failures.append((trial, f"ranks still alive 60 s after the kill: {first['left']}"))
            if kind.startswith("launcher"):
                orphan_times.append(first["orphans_lived_s"])
        stage = stage_of(out, first["code"])
        outcomes[stage] += 1
        rerun = fork_run(out) if args.processes == 1 else launch_run(args.processes, out, None, 0, "", rng)["code"]
        problem = f"rerun exit {rerun}" if rerun != 0 else same(out, reference)
        if problem:
            failures.append((trial, f"kill at {at:.3f} s ({kind}): {problem}"))
        trials.append(
            {
                "at": round(at, 3),
                "kind": kind,
                "first": first["code"],
                "rerun": rerun,
                "stage": stage,
                "problem": problem,
            }
        )
        print(f"trial {trial:3d}: kill {'at ' + format(at, '.3f') + ' s ' if args.processes == 1 else ''}({kind}): {stage}: first exit {first['code']}, rerun {rerun}, "
              f"{problem or 'equal'}", flush=True)  # fmt: skip
        shutil.rmtree(out, ignore_errors=True)
    summary = {
        "processes": args.processes,
        "trials": args.trials,
        "uninterrupted_s": round(whole, 3),
        "forward_sleep_s": seconds,
        "outcomes": dict(outcomes),
        "failures": failures,
        "orphans_lived_s_max": max(orphan_times, default=None),
        "trials_detail": trials,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "trials_detail"}))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
