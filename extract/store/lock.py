"""One live job per store, from the first instant: a lock file beside the store, kept fresh by a heartbeat.

The lock is ``<out>.lock`` next to ``<out>``, not inside it, so that it exists before the store does
and stays put while the store is built beside its target and renamed into place, or moved aside by
``--overwrite``. It is created with ``O_EXCL`` (atomic, also on NFS v3+), so of two jobs started at
the same instant exactly one gets it. The holder rewrites the file's mtime every ``HEARTBEAT`` seconds.

A lock is stale, and taken over, when its holder is a process on this host that no longer exists, or
when its heartbeat stopped ``STALE_AFTER`` seconds ago. Age alone is enough: pids are reused, so a
live pid on this host proves nothing once the heartbeat is old.

A pid is only a process's number in its own PID namespace: a job in a container on the same host
(pyxis/enroot under SLURM, a Kubernetes pod with hostNetwork, ``docker run``, ``unshare --pid``)
shares the hostname and the filesystem but not the pids, so its live holder's pid is absent here, or
is another process. So a holder is declared dead by its pid only when its lock proves it ran in this
PID namespace of this boot of this host (``process_namespace``); any other lock waits for its heartbeat
to stop.

A holder paused past that age (SIGSTOP, a suspended VM, a hung NFS client) comes back without its
lock. So every lock records a unique ``token``: the holder's heartbeat re-reads the lock and, finding
another token (or none), sets ``lost`` and stops, never refreshing another's lock; the token is also
the store's ``writer``, which the store checks before every write (``fence.py``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ExtractError, LockLostError, LockUnavailable, StoreBusyError

HEARTBEAT = 10.0
STALE_AFTER = 60.0
# Overrides, read when a lock is made: tests pause a holder past a stale age of a second, not a minute.
HEARTBEAT_VARIABLE, STALE_AFTER_VARIABLE = "EXTRACT_LOCK_HEARTBEAT", "EXTRACT_LOCK_STALE_AFTER"
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
# The wall clock that heartbeats are written with and ages read against, here and on object storage;
# tests replace it to age a lock at once instead of sleeping past its stale age.
clock: Callable[[], float] = time.time


def now() -> float:
    return clock()


def process_namespace() -> dict[str, str]:
    """What makes this process's pid meaningful to another process: its PID namespace (``pid:[INODE]``,
    the inode of ``/proc/self/ns/pid``) and the kernel's boot id (namespace inodes are reused across
    boots). Recorded in every lock; empty where ``/proc`` does not say (not Linux, no ``/proc`` mounted),
    and then no lock of ours can be judged by its pid."""
    found: dict[str, str] = {}
    try:
        found["pid_ns"] = os.readlink("/proc/self/ns/pid")
        with open("/proc/sys/kernel/random/boot_id") as f:
            found["boot"] = f.read().strip()
    except OSError:
        return {}
    return found


def lock_path(store: Path) -> Path:
    return store.with_name(store.name + ".lock")


def _seconds(variable: str, default: float) -> float:
    text = os.environ.get(variable)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ExtractError(f"{variable}={text!r} is not a positive number of seconds; fix or unset it")
    return value


def timings() -> tuple[float, float]:
    """The heartbeat and the stale age, from the environment where set. A heartbeat as slow as the stale
    age would let another job take a live holder's lock."""
    heartbeat, stale_after = _seconds(HEARTBEAT_VARIABLE, HEARTBEAT), _seconds(STALE_AFTER_VARIABLE, STALE_AFTER)
    if heartbeat >= stale_after:
        raise ExtractError(
            f"{HEARTBEAT_VARIABLE} ({heartbeat:g} s) must be shorter than {STALE_AFTER_VARIABLE} ({stale_after:g} s)"
        )
    return heartbeat, stale_after


def holder_name(holder: dict[str, Any]) -> str:
    """``host H, pid P``, naming a holder of this host in another PID namespace as such (its pid is not
    the one ``ps`` shows here)."""
    name = f"host {holder.get('host')}, pid {holder.get('pid')}"
    theirs, ours = holder.get("pid_ns"), process_namespace().get("pid_ns")
    if holder.get("host") == socket.gethostname() and theirs is not None and theirs != ours:
        name += f" in another PID namespace, {theirs} (a container)"
    return name


def lost_lock(store: Path) -> LockLostError:
    """The error of a holder whose lock, or whose store's ``writer``, is another job's now."""
    holder = _holder(lock_path(store))
    if holder is not None and "pid" in holder:
        whom = f"to another job ({holder_name(holder)})"
    else:
        whom = f"(its lock file {lock_path(store).name} was removed, or taken by a job that has finished)"
    return LockLostError(
        f"lost the lock on --out {store} {whom} while paused or stalled; this run stopped and marked "
        "nothing more; the other job owns the store now"
    )


def _record_path(path: Path) -> Path:
    """This process's own file for the record it links into place at ``path`` (see ``_create``)."""
    return path.with_name(f".{path.name}-{socket.gethostname()}-{os.getpid()}")


def _holder(path: Path) -> dict[str, Any] | None:
    """The lock's record and its heartbeat's age; ``{"age": ...}`` alone while its claimer is still
    writing it; None when there is no lock."""
    try:
        age = now() - path.stat().st_mtime
        text = path.read_text()
    except OSError:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = {}
    return {**holder, "age": age} if isinstance(holder, dict) else {"age": age}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs. A zombie does not: a killed rank whose launcher died
    too may stay one for a while where the container's init reaps slowly."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def provably_gone(holder: dict[str, Any]) -> bool:
    """Whether the process that wrote ``holder`` (a lock's record) has ended: it ran on this host, in this
    PID namespace, since this boot, and its pid runs no more. Where the record cannot prove all three it
    is no proof (False), and only the heartbeat's age can free the lock: a holder in another container
    of this host has a pid that is absent here, or another process's. Locks written before extract
    recorded the namespace are of that kind."""
    ours = process_namespace()
    if not ours or holder.get("host") != socket.gethostname():
        return False
    if any(holder.get(field) != value for field, value in ours.items()):
        return False
    try:
        return not pid_alive(int(holder["pid"]))
    except (KeyError, TypeError, ValueError):
        return False


def _stale(holder: dict[str, Any], stale_after: float) -> bool:
    return holder["age"] > stale_after or provably_gone(holder)


def _busy(store: Path, holder: dict[str, Any]) -> StoreBusyError:
    if "pid" not in holder:
        return StoreBusyError(
            f"--out {store} is being claimed by another job that is starting; wait for it, then rerun"
        )
    return StoreBusyError(
        f"--out {store} is being written by another job ({holder_name(holder)}, since {holder.get('started')}); "
        "wait for it to finish or stop it, then rerun"
    )


def _create(path: Path, record: dict[str, Any]) -> bool:
    """Create ``path`` holding ``record`` if it does not exist; False if it does.

    The record is written to a file of our own first and hard-linked into place (atomic, and
    NFS-safe), so a lock is never seen empty, even when its claimer is killed in the middle. Where
    hard links are not supported, ``O_EXCL`` and a write."""
    own = _record_path(path)
    own.write_text(json.dumps(record))
    try:
        os.link(own, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
    finally:
        own.unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    return True


def live_holder(store: Path) -> dict[str, Any] | None:
    """The record of the job holding the lock of ``store`` (host, pid, started), None when there is no
    lock or it is stale; for readers, which never take a lock."""
    holder = _holder(lock_path(store))
    return holder if holder is not None and not _stale(holder, timings()[1]) else None


def check_unlocked(store: Path, stale_after: float | None = None) -> None:
    """Refuse a store that a live job holds (for callers that only look, such as ``verify --repair``)."""
    holder = _holder(lock_path(store))
    if holder is not None and not _stale(holder, timings()[1] if stale_after is None else stale_after):
        raise _busy(store, holder)


class StoreLock:
    """Claimed by rank 0 before anything at ``--out`` is looked at, created or wiped; held to the end."""

    def __init__(self, store: Path, stale_after: float | None = None) -> None:
        self.store = store
        self.path = lock_path(store)
        self.heartbeat, default_stale = timings()
        self.stale_after = default_stale if stale_after is None else stale_after
        self.token = uuid.uuid4().hex  # also the store's ``writer`` while this lock holds it
        self.record = {
            "host": socket.gethostname(), "pid": os.getpid(), **process_namespace(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "token": self.token,
        }  # fmt: skip
        self.lost = threading.Event()  # set by the heartbeat once the lock is not ours any more
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="extract-lock", daemon=True)

    def __enter__(self) -> StoreLock:
        try:
            for _ in range(3):
                if _create(self.path, self.record):
                    self._thread.start()
                    return self
                self._take_over_if_stale()
        except OSError as e:
            if e.errno in _NOT_WRITABLE:
                raise LockUnavailable(
                    f"--out {self.store}: cannot create the lock {self.path} ({e.strerror})"
                ) from None
            raise ExtractError(f"--out {self.store}: cannot create the lock {self.path} ({e.strerror})") from None
        raise StoreBusyError(f"--out {self.store}: could not take the lock {self.path} from a stale holder; rerun")

    def sweep(self) -> None:
        """Delete the lock records that killed claimers left beside the store (``_create`` writes one and
        links it into place; a kill between the two leaves it). Only the holder calls this."""
        prefix = f".{self.path.name}-"
        for entry in self.path.parent.iterdir() if self.path.parent.is_dir() else []:
            if not entry.name.startswith(prefix):
                continue
            # Its claimer's record says whether that claimer is gone (a pid of another PID namespace,
            # or a record cut short by the kill, proves nothing: then only its age frees it).
            try:
                record = json.loads(entry.read_text())
            except (OSError, ValueError):
                record = None
            gone = isinstance(record, dict) and provably_gone(record)
            with contextlib.suppress(OSError):
                if gone or now() - entry.stat().st_mtime > 60:  # a young one may be a claimer's, mid-claim
                    entry.unlink()

    def _take_over_if_stale(self) -> None:
        holder = _holder(self.path)
        if holder is None:
            return  # released meanwhile: try again
        if not _stale(holder, self.stale_after):
            raise _busy(self.store, holder)
        # Two jobs may find the same stale lock: a second O_EXCL file lets one of them replace it,
        # so the other cannot delete the fresh lock the first has just created.
        guard = self.path.with_name(self.path.name + ".takeover")
        if not _create(guard, self.record):
            guard_holder = _holder(guard)
            if guard_holder is not None and guard_holder["age"] > 30:
                guard.unlink(missing_ok=True)  # its taker was killed mid-takeover
                return
            raise _busy(self.store, {})
        try:
            again = _holder(self.path)
            same = again is not None and all(again.get(k) == holder.get(k) for k in ("host", "pid", "started", "token"))
            if same and _stale(again, self.stale_after):
                self.path.unlink(missing_ok=True)
        finally:
            guard.unlink(missing_ok=True)

    def held(self) -> bool:
        """Whether the lock file is still ours, read afresh: not taken over, not removed by hand."""
        holder = _holder(self.path)
        return holder is not None and holder.get("token") == self.token

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            if not self.held():  # taken over after we stalled past the stale age, or removed
                self.lost.set()
                return  # never refresh, nor recreate, another's lock
            try:
                os.utime(self.path)
            except OSError:
                continue  # a read-only remount: the writes will fail and say so

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        try:
            if self.held():
                self.path.unlink()
        except OSError:
            pass  # a read-only remount: the error that stopped the run is the one to report
