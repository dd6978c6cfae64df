"""One live job per store on object storage: a lock object beside the store, made of conditional writes.

The same life and semantics as the local lock (``lock.py``), with the two atomic steps a bucket gives
in place of ``O_EXCL`` and a hard link:

- **claim**: a conditional create of ``<store>.lock`` (``If-None-Match: *``); of two jobs started at
  the same instant exactly one gets it, the other is told the holder's host and pid.
- **heartbeat**: every ``HEARTBEAT`` seconds a conditional replace (``If-Match``) of the ETag the
  holder itself last wrote, with a fresh ``time``. A failed precondition means the object is not the
  one we wrote: another job took the lock over (we were paused or cut off past the stale age) or it
  was deleted; the holder sets ``lost`` and stops, never writing over the new holder's record.
- **takeover**: a lock whose record's ``time`` is older than ``STALE_AFTER`` (or whose holder is a
  dead process of this host, proven so by its PID namespace: ``held_lock.provably_gone``) is replaced by a conditional replace of the stale version's ETag, so of
  two jobs taking over one stale lock exactly one wins; the other's precondition fails, and it finds
  a live holder.

Staleness is read from the record's own wall-clock ``time``, written by the holder, not from the
object's ``Last-Modified``, which is the server's clock: the hosts' clocks must agree to well within
``STALE_AFTER`` (NTP does), as they must for the local lock on a shared filesystem.

A request that was retried after its first try had in fact landed (a response lost to a connection
reset) finds its own precondition failed; so every failed precondition re-reads the record, and a
record holding our ``token`` is ours (no other job writes our token).

**Release** refreshes the lock one last time with a conditional replace and then deletes it. obstore's
delete is unconditional (S3's ``DeleteObject`` takes no ``If-Match`` in the API obstore speaks), so the
refresh is what makes the delete safe: it proves the lock was still ours and restarts its age, and no
job can take a lock over until its age reaches ``STALE_AFTER``; so the delete, sent milliseconds later,
deletes our own record unless it is delayed by that long (each lock request's tries and retries are
capped at a third of ``STALE_AFTER``, 5 s at least). The
alternative, a conditional write of a "released" record, is atomic but leaves an object behind, and
deleting that afterwards opens a wider window: a released record may be taken at once, a stale one
only after ``STALE_AFTER``.

There are no per-claimer temporary objects to ``sweep``: a PUT is atomic, so a lock object is never
seen half written, and a claimer killed mid-request leaves either nothing or a whole record.

The claim, the heartbeat, the release and the messages are every lock's (``held_lock.py``); this module
is how a bucket keeps the record: ``ObjectRecords``.
"""

from __future__ import annotations

import json
import time
from functools import cached_property
from typing import Any

from ..errors import ExtractError, LockUnavailable
from .held_lock import Clock, HeldLock, Record, Version, Wait, resolved_timings, wait_for_stop
from .location import Location, lock_object, one_line, parse


def _location(store: str | Location) -> Location:
    location = store if isinstance(store, Location) else parse(store)
    if not location.remote:
        raise ExtractError(f"{store} is a local path; its lock is a file (extract.store.lock.StoreLock)")
    return location


def _obstore() -> tuple[Any, Any]:
    import obstore
    import obstore.exceptions

    return obstore, obstore.exceptions


class _Conflict(Exception):
    """A conditional write's precondition failed (or the server reported a conflicting write)."""


def _version(found: dict[str, Any]) -> Version:
    """The version a put result or an object's metadata names, for a conditional replace of it."""
    version = {k: found[k] for k in ("e_tag", "version") if found.get(k)}
    if not version:  # S3, GCS and Azure all give one; without it there is no conditional replace
        raise ExtractError("the object store gives no ETag or version for the lock, so it cannot hold one")
    return version


def _read(store: Any, key: str, clock: Clock) -> tuple[Record, Version] | None:
    """The lock's record with its heartbeat's ``age``, and its version; None when there is no lock."""
    obstore, _ = _obstore()
    try:
        result = obstore.get(store, key)
        data = bytes(result.bytes())
    except FileNotFoundError:
        return None
    meta = result.meta
    try:
        record = json.loads(data)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        record = {}
    beat = record.get("time")
    if isinstance(beat, int | float) and not isinstance(beat, bool):
        age = clock() - float(beat)
    else:  # not a record of ours: judge it by the server's clock
        age = clock() - meta["last_modified"].timestamp()
    return {**record, "age": age}, _version(meta)


def _put(store: Any, key: str, record: dict[str, Any], mode: str | Version) -> Version:
    """Write ``record`` under ``mode`` (``"create"``, or the version to replace); the version written.
    Raises ``_Conflict`` when the precondition failed."""
    obstore, errors = _obstore()
    data = json.dumps(record).encode()
    try:
        result = obstore.put(store, key, data, mode=mode, use_multipart=False)
    except (errors.AlreadyExistsError, errors.PreconditionError):
        raise _Conflict from None
    except errors.BaseError as e:
        if "409" in one_line(e):  # S3's ConditionalRequestConflict: a concurrent conditional write
            raise _Conflict from None
        raise
    return _version(result)


def _failed(what: str, error: BaseException) -> ExtractError:
    return ExtractError(f"{what} ({one_line(error)})")


class ObjectRecords:
    """A lock's record as the object ``<url>.lock``, its heartbeat the record's own ``time``; every
    write conditional on the version last read or written."""

    def __init__(self, store: str | Location, *, clock: Clock = time.time, timeout: float | None = None) -> None:
        self.location = _location(store)
        self.store, self.where, self.clock, self._timeout = str(self.location), self.location.lock, clock, timeout
        self.foreign = (
            f"--out {self.location} is locked by {self.where}, which is not a record of extract's; "
            "if no job writes the store, delete that object, then rerun"
        )
        self.shown = f"; lock {self.where}"
        self.vanished = f"(its lock {self.where} was deleted, or taken by a job that has finished)"

    @cached_property
    def outage(self) -> tuple[type[BaseException], ...]:
        return (_obstore()[1].BaseError, OSError)

    @cached_property
    def _object(self) -> tuple[Any, str]:
        """The obstore store of the lock's prefix and the lock's key, made on first use (a failure to make
        it is a failed request, where the request is)."""
        return lock_object(self.location, timeout=self._timeout)

    def _fresh(self, record: Record) -> Record:
        return {**record, "time": self.clock()}

    def _put(self, record: Record, mode: str | Version) -> Version | None:
        try:
            return _put(*self._object, self._fresh(record), mode)
        except _Conflict:
            return None

    def read(self) -> tuple[Record, Version] | None:
        return _read(*self._object, self.clock)

    def create(self, record: Record) -> Version | None:
        return self._put(record, "create")

    def refresh(self, record: Record, version: Version) -> Version | None:
        return self._put(record, version)

    def take_over(self, holder: Record, version: Version, record: Record, stale_after: float) -> Version | None:
        return self._put(record, version)  # of two takers, the other's precondition fails

    def delete(self) -> None:
        obstore, _ = _obstore()
        obstore.delete(*self._object)

    def sweep(self) -> None:
        """Nothing to sweep on object storage: a conditional PUT is atomic, so a killed claimer leaves no
        partial record of its own beside the lock (``FileRecords.sweep`` deletes those on disk)."""

    def describe(self, error: BaseException) -> str:
        return one_line(error)

    def failed_claim(self, error: Exception, deadline: float) -> None:
        _, errors = _obstore()
        what = f"--out {self.store}: cannot create the lock {self.where}"
        if isinstance(error, errors.PermissionDeniedError | errors.UnauthenticatedError):
            raise LockUnavailable(f"{what} ({one_line(error)})") from None
        # obstore does not retry a conditional PUT whose connection was reset (it is not idempotent), so
        # the claim is tried again: a create that landed is recognised by its token (``HeldLock._claim``).
        if isinstance(error, errors.GenericError) and time.monotonic() <= deadline:
            time.sleep(0.2)
            return
        if isinstance(error, errors.BaseError):
            raise _failed(what, error) from None
        raise error


class ObjectStoreLock(HeldLock):
    """The lock of a store on object storage (``locking.Lock``), an object beside it."""

    def __init__(
        self, store: str | Location, stale_after: float | None = None, *, clock: Clock = time.time,
        wait: Wait = wait_for_stop,
    ) -> None:  # fmt: skip
        heartbeat, stale_after = resolved_timings(stale_after)
        # Each request, retries included, ends well before the lock could go stale, so that none of
        # ours lands after another job may have taken the lock over (the release's delete relies on it).
        records = ObjectRecords(store, clock=clock, timeout=max(5.0, stale_after / 3))
        super().__init__(
            records, store=records.store, heartbeat=heartbeat, stale_after=stale_after, clock=clock, wait=wait
        )
