"""Waiting on processes as long as they make progress (issue 47, item 6): a fixed wall-clock timeout fails a
test on a busy machine (2 cores at load 10-25 ran ``test_kill_storm_on_s3`` past its 300 s), where the
job was slow, not stuck. So a wait fails when the processes it waits on have used no CPU for ``STALL``
seconds (a hang: a deadlock, a lost wake-up, a peer that never comes), or past a ceiling that is a
generous multiple of the time the wait takes on a quiet machine. Progress is the CPU time of the process
and all its descendants (user + system, and what the children it reaped used), read from ``/proc``: a
starved process gets some CPU all the same, a hung one gets none."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

STALL = float(os.environ.get("EXTRACT_TEST_STALL", "120"))  # seconds without CPU progress: a hang
SLACK = float(os.environ.get("EXTRACT_TEST_SLACK", "8"))  # the ceiling: this many times a quiet machine's time
_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def children_of(pid: int) -> list[int]:
    """The processes ``pid`` started (that are not reaped yet): what a poller waits on, without its own CPU."""
    return _children().get(pid, [])


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds used by ``pids`` and all their descendants, living or reaped by them."""
    children, total, seen = _children(), 0, set()
    stack = list(pids)
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if (fields := _stat(pid)) is not None:
            total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime (fields 14-17)
        stack.extend(children.get(pid, []))
    return total / _TICK


class Progress:
    """Whether processes are still working: ``check()`` raises ``AssertionError`` (with ``what`` and the
    ``detail()`` given) once they used no CPU for ``stall`` seconds, or ``limit`` seconds passed."""

    def __init__(
        self, pids: Sequence[int] | Callable[[], Sequence[int]], what: str, *, limit: float, stall: float | None = None
    ) -> None:
        self.pids = pids if callable(pids) else (lambda: pids)
        self.what, self.limit, self.stall = what, limit, STALL if stall is None else stall
        self.started = self.moved = time.monotonic()
        self.best = cpu_seconds(self.pids())

    def check(self, detail: Callable[[], str] = str) -> None:
        now, used = time.monotonic(), cpu_seconds(self.pids())
        if used > self.best:
            self.best, self.moved = used, now
        if now - self.moved > self.stall:
            raise AssertionError(f"{self.what}: no CPU used for {self.stall:g} s (hung){detail()}")
        if now - self.started > self.limit:
            raise AssertionError(f"{self.what}: still running after {self.limit:g} s{detail()}")


def ceiling(quiet: float) -> float:
    """The longest a wait may take: ``SLACK`` times ``quiet``, what it takes on a quiet machine."""
    return SLACK * quiet


def communicate(process: subprocess.Popen, *, quiet: float, what: str = "") -> tuple[Any, Any]:
    """``process.communicate()`` for as long as the process tree makes progress (``Progress``), at most
    ``ceiling(quiet)``; a process that stalls is killed (its process group too, where it leads one)."""
    progress = Progress([process.pid], what or f"pid {process.pid}", limit=ceiling(quiet))
    while True:
        try:
            return process.communicate(timeout=2)
        except subprocess.TimeoutExpired:  # retrying communicate loses no output (subprocess's docs)
            try:
                progress.check()
            except AssertionError as stopped:
                _kill(process)
                out, err = process.communicate()
                raise AssertionError(f"{stopped}; its output: {(err or out or '')[-3000:]}") from None


def run(command: Sequence[str], *, quiet: float, **options: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **options)`` with ``communicate``'s patience instead of a timeout."""
    stdin = options.pop("input", None)
    if options.pop("capture_output", False):
        options.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(command, stdin=subprocess.PIPE if stdin is not None else None, **options) as process:
        if stdin is not None:
            process.stdin.write(stdin)
            process.stdin.close()
        out, err = communicate(process, quiet=quiet, what=" ".join(map(str, command))[:200])
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def until(reached: Callable[[], bool], what: str, pids: Sequence[int] | Callable[[], Sequence[int]], *,
          quiet: float, detail: Callable[[], str] = str, pause: float = 0.02) -> None:  # fmt: skip
    """Poll ``reached()`` while the processes ``pids`` (what will bring it about) make progress."""
    progress = Progress(pids, what, limit=ceiling(quiet))
    while not reached():
        progress.check(detail)
        time.sleep(pause)


def _kill(process: subprocess.Popen) -> None:
    try:
        if os.getpgid(process.pid) == process.pid:
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    except ProcessLookupError:
        pass


def while_running(reached: Callable[[], bool], what: str, process: subprocess.Popen, *, quiet: float,
                  pause: float = 0.02) -> None:  # fmt: skip
    """Poll ``reached()`` while ``process`` runs and makes progress; it ending first fails, with its stderr."""

    def done() -> bool:
        if reached():
            return True
        if process.poll() is not None:
            output = process.stderr.read()[-3000:] if process.stderr else ""
            raise AssertionError(f"{what}: the process ended first (status {process.returncode}): {output}")
        return False

    until(done, what, [process.pid], quiet=quiet, pause=pause)
