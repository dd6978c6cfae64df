"""Issue 30: one lock protocol, the same tests for both of its implementations: the file beside a store on
disk (``lock.py``) and the object beside a store on object storage (``object_lock.py``, against moto's S3
server, ``tests/s3.py``). Time is a fake clock: a test moves it on and wakes the heartbeat, and never
sleeps past a heartbeat or a stale age. What only one kind has (hard links, conditional-write races, a
real SIGSTOP) stays in test_object_lock.py, test_reliability.py and test_robustness.py."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import patience

from extract.errors import LockLostError, StoreBusyError
from extract.store.held_lock import HEARTBEAT, STALE_AFTER, process_namespace
from extract.store.locking import Lock, check_unlocked, live_holder, lock_for, lock_name, lost_lock

ELSEWHERE = {"host": "elsewhere", "pid": 4242, "started": "2026-01-01T00:00:00", "token": "theirs"}
OTHER_NAMESPACE = "pid:[4026599999]"


class FakeClock:
    """Wall-clock time that moves only when a test says so, and a heartbeat wait on it: ``advance``
    wakes every heartbeat whose wait it ends, and returns once each has beaten (and sleeps again, or
    has stopped)."""

    def __init__(self, now: float | None = None) -> None:
        self.now = time.time() if now is None else now
        self._changed = threading.Condition()
        self._until: dict[threading.Thread, float] = {}  # the heartbeats asleep, and until when
        self._naps: dict[threading.Thread, int] = {}

    def __call__(self) -> float:
        return self.now

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        me = threading.current_thread()
        with self._changed:
            self._until[me] = self.now + seconds
            self._naps[me] = self._naps.get(me, 0) + 1
            self._changed.notify_all()
            while self.now < self._until[me] and not stop.is_set():
                self._changed.wait(0.05)  # a lock's release sets ``stop`` without telling us: look again soon
            del self._until[me]
            return stop.is_set()

    def asleep(self, lock: Lock) -> None:
        """Return once the heartbeat of ``lock``, just claimed, sleeps on this clock."""
        thread = lock._thread  # type: ignore[attr-defined]
        with self._changed:
            assert self._changed.wait_for(lambda: thread in self._until, timeout=patience.ceiling(10)), "no heartbeat"

    def advance(self, seconds: float) -> None:
        with self._changed:
            self.now += seconds
            woken = {t: self._naps[t] for t, until in self._until.items() if until <= self.now}
            self._changed.notify_all()
            deadline = time.monotonic() + patience.ceiling(10)  # a thread's turn comes late on a busy machine
            while not all(self._naps[t] > naps or not t.is_alive() for t, naps in woken.items()):
                assert time.monotonic() < deadline, "a heartbeat did not come back"
                self._changed.wait(0.01)  # a heartbeat that stops (a lost lock) ends without telling us


class Place:
    """Where a store and its lock are, for one kind of lock; what a test reads and plants there is read
    and written directly (a file, an object), not through the lock."""

    clock: FakeClock
    store: Path | str
    sweeps: bool  # whether killed claimers can leave records of their own beside the lock
    shown: str  # what a busy message adds after its holder
    foreign: str  # the busy message of a lock that names no process
    vanished: str  # how a lost lock's message says its lock is gone

    def lock(self, stale_after: float | None = None) -> Lock:
        return lock_for(self.store, stale_after, clock=self.clock, wait=self.clock.wait)

    def claim(self, lock: Lock | None = None, clock: FakeClock | None = None) -> Lock:
        """``lock`` (default: a new one on this place's clock) claimed, its heartbeat asleep on ``clock``."""
        lock = lock or self.lock()
        lock.__enter__()
        (clock or self.clock).asleep(lock)
        return lock

    @contextlib.contextmanager
    def holding(self, lock: Lock | None = None) -> Iterator[Lock]:
        lock = self.claim(lock)
        try:
            yield lock
        finally:
            lock.__exit__(None, None, None)

    def record(self) -> dict | None:
        text = self.read()
        return None if text is None else json.loads(text)

    def plant(self, fields: dict, beat: float) -> None:
        """Another job's record, its last heartbeat at ``beat``."""
        raise NotImplementedError

    def read(self) -> bytes | None:
        raise NotImplementedError

    def beat(self) -> float:
        """The time of the lock's last heartbeat, as stored."""
        raise NotImplementedError

    def version(self) -> object:
        """What changes with every write of the lock."""
        raise NotImplementedError

    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        raise NotImplementedError

    def leave_debris(self) -> dict[str, str]:
        """What killed claimers could leave beside the lock: name -> "swept" or "kept" by the holder's
        next sweep, and all of it swept a minute later."""
        raise NotImplementedError

    def debris(self) -> set[str]:
        raise NotImplementedError


class FilePlace(Place):
    def __init__(self, tmp_path: Path, clock: FakeClock) -> None:
        self.clock, self.store, self.path = clock, tmp_path / "out.zarr", tmp_path / "out.zarr.lock"
        self.shown, self.sweeps = "", True
        self.foreign = f"--out {self.store} is being claimed by another job that is starting; wait for it, then rerun"
        self.vanished = "(its lock file out.zarr.lock was removed, or taken by a job that has finished)"

    def plant(self, fields: dict, beat: float) -> None:
        self.path.write_text(json.dumps(fields))
        os.utime(self.path, (beat, beat))

    def read(self) -> bytes | None:
        return self.path.read_bytes() if self.path.exists() else None

    def beat(self) -> float:
        return self.path.stat().st_mtime

    def version(self) -> object:
        stat = self.path.stat()
        return stat.st_ino, stat.st_mtime_ns, self.path.read_bytes()

    def write(self, data: bytes) -> None:
        self.path.write_bytes(data)

    def remove(self) -> None:
        self.path.unlink()

    def leave_debris(self) -> dict[str, str]:
        dead = subprocess.Popen(["true"])
        dead.wait()  # a pid of this namespace that no longer runs
        here, prefix = socket.gethostname(), f".{self.path.name}-"
        records = {  # a claimer's own record, linked into place as the lock; a kill before that leaves it
            f"{prefix}{here}-{dead.pid}": ({"host": here, "pid": dead.pid, **process_namespace()}, "swept"),
            f"{prefix}{here}-{dead.pid + 1}": ({"host": here, "pid": dead.pid + 1, "pid_ns": OTHER_NAMESPACE}, "kept"),
            f"{prefix}node-17-4242": ({"host": "node-17", "pid": 4242}, "kept"),  # young: maybe mid-claim
            f"{prefix}{here}-{dead.pid + 2}": (None, "kept"),  # cut short by the kill, and young
        }
        for name, (record, _) in records.items():
            (self.path.parent / name).write_text("" if record is None else json.dumps(record))
            os.utime(self.path.parent / name, (self.clock.now, self.clock.now))
        return {name: fate for name, (_, fate) in records.items()}

    def debris(self) -> set[str]:
        return {p.name for p in self.path.parent.iterdir() if p.name.startswith(f".{self.path.name}-")}


class ObjectPlace(Place):
    def __init__(self, s3, clock: FakeClock) -> None:  # noqa: ANN001 - tests/s3.py's S3Prefix
        from extract.store.location import object_store

        self.s3, self.clock, self.store = s3, clock, s3.url("out.zarr")
        self.objects, self.key = object_store(s3.url()), "out.zarr.lock"
        self.shown, self.sweeps = f"; lock {self.store}.lock", False
        self.foreign = (
            f"--out {self.store} is locked by {self.store}.lock, which is not a record of extract's; "
            "if no job writes the store, delete that object, then rerun"
        )
        self.vanished = f"(its lock {self.store}.lock was deleted, or taken by a job that has finished)"

    def plant(self, fields: dict, beat: float) -> None:
        self.write(json.dumps({**fields, "time": beat}).encode())

    def read(self) -> bytes | None:
        import obstore

        try:
            return bytes(obstore.get(self.objects, self.key).bytes())
        except FileNotFoundError:
            return None

    def beat(self) -> float:
        return self.record()["time"]

    def version(self) -> object:
        import obstore

        return obstore.head(self.objects, self.key)["e_tag"]

    def write(self, data: bytes) -> None:
        import obstore

        obstore.put(self.objects, self.key, data)

    def remove(self) -> None:
        import obstore

        obstore.delete(self.objects, self.key)

    def leave_debris(self) -> dict[str, str]:
        # A conditional PUT is atomic: a killed claimer leaves nothing of its own, and the holder's sweep
        # deletes nothing beside the lock (here, an object named as a disk claimer's record would be).
        self.write_beside(f".{self.key}-node-17-4242")
        return {f".{self.key}-node-17-4242": "kept"}

    def write_beside(self, key: str) -> None:
        import obstore

        obstore.put(self.objects, key, b"{}")

    def debris(self) -> set[str]:
        return {key for key in self.s3.keys() if key.startswith(f".{self.key}-")}


@pytest.fixture(params=["file", "object"])
def place(request, tmp_path, monkeypatch) -> Place:
    for variable in ("EXTRACT_LOCK_HEARTBEAT", "EXTRACT_LOCK_STALE_AFTER"):
        monkeypatch.delenv(variable, raising=False)  # the defaults: the clock is fake, so a minute costs nothing
    clock = FakeClock()
    if request.param == "file":
        return FilePlace(tmp_path, clock)
    return ObjectPlace(request.getfixturevalue("s3"), clock)


def busy_message(place: Place, holder: dict, name: str | None = None) -> str:
    """The refusal of a claim that ``holder`` holds (``name``: how it is named, ``host H, pid P``)."""
    name = name or f"host {holder['host']}, pid {holder['pid']}"
    return (
        f"--out {place.store} is being written by another job ({name}, since {holder['started']}{place.shown}); "
        "wait for it to finish or stop it, then rerun"
    )


def reaped() -> int:
    """A pid of this PID namespace that no longer runs."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_lock_is_claimed_refuses_a_second_job_naming_the_holder_and_is_released(place):
    lock = place.claim()
    try:
        assert isinstance(lock, Lock) and lock.held() and not lock.lost.is_set()
        assert lock_name(place.store) == f"{place.store}.lock" and str(lock.path) == f"{place.store}.lock"
        record = place.record()
        assert record["token"] == lock.token and len(lock.token) == 32
        assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
        assert {k: record[k] for k in process_namespace()} == process_namespace()
        assert place.beat() == pytest.approx(place.clock.now, abs=1e-3)  # the first beat, on the lock's clock
        before = place.version()
        with pytest.raises(StoreBusyError) as busy:
            place.lock().__enter__()
        assert str(busy.value) == busy_message(place, record)
        with pytest.raises(StoreBusyError) as looked:
            check_unlocked(place.store, clock=place.clock)
        assert str(looked.value) == str(busy.value)
        assert live_holder(place.store, clock=place.clock)["token"] == lock.token
        assert place.version() == before and lock.held()  # the refused claim touched nothing
    finally:
        lock.__exit__(None, None, None)
    assert place.read() is None and not lock.held()
    check_unlocked(place.store, clock=place.clock)
    assert live_holder(place.store, clock=place.clock) is None
    with place.lock() as again:  # free for the next job
        assert place.record()["token"] == again.token != lock.token


def test_the_heartbeat_refreshes_the_lock_so_it_never_goes_stale(place):
    with place.holding() as lock:
        first, version = place.beat(), place.version()
        place.clock.advance(HEARTBEAT / 2)  # no beat yet
        assert place.beat() == first and place.version() == version
        place.clock.advance(HEARTBEAT / 2)
        assert place.beat() == pytest.approx(place.clock.now, abs=1e-3) and place.version() != version
        for _ in range(int(STALE_AFTER / HEARTBEAT) + 1):  # past the stale age, beating all along
            place.clock.advance(HEARTBEAT)
            assert place.beat() == pytest.approx(place.clock.now, abs=1e-3), "a beat at every heartbeat"
        assert place.clock.now - first > STALE_AFTER
        assert lock.held() and not lock.lost.is_set() and place.record()["token"] == lock.token
        with pytest.raises(StoreBusyError, match="being written by another job"):
            place.lock().__enter__()
        assert live_holder(place.store, clock=place.clock)["token"] == lock.token


def test_a_stale_lock_is_taken_over_and_a_live_one_of_another_host_is_not(place):
    place.plant(ELSEWHERE, beat=place.clock.now)
    with pytest.raises(StoreBusyError) as busy:
        place.lock().__enter__()
    assert str(busy.value) == busy_message(place, ELSEWHERE)
    assert place.record()["token"] == "theirs"
    place.clock.advance(STALE_AFTER - 1)  # not yet stale
    with pytest.raises(StoreBusyError):
        place.lock().__enter__()
    assert live_holder(place.store, clock=place.clock)["token"] == "theirs"
    place.clock.advance(2)  # its heartbeat stopped longer ago than the stale age
    assert live_holder(place.store, clock=place.clock) is None
    check_unlocked(place.store, clock=place.clock)
    with place.holding() as lock:
        assert place.record()["token"] == lock.token and lock.held()
    assert place.read() is None


def test_a_caller_may_judge_staleness_more_strictly(place):
    place.plant(ELSEWHERE, beat=place.clock.now)
    place.clock.advance(10)
    with pytest.raises(StoreBusyError):
        check_unlocked(place.store, clock=place.clock)
    check_unlocked(place.store, stale_after=5, clock=place.clock)
    with place.holding(place.lock(stale_after=5)) as lock:
        assert place.record()["token"] == lock.token


def test_a_lock_of_a_dead_process_of_this_host_is_taken_over_at_once(place):
    if not process_namespace():
        pytest.skip("no /proc: no PID namespace to record")
    place.plant({**ELSEWHERE, "host": socket.gethostname(), "pid": reaped(), **process_namespace()}, place.clock.now)
    assert live_holder(place.store, clock=place.clock) is None
    with place.holding() as lock:
        assert place.record()["token"] == lock.token


@pytest.mark.parametrize("whose", ["another namespace", "another boot", "an older lock"])
def test_a_lock_whose_pid_is_of_another_namespace_waits_for_its_heartbeat(place, whose):
    """A holder of this host in another container (PID namespace), of another boot, or whose lock does
    not say which: its pid runs nowhere here, which proves nothing; the lock is taken once its heartbeat
    is stale."""
    ours = process_namespace()
    if not ours:
        pytest.skip("no /proc: no PID namespace to record")
    fields = {"another namespace": {**ours, "pid_ns": OTHER_NAMESPACE}, "another boot": {**ours, "boot": "another"},
              "an older lock": {}}[whose]  # fmt: skip
    holder = {**ELSEWHERE, "host": socket.gethostname(), "pid": reaped(), **fields}
    place.plant(holder, beat=place.clock.now)
    with pytest.raises(StoreBusyError) as busy:
        place.lock().__enter__()
    name = f"host {socket.gethostname()}, pid {holder['pid']}"
    if whose == "another namespace":
        name += f" in another PID namespace, {OTHER_NAMESPACE} (a container)"
    assert str(busy.value) == busy_message(place, holder, name)
    with pytest.raises(StoreBusyError):
        check_unlocked(place.store, clock=place.clock)
    assert place.record()["token"] == "theirs"  # left alone
    place.clock.advance(STALE_AFTER + 1)  # its heartbeat stopped a minute ago
    with place.holding() as lock:
        assert place.record()["token"] == lock.token


def test_a_lock_that_names_no_process_is_refused_until_it_is_stale(place):
    place.write(b"")  # on disk, an O_EXCL claimer yet to write its record; on S3, some other program's
    with pytest.raises(StoreBusyError) as busy:
        place.lock().__enter__()
    assert str(busy.value) == place.foreign
    assert live_holder(place.store, clock=place.clock) == {"age": pytest.approx(0, abs=30)}
    place.clock.advance(STALE_AFTER + 30)  # aged by its mtime, or the server's Last-Modified
    with place.holding() as lock:
        assert place.record()["token"] == lock.token


@pytest.mark.parametrize("how", ["taken over", "removed"])
def test_the_heartbeat_finds_its_lock_lost_and_never_refreshes_nor_recreates_it(place, how):
    lock = place.claim()
    try:
        if how == "removed":
            place.remove()
        else:
            place.plant(ELSEWHERE, beat=place.clock.now - 1)
            planted = place.version()
        assert not lock.lost.is_set()
        place.clock.advance(HEARTBEAT)
        assert lock.lost.is_set() and not lock.held()
        place.clock.advance(3 * HEARTBEAT)  # no more beats: the heartbeat has stopped
        assert place.read() is None if how == "removed" else place.version() == planted
        whom = place.vanished if how == "removed" else "to another job (host elsewhere, pid 4242)"
        error = lost_lock(place.store, clock=place.clock)
        assert isinstance(error, LockLostError) and str(error) == (
            f"lost the lock on --out {place.store} {whom} while paused or stalled; this run stopped and "
            "marked nothing more; the other job owns the store now"
        )
    finally:
        lock.__exit__(None, None, None)
    assert place.read() is None if how == "removed" else place.version() == planted  # its release deletes nothing


@pytest.mark.parametrize("notices", [True, False])
def test_a_holder_paused_past_the_stale_age_loses_the_lock_and_never_touches_the_new_holders(place, notices):
    """The old holder's own clock stands still (paused: its heartbeat does not beat) while the world's
    moves on past the stale age and another job takes the lock over; whether the old holder's heartbeat
    notices first or it releases the lock at once, the new holder's lock is left as it is."""
    paused = FakeClock(place.clock.now)
    old = place.claim(lock_for(place.store, clock=paused, wait=paused.wait), paused)
    place.clock.advance(STALE_AFTER + 1)
    new = place.claim(place.lock())
    try:
        taken = place.version()
        assert place.record()["token"] == new.token and new.held() and not old.held()
        if notices:
            paused.advance(HEARTBEAT)  # it comes back, and beats
            assert old.lost.is_set()
            assert str(lost_lock(place.store, clock=place.clock)).startswith(
                f"lost the lock on --out {place.store} to another job (host {socket.gethostname()}, pid {os.getpid()})"
            )
        old.__exit__(None, None, None)
        assert place.version() == taken and new.held() and not new.lost.is_set()
        place.clock.advance(HEARTBEAT)
        assert new.held() and not new.lost.is_set() and place.beat() == pytest.approx(place.clock.now, abs=1e-3)
    finally:
        new.__exit__(None, None, None)
    assert place.read() is None


def test_the_holders_sweep_deletes_only_what_killed_claimers_left(place):
    with place.holding() as lock:
        fates = place.leave_debris()
        lock.sweep()
        assert {name: "kept" if name in place.debris() else "swept" for name in fates} == fates
        place.clock.advance(61)  # a claimer's record a minute old is no claim in progress
        lock.sweep()
        assert place.debris() == (set() if place.sweeps else set(fates))
        assert lock.held() and place.record()["token"] == lock.token
