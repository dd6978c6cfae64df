"""``python -m extract ARGS`` in a child forked from the test process: torch is already imported, so a
run costs a fraction of a second, and the child can be made to kill itself at a chosen point first."""

import os
import select
import signal
import sys
from collections.abc import Callable

import torch

import extract.job.runner  # noqa: F401 - imported once here, not in every child (seconds each on a busy machine)

from . import patience

# What a child that should exit on its own may take on a quiet machine (``patience`` waits on while it works).
EXIT_TIMEOUT = 300.0


def fork_start(args, before: Callable[[], None] | None = None, stderr=os.devnull, own_group: bool = False) -> int:
    """Start the CLI in a forked child; returns its pid. ``before`` runs in the child first (to make it
    kill itself at a chosen point); its stderr goes to the file ``stderr``; ``own_group`` makes it lead
    a process group, as a shell job does."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if own_group:
                os.setpgid(0, 0)
            torch.set_num_threads(1)
            os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - the child exits with os._exit
            if before is not None:
                before()
            from extract.cli.extract import main

            code = main([str(a) for a in args])
            sys.stderr.flush()
        finally:
            os._exit(code)
    return pid


def fork_wait(pid: int, timeout: float = EXIT_TIMEOUT) -> int:
    """The child's exit code (-9 when killed). ``timeout`` is what the child may take on a quiet machine;
    it is waited for while it makes progress (``patience``), and a child that stalls (or runs past a
    multiple of ``timeout``) is killed and fails the test: it did not stop on its own."""
    progress = patience.Progress([pid], f"the job (pid {pid})", limit=patience.ceiling(timeout))
    pidfd = os.pidfd_open(pid)
    try:
        while not select.select([pidfd], [], [], 1)[0]:
            try:
                progress.check()
            except AssertionError:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise
    finally:
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def fork_run(args, before: Callable[[], None] | None = None, stderr=os.devnull) -> int:
    return fork_wait(fork_start(args, before, stderr))


def set_environment(**variables: str) -> Callable[[], None]:
    """For ``before``: the child's environment (variables read at run time: the lock's, the paced model's)."""
    return lambda: os.environ.update(variables)


def die_on(target, name: str, nth: int = 1, when=lambda *a, **k: True) -> Callable[[], None]:
    """For ``before``: SIGKILL ourselves on the ``nth`` matching call of ``target.name``."""
    original = getattr(target, name)
    calls = []

    def dying(*args, **kwargs):
        if when(*args, **kwargs):
            calls.append(1)
            if len(calls) == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    return lambda: setattr(target, name, dying)


def die_after(target, name: str, when=lambda *a, **k: True) -> Callable[[], None]:
    """For ``before``: SIGKILL ourselves right after the first matching call of ``target.name`` returns."""
    original = getattr(target, name)

    def dying(*args, **kwargs):
        result = original(*args, **kwargs)
        if when(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return lambda: setattr(target, name, dying)


def meet_at(target, name: str, ready: int, go: int, when=lambda *a, **k: True) -> Callable[[], None]:
    """For ``before``: the first matching call of ``target.name`` says so on the pipe ``ready``, then
    waits for a byte on the pipe ``go`` (``started_together`` lets every child go at once)."""
    original = getattr(target, name)
    waited = []

    def meeting(*args, **kwargs):
        if not waited and when(*args, **kwargs):
            waited.append(True)
            os.write(ready, b".")
            os.read(go, 1)
        return original(*args, **kwargs)

    return lambda: setattr(target, name, meeting)


def started_together(jobs: dict, target, name: str, work, when=lambda *a, **k: True) -> dict:
    """Fork each of ``jobs`` (name -> CLI args), hold every one at its first matching call of
    ``target.name`` until all are there, then let them go at the same instant (two jobs claiming one
    store's lock together); per job, (pid, exit code, its stderr), its stderr kept in ``work``."""
    ready_read, ready = os.pipe()
    go, go_write = os.pipe()
    try:
        pids = {
            job: fork_start(args, meet_at(target, name, ready, go, when), stderr=work / f"{job}.err")
            for job, args in jobs.items()
        }
        arrived = b""
        while len(arrived) < len(pids):
            assert select.select([ready_read], [], [], EXIT_TIMEOUT)[0], "the jobs did not reach the meeting point"
            arrived += os.read(ready_read, len(pids))
        os.write(go_write, b"." * len(pids))
    finally:
        for fd in (ready_read, ready, go, go_write):
            os.close(fd)
    return {job: (pid, fork_wait(pid), (work / f"{job}.err").read_text()) for job, pid in pids.items()}


def the_one_that_ran(results: dict) -> tuple[str, str]:
    """(winner, loser) of two jobs ``started_together``: exactly one exited 0."""
    winners = [job for job, (_, code, _) in results.items() if code == 0]
    assert len(winners) == 1, results
    (loser,) = set(results) - set(winners)
    return winners[0], loser
