"""``accelerate launch`` on CPU (gloo) for the multi-process tests: the launcher's command, its rank
processes, and one launch (or one plain process) that runs several extract jobs in turn
(``job_sequence.py``), because starting one costs more than the small jobs the tests run in it."""

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import HELPERS, ROOT, patience

SEQUENCE = HELPERS / "job_sequence.py"


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
            except (OSError, IndexError, ValueError):  # it exited while the listing was read
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
    stdout: str  # every rank's output of the job, rank 0 first
    stderr: str


class Sequence:
    """Several extract jobs run in turn by one launch of ``processes`` ranks (None: one plain process,
    no launcher); ``jobs`` maps a name to the job's arguments, ``env`` adds to the environment of the
    process, ``job_env`` (name -> variables) to a job's alone (variables read at run time only).
    ``start`` returns the process (a Popen), ``run`` waits for it; ``result(name)`` says what a job did."""

    def __init__(
        self,
        processes: int | None,
        jobs: dict[str, list],
        folder: Path,
        env: dict[str, str] | None = None,
        job_env: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.processes, self.folder, self.env = processes, folder, env or {}
        self.plan = folder / "plan.json"
        plan = {"dir": str(folder), "jobs": {k: list(map(str, v)) for k, v in jobs.items()}, "env": job_env or {}}
        self.plan.write_text(json.dumps(plan))

    def start(self) -> subprocess.Popen:
        program = launcher(self.processes)[:-1] if self.processes else [sys.executable]
        return subprocess.Popen(
            [*program, str(SEQUENCE), str(self.plan)], cwd=ROOT, env={**environment(), **self.env},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def run(self, timeout: float = 600) -> subprocess.CompletedProcess:
        """The launch, waited for while it makes progress (``patience``); ``timeout`` is what it may take
        on a quiet machine."""
        job = self.start()
        _, err = patience.communicate(job, quiet=timeout, what=f"the launch of {self.plan}")
        return subprocess.CompletedProcess(job.args, job.returncode, "", err)

    def result(self, name: str) -> JobResult:
        ranks = range(self.processes or 1)
        stdout, stderr = (
            "".join(f.read_text() for f in (self.folder / f"{name}.rank{r}.{suffix}" for r in ranks) if f.exists())
            for suffix in ("out", "err")
        )
        codes = []
        for rank in ranks:
            code = self.folder / f"{name}.rank{rank}.code"
            assert code.exists(), f"rank {rank} did not finish job {name}: {stderr[-3000:]}"
            codes.append(int(code.read_text()))
        return JobResult(codes, stdout, stderr)
