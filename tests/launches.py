"""``accelerate launch`` on CPU (gloo) for the multi-process tests: the launcher's command, its rank
processes, and one launch that runs several extract jobs in turn (``job_sequence.py``), because a
launch's start-up costs more than the small jobs the tests run in it."""

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEQUENCE = ROOT / "tests" / "job_sequence.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(processes: int, *extra: str) -> list[str]:
    """``accelerate launch`` of ``processes`` ranks, up to its ``-m`` (append a module and its arguments)."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu" if processes > 1 else "--cpu",
        "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), *extra, "-m",
    ]  # fmt: skip


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rank_pids(launcher_pid: int, program: bytes = b"extract") -> list[int]:
    """The launcher's descendants whose command line names ``program``: its ranks."""
    pids = []
    for pid in descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if program in f.read() and pid != launcher_pid:
                    pids.append(pid)
        except OSError:
            continue
    return pids


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@dataclass
class JobResult:
    codes: list[int]  # each rank's exit status of the job
    stderr: str  # every rank's stderr of the job, rank 0 first


class Sequence:
    """Several extract jobs run in turn by one launch of ``processes`` ranks: ``jobs`` maps a name to
    the job's arguments. ``start`` returns the launcher (a Popen); ``result(name)`` what the job did."""

    def __init__(self, processes: int, jobs: dict[str, list], folder: Path) -> None:
        self.processes, self.folder = processes, folder
        self.plan = folder / "plan.json"
        self.plan.write_text(json.dumps({"dir": str(folder), "jobs": {k: list(map(str, v)) for k, v in jobs.items()}}))

    def start(self) -> subprocess.Popen:
        command = [*launcher(self.processes)[:-1], str(SEQUENCE), str(self.plan)]
        return subprocess.Popen(
            command, cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )

    def run(self, timeout: float = 600) -> subprocess.CompletedProcess:
        job = self.start()
        _, err = job.communicate(timeout=timeout)
        return subprocess.CompletedProcess(job.args, job.returncode, "", err)

    def result(self, name: str) -> JobResult:
        errs = [self.folder / f"{name}.rank{rank}.err" for rank in range(self.processes)]
        stderr = "".join(f.read_text() for f in errs if f.exists())
        codes = []
        for rank in range(self.processes):
            code = self.folder / f"{name}.rank{rank}.code"
            assert code.exists(), f"rank {rank} did not finish job {name}: {stderr[-3000:]}"
            codes.append(int(code.read_text()))
        return JobResult(codes, stderr)
