"""What every lock of a store shares, whatever keeps its record (DESIGN.md, "The store's life cycle").

A job claims ``--out`` by creating a lock beside it, ``<out>.lock``, holding a record of the job (host,
pid, PID namespace, start, a unique ``token``), and keeps it fresh with a heartbeat. Everything about
that life is here, once: the record, when a lock is stale (``stale``), the claim (create; or take over a
stale lock), the heartbeat (a refresh every ``heartbeat`` seconds, and ``lost`` once the lock is not
ours), the release, and the messages that name a holder: ``HeldLock``. What differs between a local
filesystem (``lock.py``: a hard-linked or ``O_EXCL`` file, its mtime the heartbeat) and object storage
(``object_lock.py``: conditional create and replace) is only how a record is created, read, refreshed,
taken over and deleted: a ``Records`` backend. Callers speak ``locking.py``'s protocol and factory.

Time is injectable: a lock reads ages with ``clock`` (default ``time.time``) and its heartbeat waits with
``wait(stop, seconds)`` (default ``stop.wait(seconds)``), so that tests move time on and wake the
heartbeat rather than sleeping past a stale age.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..errors import ExtractError, LockLostError, StoreBusyError

HEARTBEAT = 10.0
STALE_AFTER = 60.0
# Overrides, read when a lock is made: tests pause a holder past a stale age of a second, not a minute.
HEARTBEAT_VARIABLE, STALE_AFTER_VARIABLE = "EXTRACT_LOCK_HEARTBEAT", "EXTRACT_LOCK_STALE_AFTER"
CLAIMS = 3  # tries at a lock that keeps changing under us (released, taken by another taker) before giving up

Record = dict[str, Any]  # a holder's record as read back, with its heartbeat's ``age`` in seconds
Version = dict[str, str]  # what replaces a record conditionally: an ETag or generation; {} for a file
Clock = Callable[[], float]
Wait = Callable[[threading.Event, float], bool]  # wait(stop, seconds): True once ``stop`` is set


def wait_for_stop(stop: threading.Event, seconds: float) -> bool:
    return stop.wait(seconds)


# timings ------------------------------------------------------------------------------------------


def seconds_setting(variable: str, default: float) -> float:
    """A positive number of seconds from environment ``variable`` (``default`` when unset); anything else
    is one line naming the variable."""
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
    heartbeat, stale_after = seconds_setting(HEARTBEAT_VARIABLE, HEARTBEAT), seconds_setting(STALE_AFTER_VARIABLE, STALE_AFTER)
    if heartbeat >= stale_after:
        raise ExtractError(
            f"{HEARTBEAT_VARIABLE} ({heartbeat:g} s) must be shorter than {STALE_AFTER_VARIABLE} ({stale_after:g} s)"
        )
    return heartbeat, stale_after


def resolved_timings(stale_after: float | None) -> tuple[float, float]:
    """A lock's heartbeat and stale age: ``stale_after`` where given (a caller that only looks may be
    stricter), the environment's or the default otherwise; the environment is checked either way."""
    heartbeat, default = timings()
    return heartbeat, default if stale_after is None else stale_after


# holders ------------------------------------------------------------------------------------------


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


def new_record(token: str, clock: Clock) -> Record:
    """This process's record, as every lock holds it (the object lock adds its heartbeat's ``time``)."""
    return {
        "host": socket.gethostname(), "pid": os.getpid(), **process_namespace(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(clock())), "token": token,
    }  # fmt: skip


def holder_name(holder: Record) -> str:
    """``host H, pid P``, naming a holder of this host in another PID namespace as such (its pid is not
    the one ``ps`` shows here)."""
    name = f"host {holder.get('host')}, pid {holder.get('pid')}"
    theirs, ours = holder.get("pid_ns"), process_namespace().get("pid_ns")
    if holder.get("host") == socket.gethostname() and theirs is not None and theirs != ours:
        name += f" in another PID namespace, {theirs} (a container)"
    return name


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


def provably_gone(holder: Record) -> bool:
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


def stale(holder: Record, stale_after: float) -> bool:
    """Whether a lock may be taken over: its heartbeat stopped ``stale_after`` seconds ago (age alone is
    enough: pids are reused), or its holder is provably gone."""
    return holder["age"] > stale_after or provably_gone(holder)


# the backend: how one kind of lock keeps its record -------------------------------------------------


class Records(Protocol):
    """How the record of one store's lock is kept, on a filesystem or in a bucket. Each write is atomic:
    of two jobs creating (or taking over) one lock at once, exactly one succeeds."""

    store: str  # the store, as messages name it (``--out STORE``)
    where: Path | str  # the lock: its file, or its URL
    foreign: str  # a busy message for a lock whose record names no process
    shown: str  # what a busy message adds after the holder: ``; lock URL`` (a URL is not obvious), or ""
    vanished: str  # how a lost lock's message says that it is gone

    @property
    def outage(self) -> tuple[type[BaseException], ...]:
        """The errors of a request that may succeed later (an outage, a read-only remount)."""
        ...

    def read(self) -> tuple[Record, Version] | None:
        """The record with its heartbeat's ``age`` (read with the lock's clock), and its version; None when
        there is no lock."""
        ...

    def create(self, record: Record) -> Version | None:
        """Create the lock holding ``record``; None when it exists."""
        ...

    def refresh(self, record: Record, version: Version) -> Version | None:
        """Restart the heartbeat of our lock, last written as ``version``; None when it is not that
        version any more (a caller re-reads: a request retried after it landed finds its own record)."""
        ...

    def take_over(self, holder: Record, version: Version, record: Record, stale_after: float) -> Version | None:
        """Replace the stale lock ``holder`` (at ``version``) by ``record``; None when it was not replaced
        (another taker, or a lock freed to be created again)."""
        ...

    def delete(self) -> None:
        """Delete the lock, which a refresh has just shown to be ours."""
        ...

    def sweep(self) -> None:
        """Delete what killed claimers left beside the lock. Only the holder calls this."""
        ...

    def describe(self, error: BaseException) -> str:
        """``error`` of a request on the lock, in one line."""
        ...

    def failed_claim(self, error: Exception, deadline: float) -> None:
        """Raise ``error`` as extract's; or return, after a pause, to try again (an outage before the
        ``time.monotonic()`` ``deadline``)."""
        ...


def busy(records: Records, holder: Record) -> StoreBusyError:
    """The error of a claim refused by a live ``holder``, naming it."""
    if "pid" not in holder:
        return StoreBusyError(records.foreign)
    return StoreBusyError(
        f"--out {records.store} is being written by another job ({holder_name(holder)}, since "
        f"{holder.get('started')}{records.shown}); wait for it to finish or stop it, then rerun"
    )


class HeldLock:
    """The one implementation of ``locking.Lock``, over a ``Records`` backend: ``StoreLock`` (a file) and
    ``ObjectStoreLock`` (an object) only choose theirs."""

    def __init__(
        self, records: Records, *, store: str | Path, heartbeat: float, stale_after: float,
        clock: Clock = time.time, wait: Wait = wait_for_stop,
    ) -> None:  # fmt: skip
        self.records, self.store, self.path = records, store, records.where
        self.heartbeat, self.stale_after = heartbeat, stale_after
        self.clock, self._wait = clock, wait
        self.token = uuid.uuid4().hex
        self.record = new_record(self.token, clock)
        self.lost = threading.Event()
        self._version: Version | None = None  # the version of the record we last wrote
        self._mutex = threading.Lock()  # one request of ours on the lock at a time (heartbeat, release)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"extract-{type(self).__name__}", daemon=True)

    def __enter__(self) -> HeldLock:
        deadline, changed = time.monotonic() + max(5.0, self.stale_after / 3), 0
        while changed < CLAIMS:
            try:
                if self._claim():
                    self._thread.start()
                    return self
                changed += 1
            except ExtractError:
                raise
            except Exception as e:  # noqa: BLE001 - the backend says which are its own, and raises the others
                self.records.failed_claim(e, deadline)
        raise StoreBusyError(f"--out {self.store}: could not take the lock {self.path} from a stale holder; rerun")

    def _claim(self) -> bool:
        """One try: create the lock, or take over a stale one. False to try again (the lock changed under
        us: released, or taken by another taker whose record we have not read yet)."""
        self._version = self.records.create(self.record)
        if self._version is not None:
            return True
        found = self.records.read()
        if found is None:
            return False  # released meanwhile
        holder, version = found
        if holder.get("token") == self.token:  # our create landed on a try whose answer was lost
            self._version = version
            return True
        if not stale(holder, self.stale_after):
            raise busy(self.records, holder)
        self._version = self.records.take_over(holder, version, self.record, self.stale_after)
        return self._version is not None or self._ours()

    def _ours(self) -> bool:
        """After a write that did not land as asked: whether the record is ours all the same (our own
        request landed on an earlier try); adopts its version if so."""
        found = self.records.read()
        if found is not None and found[0].get("token") == self.token:
            self._version = found[1]
            return True
        return False

    def held(self) -> bool:
        """Whether the lock is still ours, read afresh. An error past the retries is raised
        (``ExtractError``), not taken for a lost lock."""
        try:
            found = self.records.read()
        except self.records.outage as e:
            raise ExtractError(
                f"--out {self.store}: cannot read the lock {self.path} ({self.records.describe(e)})"
            ) from None
        return found is not None and found[0].get("token") == self.token

    def sweep(self) -> None:
        self.records.sweep()

    def _refresh(self) -> bool:
        """One refresh of the record we last wrote; False once the lock is not ours."""
        assert self._version is not None
        version = self.records.refresh(self.record, self._version)
        if version is None:
            return self._ours()
        self._version = version
        return True

    def _beat(self) -> None:
        while not self._wait(self._stop, self.heartbeat):
            with self._mutex:
                if self._stop.is_set():
                    return
                try:
                    if not self._refresh():  # taken over after we stalled past the stale age, or removed
                        self.lost.set()
                        return  # never refresh, nor recreate, another's lock
                except self.records.outage:
                    continue  # the next beat tries again (a read-only remount: the writes will say so)

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        with self._mutex:
            if self.lost.is_set() or self._version is None:
                return
            try:
                # The refresh proves the lock ours and restarts its age, so no job may take it over
                # before the delete lands (object storage deletes unconditionally).
                if self._refresh():
                    self.records.delete()
            except self.records.outage:
                pass  # the error that stopped the run is the one to report; the lock goes stale


def lost(records: Records, holder: Record | None) -> LockLostError:
    """The error of a holder whose lock, or whose store's ``writer``, is another job's now (``holder``)."""
    whom = f"to another job ({holder_name(holder)})" if holder is not None and "pid" in holder else records.vanished
    return LockLostError(
        f"lost the lock on --out {records.store} {whom} while paused or stalled; this run stopped and marked "
        "nothing more; the other job owns the store now"
    )
