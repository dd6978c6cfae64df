"""A rank stops when its launcher is gone: the launcher's death reaches it as a SIGTERM from the kernel,
and a rank that starts after its launcher died exits at once.

Under torch elastic (``accelerate launch``, ``torchrun``) each rank runs in a session of its own, so a
``kill -9`` of the launcher's process group does not reach it; an orphan then waits at the rendezvous or
a barrier for peers that are gone (up to ``--timeout``), and holds the port the next job wants. Standard
library only: ``extract.cli.startup`` arms this before torch is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHAN_GRACE = 5.0  # seconds an orphaned rank gets to stop cleanly before it exits regardless
ORPHANED = 1

_launcher: int | None = None  # the parent pid seen when the guard was armed
_told: socket.socket | None = None  # held while this process lives: it passed the job's stop request on


def launched() -> bool:
    """Whether a torch elastic agent started this process (it sets ``TORCHELASTIC_RUN_ID`` in its ranks)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def speaks_for_machine() -> bool:
    """Whether this process prints the errors every rank meets alike (bad arguments, the store's
    decisions): the first rank of each machine, whose launcher's output is the one its user reads."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def is_first_rank() -> bool:
    """Rank 0, which speaks for the job (its count of done chunks); also a process with no launcher."""
    return os.environ.get("RANK", "0") == "0"


def _is_reaper(pid: int) -> bool:
    """Whether ``pid`` adopted this process rather than launched it. The elastic agent that starts a rank
    is always a Python interpreter; an orphan's new parent is init (pid 1) or a subreaper (systemd,
    tini, slurmstepd, a container's init), which is not. An unreadable parent counts as the launcher:
    a false alarm would stop a healthy job."""
    if pid == 1:
        return True
    try:
        executable = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False
    return not executable.startswith(("python", "pypy"))


def guard_launcher() -> None:
    """Under a launcher, on Linux: ask the kernel for a SIGTERM when the parent dies, then make sure it is
    still alive, since it may have died before the request (during the interpreter's start-up). A rank
    whose launcher is gone says so in one line and exits at once. No effect without a launcher: ``nohup``
    may orphan a plain process on purpose."""
    global _launcher
    if not launched() or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this libc: the watcher below still polls
        pass
    parent = os.getppid()  # read after prctl: a death from here on is signalled
    if _is_reaper(parent):
        rank = os.environ.get("RANK", "?")
        os.write(2, f"extract: rank {rank} stops: its launcher is gone (its parent is now pid {parent})\n".encode())
        os._exit(ORPHANED)
    _launcher = parent


def watch_launcher() -> None:
    """Poll the parent as well, where the kernel's signal is not to be had (not Linux, or this process was
    not started by ``extract.cli.startup``): once the launcher is gone, SIGTERM ourselves (a clean stop),
    and exit after ``ORPHAN_GRACE`` seconds if that is stuck (in a barrier with ranks that are gone)."""
    if not launched():
        return
    parent = _launcher if _launcher is not None else os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="extract-parent-watch", daemon=True).start()


def _running_children(pid: int) -> int:
    """How many of ``pid``'s children are running (not zombies), from ``/proc``."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        count += int(ppid) == pid and state != "Z"
    return count


def _first_to_tell(parent: int) -> bool:
    """Whether this rank is the job's first to pass a request on: a name in the abstract socket namespace
    that one process can hold, and that goes when it exits (no file is left behind). Once told, the
    agent signals every rank, and their answers would make it stop waiting for them."""
    global _told
    claim = socket.socket(socket.AF_UNIX)
    try:
        claim.bind(f"\0extract-stop-{parent}-{os.environ.get('TORCHELASTIC_RUN_ID', '')}")
    except OSError:
        claim.close()
        return False
    _told = claim
    return True


def tell_launcher(signum: int) -> None:
    """Pass a stop request that reached this rank on to its launcher: the elastic agent then stops every
    rank with the same signal and exits with 128 + ``signum``, where a rank that stopped alone would be a
    failure to it (exit status 1 and a ``ChildFailedError`` traceback) while its peers waited for it.
    Only the job's first request is passed on, and not once a rank has ended: then the agent is closing
    the others after that failure, and its exit status should say so."""
    if not launched() or not sys.platform.startswith("linux"):
        return
    parent = _launcher if _launcher is not None else os.getppid()
    if os.getppid() != parent or _running_children(parent) < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        return
    if _first_to_tell(parent):
        with contextlib.suppress(OSError):
            os.kill(parent, signum)
