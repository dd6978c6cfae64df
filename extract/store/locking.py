"""One lock protocol for a store, with a file and an object implementation (DESIGN.md, "The store's life cycle").

Callers never branch on the kind of store: ``lock_for(store)`` makes the lock of a path (a file beside
it, ``lock.py``) or of a URL on object storage (an object beside it, ``object_lock.py``), and
``check_unlocked``, ``live_holder``, ``lost_lock`` and ``lock_name`` answer for either. Both locks are
one ``HeldLock`` (``held_lock.py``: the record, staleness, the claim, the heartbeat, the messages) over
the backend that keeps their record. The backends' modules are loaded when a lock is met: readers that
never meet one never load them.

Time is injectable (``clock``, and the heartbeat's ``wait``): see ``held_lock.py``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import ExtractError, LockLostError
from .held_lock import Clock, Record, Records, Wait, busy, lost, resolved_timings, stale, timings, wait_for_stop
from .location import Location, parse

if TYPE_CHECKING:
    from types import TracebackType


# the protocol every caller speaks --------------------------------------------------------------------


@runtime_checkable
class Lock(Protocol):
    """The lock of one store, claimed by rank 0 before anything at ``--out`` is looked at, created or
    wiped, and held to the end: ``with lock_for(out) as lock:``."""

    store: str | Path
    path: Path | str  # the lock file, or the lock object's URL
    token: str  # also the store's ``writer`` while this lock holds it
    lost: threading.Event  # set by the heartbeat once the lock is not ours any more

    def __enter__(self) -> Lock: ...

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def held(self) -> bool:
        """Whether the lock is still ours, read afresh: not taken over, not removed by hand."""
        ...

    def sweep(self) -> None:
        """Delete what killed claimers left beside the lock."""
        ...


# one lock for a path or a URL ----------------------------------------------------------------------


def _location(store: Path | str | Location) -> Location:
    return store if isinstance(store, Location) else parse(store)


def records_for(store: Path | str | Location, *, clock: Clock = time.time, timeout: float | None = None) -> Records:
    """The backend of the lock of ``store``: an object beside a URL, a file beside a path. The backends'
    modules are loaded here: readers that never meet a lock never load them."""
    location = _location(store)
    if location.remote:
        from .object_lock import ObjectRecords

        return ObjectRecords(location, clock=clock, timeout=timeout)
    from .lock import FileRecords

    assert location.path is not None
    return FileRecords(location.path, clock=clock)


def lock_for(
    store: Path | str | Location, stale_after: float | None = None, *, clock: Clock = time.time,
    wait: Wait = wait_for_stop,
) -> Lock:  # fmt: skip
    """The lock of ``store`` (a path, or a URL on object storage), not yet claimed: use ``with``."""
    location = _location(store)
    if location.remote:
        from .object_lock import ObjectStoreLock

        return ObjectStoreLock(location, stale_after, clock=clock, wait=wait)
    from .lock import StoreLock

    assert location.path is not None
    return StoreLock(location.path, stale_after, clock=clock, wait=wait)


def lock_name(store: Path | str | Location) -> str:
    """Where the lock of ``store`` is: ``<store>.lock`` beside it, a path or a URL."""
    return _location(store).lock


def live_holder(store: Path | str | Location, *, clock: Clock = time.time) -> Record | None:
    """The record of the job holding the lock of ``store`` (host, pid, started), None when there is no
    lock or it is stale; for readers, which never take a lock. A failed read is raised (obstore's)."""
    found = records_for(store, clock=clock).read()
    return found[0] if found is not None and not stale(found[0], timings()[1]) else None


def check_unlocked(store: Path | str | Location, stale_after: float | None = None, *, clock: Clock = time.time) -> None:
    """Refuse a store that a live job holds (for callers that only look, such as ``verify --repair``)."""
    records = records_for(store, clock=clock)
    try:
        found = records.read()
    except records.outage as e:
        raise ExtractError(f"{records.store}: cannot read its lock {records.where} ({records.describe(e)})") from None
    if found is not None and not stale(found[0], resolved_timings(stale_after)[1]):
        raise busy(records, found[0])


def lost_lock(store: Path | str | Location, *, clock: Clock = time.time) -> LockLostError:
    """The error of a holder whose lock, or whose store's ``writer``, is another job's now."""
    records = records_for(store, clock=clock)
    try:
        found = records.read()
    except Exception:  # noqa: BLE001 - the error being reported is the lost lock, not this read
        found = None
    return lost(records, found[0] if found is not None else None)
