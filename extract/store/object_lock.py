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
  dead process of this host, proven so by its PID namespace: ``lock.provably_gone``) is replaced by a conditional replace of the stale version's ETag, so of
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
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from ..errors import ExtractError, LockLostError, StoreBusyError
from .location import Location, lock_object, one_line, parse
from .lock import LockUnavailable, _stale, holder_name, now, process_namespace, timings

Version = dict[str, str]  # obstore's UpdateVersion: the ``e_tag`` (S3, Azure) and ``version`` (GCS's generation)


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


def _read(store: Any, key: str) -> tuple[dict[str, Any], Version] | None:
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
        age = now() - float(beat)
    else:  # not a record of ours: judge it by the server's clock
        age = now() - meta["last_modified"].timestamp()
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


def _busy(location: Location, holder: dict[str, Any]) -> StoreBusyError:
    if "pid" not in holder:
        return StoreBusyError(
            f"--out {location} is locked by {location.lock}, which is not a record of extract's; "
            "if no job writes the store, delete that object, then rerun"
        )
    return StoreBusyError(
        f"--out {location} is being written by another job ({holder_name(holder)}, since {holder.get('started')}; "
        f"lock {location.lock}); wait for it to finish or stop it, then rerun"
    )


def lock_url(store: str | Location) -> str:
    """The URL of a remote store's lock object, ``<url>.lock``."""
    return _location(store).lock


def lost_lock(store: str | Location) -> LockLostError:
    """The error of a holder whose lock is another job's now (or was deleted)."""
    location = _location(store)
    found = None
    try:
        found = _read(*lock_object(location))
    except Exception:  # the error being reported is the lost lock, not this read
        pass
    holder = found[0] if found is not None else None
    if holder is not None and "pid" in holder:
        whom = f"to another job ({holder_name(holder)})"
    else:
        whom = f"(its lock {location.lock} was deleted, or taken by a job that has finished)"
    return LockLostError(
        f"lost the lock on --out {location} {whom} while paused or stalled; this run stopped and marked "
        "nothing more; the other job owns the store now"
    )


def live_holder(store: str | Location) -> dict[str, Any] | None:
    """The record of the job holding the lock of ``store`` (host, pid, started), None when there is no
    lock or it is stale; for readers, which never take a lock. A failed read is raised (obstore's)."""
    found = _read(*lock_object(_location(store)))
    return found[0] if found is not None and not _stale(found[0], timings()[1]) else None


def check_unlocked(store: str | Location, stale_after: float | None = None) -> None:
    """Refuse a store that a live job holds (for callers that only look, such as ``verify --repair``)."""
    location = _location(store)
    _, errors = _obstore()
    try:
        found = _read(*lock_object(location))
    except errors.BaseError as e:
        raise _failed(f"{location}: cannot read its lock {location.lock}", e) from None
    if found is not None and not _stale(found[0], timings()[1] if stale_after is None else stale_after):
        raise _busy(location, found[0])


class ObjectStoreLock:
    """Claimed by rank 0 before anything at ``--out`` is looked at, created or deleted; held to the end.
    The interface of ``StoreLock``: a context manager with ``token``, ``held()``, ``lost`` and ``sweep()``."""

    def __init__(self, store: str | Location, stale_after: float | None = None) -> None:
        self.location = _location(store)
        self.store = str(self.location)
        self.path = self.location.lock  # the lock's URL (``StoreLock.path`` is the lock file)
        self.heartbeat, default_stale = timings()
        self.stale_after = default_stale if stale_after is None else stale_after
        # Each request, retries included, ends well before the lock could go stale, so that none of
        # ours lands after another job may have taken the lock over (the release's delete relies on it).
        self._objects, self._key = lock_object(self.location, timeout=max(5.0, self.stale_after / 3))
        self.token = uuid.uuid4().hex  # also the store's ``writer`` while this lock holds it
        self.record = {
            "host": socket.gethostname(), "pid": os.getpid(), **process_namespace(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "token": self.token,
        }  # fmt: skip
        self.lost = threading.Event()  # set by the heartbeat once the lock is not ours any more
        self._version: Version | None = None  # the version of the record we last wrote
        self._mutex = threading.Lock()  # one request of ours on the lock at a time (heartbeat, release)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="extract-object-lock", daemon=True)

    def _fresh(self) -> dict[str, Any]:
        return {**self.record, "time": now()}

    def _ours(self) -> bool:
        """After a failed precondition: whether the record is ours all the same (our own request landed
        on an earlier try); adopts its version if so."""
        found = _read(self._objects, self._key)
        if found is not None and found[0].get("token") == self.token:
            self._version = found[1]
            return True
        return False

    def __enter__(self) -> ObjectStoreLock:
        _, errors = _obstore()
        # obstore does not retry a conditional PUT whose connection was reset (it is not idempotent), so
        # the claim is tried again here: a create that landed is recognised by its token (``_claim``).
        deadline, changed = time.monotonic() + max(5.0, self.stale_after / 3), 0
        while changed < 3:
            try:
                if self._claim():
                    self._thread.start()
                    return self
                changed += 1
            except (errors.PermissionDeniedError, errors.UnauthenticatedError) as e:
                raise LockUnavailable(
                    f"--out {self.store}: cannot create the lock {self.path} ({one_line(e)})"
                ) from None
            except errors.GenericError as e:  # a reset or an outage past obstore's own retries
                if time.monotonic() > deadline:
                    raise _failed(f"--out {self.store}: cannot create the lock {self.path}", e) from None
                time.sleep(0.2)
            except errors.BaseError as e:
                raise _failed(f"--out {self.store}: cannot create the lock {self.path}", e) from None
        raise StoreBusyError(f"--out {self.store}: could not take the lock {self.path} from a stale holder; rerun")

    def _claim(self) -> bool:
        """One try: create the lock, or take over a stale one. False to try again (the lock changed
        under us: released, or taken by another taker whose record we have not read yet)."""
        try:
            self._version = _put(self._objects, self._key, self._fresh(), "create")
            return True
        except _Conflict:
            pass
        found = _read(self._objects, self._key)
        if found is None:
            return False  # released meanwhile: try again
        holder, version = found
        if holder.get("token") == self.token:  # our create landed on a try whose answer was lost
            self._version = version
            return True
        if not _stale(holder, self.stale_after):
            raise _busy(self.location, holder)
        try:
            self._version = _put(self._objects, self._key, self._fresh(), version)
            return True
        except _Conflict:  # another taker won (or the holder came back): the next try reads whose it is
            return self._ours()

    def sweep(self) -> None:
        """Nothing to sweep on object storage: a conditional PUT is atomic, so a killed claimer leaves no
        partial record of its own beside the lock (``StoreLock.sweep`` deletes those on disk)."""

    def held(self) -> bool:
        """Whether the lock object is still ours, read afresh: not taken over, not deleted by hand. An
        error past the retries is raised (``ExtractError``), not taken for a lost lock."""
        _, errors = _obstore()
        try:
            found = _read(self._objects, self._key)
        except errors.BaseError as e:
            raise _failed(f"--out {self.store}: cannot read the lock {self.path}", e) from None
        return found is not None and found[0].get("token") == self.token

    def _refresh(self) -> bool:
        """One conditional replace of the record we last wrote; False once the lock is not ours."""
        assert self._version is not None
        try:
            self._version = _put(self._objects, self._key, self._fresh(), self._version)
            return True
        except _Conflict:
            return self._ours()

    def _beat(self) -> None:
        _, errors = _obstore()
        while not self._stop.wait(self.heartbeat):
            with self._mutex:
                if self._stop.is_set():
                    return
                try:
                    if not self._refresh():  # taken over after we stalled past the stale age, or deleted
                        self.lost.set()
                        return  # never refresh, nor recreate, another's lock
                except (errors.BaseError, OSError):
                    continue  # an outage past the retries: the next beat tries again

    def __exit__(self, *_: object) -> None:
        obstore, errors = _obstore()
        self._stop.set()
        with self._mutex:
            if self.lost.is_set() or self._version is None:
                return
            try:
                if self._refresh():  # still ours, and not stale for STALE_AFTER from now
                    obstore.delete(self._objects, self._key)
            except (errors.BaseError, OSError):
                pass  # unreachable: the lock goes stale and the next job takes it over
