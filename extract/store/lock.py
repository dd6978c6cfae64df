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

What every lock shares (the record, staleness, the claim, the heartbeat, the messages) is in
``held_lock.py``; this module is how a file keeps the record: ``FileRecords``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ..errors import ExtractError, LockUnavailable
from .held_lock import (
    Clock,
    HeldLock,
    Record,
    Version,
    Wait,
    busy,
    provably_gone,
    resolved_timings,
    stale,
    wait_for_stop,
)
from .held_lock import process_namespace as process_namespace  # where callers have always found it

_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
__all__ = ["FileRecords", "LockUnavailable", "StoreLock", "lock_path", "process_namespace"]


def lock_path(store: Path) -> Path:
    return store.with_name(store.name + ".lock")


def _record_path(path: Path) -> Path:
    """This process's own file for the record it links into place at ``path`` (see ``_create``)."""
    return path.with_name(f".{path.name}-{socket.gethostname()}-{os.getpid()}")


def _holder(path: Path, clock: Clock) -> Record | None:
    """The lock's record and its heartbeat's age (its mtime's); ``{"age": ...}`` alone while its claimer
    is still writing it; None when there is no lock."""
    try:
        age = clock() - path.stat().st_mtime
        text = path.read_text()
    except OSError:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = {}
    return {**holder, "age": age} if isinstance(holder, dict) else {"age": age}


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


class FileRecords:
    """A lock's record as the file ``<store>.lock``, its heartbeat the file's mtime. A file has no
    versions (``{}``): a refresh re-reads the token first, and a takeover deletes a stale lock under a
    second ``O_EXCL`` file, so that the claim creates it afresh."""

    outage: tuple[type[BaseException], ...] = (OSError,)

    def __init__(self, store: Path, *, clock: Clock = time.time) -> None:
        self.store, self.where, self.clock = str(store), lock_path(store), clock
        self.foreign = f"--out {store} is being claimed by another job that is starting; wait for it, then rerun"
        self.shown = ""
        self.vanished = f"(its lock file {self.where.name} was removed, or taken by a job that has finished)"

    def read(self) -> tuple[Record, Version] | None:
        holder = _holder(self.where, self.clock)
        return None if holder is None else (holder, {})

    def create(self, record: Record) -> Version | None:
        if not _create(self.where, record):
            if self.where.is_dir():  # read as no lock, it would be "taken over" and found again forever
                raise ExtractError(
                    f"--out {self.store}: its lock path {self.where} is a directory, not a lock file; move it "
                    "away (extract creates the lock file there), or choose another --out"
                )
            return None
        beat = self.clock()  # the heartbeat's first beat, on the lock's clock as every later one
        with contextlib.suppress(OSError):  # the lock is ours all the same, its mtime the filesystem's
            os.utime(self.where, (beat, beat))
        return {}

    def refresh(self, record: Record, version: Version) -> Version | None:
        holder = _holder(self.where, self.clock)
        if holder is None or holder.get("token") != record["token"]:
            return None  # never refresh another's lock
        beat = self.clock()
        os.utime(self.where, (beat, beat))
        return {}

    def take_over(self, holder: Record, version: Version, record: Record, stale_after: float) -> Version | None:
        # Two jobs may find the same stale lock: a second O_EXCL file lets one of them replace it,
        # so the other cannot delete the fresh lock the first has just created.
        guard = self.where.with_name(self.where.name + ".takeover")
        if not _create(guard, record):
            guard_holder = _holder(guard, self.clock)
            if guard_holder is not None and guard_holder["age"] > 30:
                guard.unlink(missing_ok=True)  # its taker was killed mid-takeover
                return None
            raise busy(self, {})
        try:
            again = _holder(self.where, self.clock)
            same = again is not None and all(again.get(k) == holder.get(k) for k in ("host", "pid", "started", "token"))
            if same and stale(again, stale_after):
                self.where.unlink(missing_ok=True)
        finally:
            guard.unlink(missing_ok=True)
        return None  # freed: the claim's next try creates it

    def delete(self) -> None:
        self.where.unlink()

    def sweep(self) -> None:
        """Delete the lock records that killed claimers left beside the store (``_create`` writes one and
        links it into place; a kill between the two leaves it)."""
        prefix = f".{self.where.name}-"
        for entry in self.where.parent.iterdir() if self.where.parent.is_dir() else []:
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
                if gone or self.clock() - entry.stat().st_mtime > 60:  # a young one may be mid-claim
                    entry.unlink()

    def describe(self, error: BaseException) -> str:
        return error.strerror if isinstance(error, OSError) and error.strerror else str(error)

    def failed_claim(self, error: Exception, deadline: float) -> None:
        if not isinstance(error, OSError):
            raise error
        problem = f"--out {self.store}: cannot create the lock {self.where} ({error.strerror})"
        raise (LockUnavailable if error.errno in _NOT_WRITABLE else ExtractError)(problem) from None


class StoreLock(HeldLock):
    """The lock of a store on a filesystem (``locking.Lock``), a file beside it."""

    def __init__(
        self, store: Path, stale_after: float | None = None, *, clock: Clock = time.time, wait: Wait = wait_for_stop
    ) -> None:
        heartbeat, stale_after = resolved_timings(stale_after)
        records = FileRecords(store, clock=clock)
        super().__init__(records, store=store, heartbeat=heartbeat, stale_after=stale_after, clock=clock, wait=wait)
