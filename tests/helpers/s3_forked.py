"""Forked runs against a store on S3, run as a script of its own: ``python tests/helpers/s3_forked.py storm|race
PREFIX`` with the environment pointing at the S3 server (``S3Server.env()``) and ``S3_BUCKET``.

Each run is forked from this process (torch is imported once), and killed at a chosen point. obstore's
runtime does not survive a fork (obstore is not fork-safe: a child of a process that made a request
hangs on its first), so this process never makes a request through obstore: it looks at the bucket
with boto3 and compares the stores after downloading them. That is why this is a script: the test
process has used obstore long before.

PREFIX may be empty: the stores are then at the top of the bucket (``s3://BUCKET/NAME.zarr``).

``storm``: ``POINTS`` kills spread over every object a whole run writes (creation, every chunk, the final
marking), and the chosen ones of ``TARGETED``. After each kill: the kill landed at its point; the prefix
is a store only if its root metadata were written, and then holds nothing marked done that was not
written; one rerun of the same command gives the store the job gives on disk, and leaves no lock.
``S3_STORM_POINTS`` sets a larger storm.

``paused``: job A is paused (SIGSTOP) with a request in flight (the fence's read of the root metadata,
held by a fault proxy between A and the server, so that it is in flight for sure) past the lock's stale
age and its write timeout; job B takes the store over with ``--overwrite``; A, continued, must say it
lost the lock to B (exit 1), not that a request timed out, and B's store must be whole.

``race``: two jobs started together on one ``s3://`` path, meeting at the lock's conditional create:
exactly one runs, the other stops with one line naming the holder.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zarr

# run as a script: its folder is sys.path[0]; the tests' folder takes its place, for ``helpers.X``
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from extract.store import object_lock, remote  # noqa: E402
from extract.store.store import FeatureStore  # noqa: E402
from helpers import patience  # noqa: E402
from helpers.cli import FAST_LOCK, SEEDED, TINY_JOB, one_line_error  # noqa: E402
from helpers.faultproxy import FaultProxy  # noqa: E402
from helpers.forked import (  # noqa: E402
    die_after,
    die_on,
    fork_run,
    fork_start,
    fork_wait,
    set_environment,
    started_together,
    the_one_that_ran,
)  # fmt: skip
from helpers.stores import assert_same_store  # noqa: E402

POINTS = int(os.environ.get("S3_STORM_POINTS", "10"))


@functools.cache
def _client():  # one for the script: a boto3 client takes a tenth of a second to make, and is thread-safe
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")


BUCKET = os.environ.get("S3_BUCKET", "extract-tests")


def under(prefix: str, name: str) -> str:
    """The key of ``name`` under ``prefix`` (at the bucket's top where ``prefix`` is empty)."""
    return f"{prefix}/{name}" if prefix else name


def keys(prefix: str) -> list[str]:
    pages = _client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1 :] for page in pages for o in page.get("Contents", []))


def download(prefix: str, into: Path) -> Path:
    client = _client()

    def fetch(key: str) -> None:
        target = into / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(client.get_object(Bucket=BUCKET, Key=f"{prefix}/{key}")["Body"].read())

    # a request at a time took a third of the storm; the threads are gone before the next fork
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(fetch, keys(prefix)))
    return into


def wipe(prefix: str) -> None:
    names = [f"{prefix}/{key}" for key in keys(prefix)] + [f"{prefix}.lock"]
    for start in range(0, len(names), 1000):  # DeleteObjects takes up to 1000 keys
        objects = [{"Key": name} for name in names[start : start + 1000]]
        _client().delete_objects(Bucket=BUCKET, Delete={"Objects": objects, "Quiet": True})


def lock_exists(prefix: str) -> bool:
    listed = _client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}.lock")
    return any(o["Key"] == f"{prefix}.lock" for o in listed.get("Contents", []))


def log_writes(log: Path, die_at: int | None = None):
    """For ``before``: append the key of every object zarr writes on object storage (and ``delete`` for
    each bulk delete) to ``log``, and SIGKILL ourselves instead of write number ``die_at``."""
    from zarr.storage import ObjectStore

    count = [0]

    def note(what: str) -> None:
        with open(log, "a") as f:
            f.write(what + "\n")
        if count[0] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        count[0] += 1

    def wrap(method):
        async def logged(self, key, value, *args, **kwargs):
            note(f"store:{key}")
            return await method(self, key, value, *args, **kwargs)

        return logged

    set_, create = ObjectStore.set, ObjectStore.set_if_not_exists
    delete = remote._delete

    def deleting(store, batch):
        if batch:
            note("delete")
        return delete(store, batch)

    def install():
        ObjectStore.set, ObjectStore.set_if_not_exists = wrap(set_), wrap(create)
        remote._delete = deleting

    return install


def _completing(self, **values):
    return values.get("status") == "complete"


TARGETED = {
    "claim-lock": (die_on(object_lock, "_put", 1), False),  # before the lock's conditional create
    "create-before-root": (die_on(remote.RootLast, "commit", 1), False),  # the skeleton, not its root
    "mid-chunk": (die_on(FeatureStore, "write_chunk", 5), False),
    "before-complete": (die_on(FeatureStore, "update_attrs", 1, _completing), False),
    "after-complete": (die_after(FeatureStore, "update_attrs", _completing), False),
    # --overwrite of the complete store, killed once its root metadata are deleted: the plain rerun
    # finds debris, not a half store, and finishes the deletion
    "overwrite-after-root": (die_on(remote, "_delete", 2), True),
}


def check_what_is_left(prefix: str, logged: list[str], scratch: Path) -> None:
    """After a kill at the last write of ``logged`` (never made)."""
    made = logged[:-1]
    left = keys(prefix)
    assert ("zarr.json" in left) == ("store:zarr.json" in made), (left[:5], made[-3:])
    if "zarr.json" not in left:
        return
    group = zarr.open_group(download(prefix, scratch), mode="r")
    done = np.flatnonzero(group["done"][:]).tolist()
    written = {int(w.rsplit("/", 1)[1]) for w in made if w.startswith("store:done/c/")}
    assert set(done) <= written, (done, written)
    features = group["features/heads.conv"][:]
    for chunk in done:
        assert not np.isnan(features[chunk * 4 : chunk * 4 + 4]).any(), chunk


def storm(prefix: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="s3-storm-"))
    reference = work / "ref.zarr"
    assert fork_run([*TINY_JOB, "--out", reference]) == 0
    store = under(prefix, "storm.zarr")
    url = f"s3://{BUCKET}/{store}"
    whole = work / "whole.log"
    assert fork_run([*TINY_JOB, "--out", url], before=log_writes(whole)) == 0, "the uninterrupted run failed"
    assert_same_store(download(store, work / "whole.zarr"), reference)
    writes = whole.read_text().splitlines()
    points = sorted(set(np.linspace(0, len(writes) - 1, POINTS).round().astype(int).tolist()))

    def rerun(name: str) -> None:
        assert fork_run([*TINY_JOB, "--out", url]) == 0, f"the rerun after the kill at {name} failed"
        assert_same_store(download(store, work / f"after-{name}.zarr"), reference)
        assert not lock_exists(store), f"the rerun after {name} left its lock"

    for point in points:
        name = f"write-{point}-of-{len(writes)}"
        wipe(store)
        log = work / f"{name}.log"
        code = fork_run([*TINY_JOB, "--out", url], before=log_writes(log, die_at=point))
        assert code == -signal.SIGKILL, f"the kill at {name} did not land ({code})"
        logged = log.read_text().splitlines()
        assert len(logged) == point + 1, f"the kill at {name} landed at write {len(logged) - 1}"
        check_what_is_left(store, logged, work / f"left-{name}.zarr")
        rerun(name)
    for name, (before, overwrite) in TARGETED.items():
        if not overwrite:
            wipe(store)
        args = [*TINY_JOB, "--out", url, *(["--overwrite"] if overwrite else [])]
        assert fork_run(args, before=before) == -signal.SIGKILL, f"the kill at {name} did not land"
        if overwrite:
            assert "zarr.json" not in keys(store), "an interrupted overwrite left a store that opens"
        rerun(name)
    print(f"s3 kill storm: {len(points)} spread over {len(writes)} writes + {len(TARGETED)} targeted: all equal")


def race(prefix: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="s3-race-"))
    url = f"s3://{BUCKET}/{under(prefix, 'race.zarr')}"
    longer = [*TINY_JOB[:-6], "--data", "synthetic:400", "--chunk-size", "16", "--batch-size", "16"]
    jobs = {name: [*longer, "--out", url] for name in ("first", "second")}
    creating = lambda store, key, record, mode: mode == "create"  # noqa: E731 - the lock's conditional create
    results = started_together(jobs, object_lock, "_put", work, when=creating)
    winner, loser = the_one_that_ran(results)
    _, code, err = results[loser]
    assert code == 2, err
    line = one_line_error(err)
    assert "being written by another job" in line and f"pid {results[winner][0]}" in line, line
    assert not lock_exists(under(prefix, "race.zarr"))
    print(f"s3 race: {winner} ran; {loser}: {line}")


# A runs on while B runs (longer); they differ in their seed (SEEDED), so B's store is not A's. The lock
# goes stale after 1 s (FAST_LOCK), and each of a job's requests gives up after max(5 s, a third of that): 5 s.
WRITE_TIMEOUT = 5.0


def _until(reached, what: str, within: float = 120) -> None:
    """Poll ``reached()`` while this process's forked jobs make progress (``within``: a quiet machine's time)."""
    patience.until(reached, what, lambda: patience.children_of(os.getpid()), quiet=within)


def _lock(store: str) -> dict:
    try:
        return json.loads(_client().get_object(Bucket=BUCKET, Key=f"{store}.lock")["Body"].read())
    except Exception:  # noqa: BLE001 - no lock (yet, or any more)
        return {}


def _done(store: str) -> int:
    return sum(key.startswith("done/c/") for key in keys(store))


def paused(prefix: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="s3-paused-"))
    store = under(prefix, "paused.zarr")
    url = f"s3://{BUCKET}/{store}"
    a_err, b_err = work / "a.err", work / "b.err"
    with FaultProxy(os.environ["AWS_ENDPOINT_URL"]) as proxy:
        a = fork_start([*SEEDED, "--data", "synthetic:160", "--seed", "0", "--out", url],
                       set_environment(TINY_PACE="0.1", AWS_ENDPOINT_URL=proxy.endpoint, **FAST_LOCK), a_err)  # fmt: skip
        try:
            _until(lambda: _done(store) >= 3, "A's first chunks")
            proxy.hold(lambda method, path: method == "GET" and path.split("?")[0].endswith(f"/{store}/zarr.json"))
            assert proxy.held.wait(patience.ceiling(60)), "A read no root metadata"
            os.kill(a, signal.SIGSTOP)  # with the fence's read in flight
            paused_at = time.time()
            _until(lambda: time.time() - _lock(store).get("time", time.time()) > 1.1, "A's lock going stale")
            b = fork_start([*SEEDED, "--data", "synthetic:64", "--seed", "1", "--out", url, "--overwrite"],
                           set_environment(TINY_PACE="0.5", **FAST_LOCK), b_err)  # fmt: skip
            _until(lambda: _lock(store).get("pid") == b and _done(store) >= 2, "B's first chunks")
            time.sleep(max(0.0, paused_at + WRITE_TIMEOUT + 0.5 - time.time()))  # A's request has timed out
            os.kill(a, signal.SIGCONT)
            code = fork_wait(a, timeout=60)
            # B is slow (0.5 s a batch) to outlast A's report, but a loaded machine may delay A past its end
            reaped = os.waitpid(b, os.WNOHANG)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(a, signal.SIGCONT)
            proxy.release()
    err = a_err.read_text()
    assert code == 1, err[-3000:]
    line = one_line_error(err)
    assert f"lost the lock on --out {url}" in line and "marked nothing more" in line, line
    b_running = reaped == (0, 0)
    if b_running:  # A read B's lock to say whose the store is (once B is done, its lock is gone)
        assert f"to another job (host {socket.gethostname()}, pid {b})" in line, line
        assert _lock(store).get("pid") == b, "A must leave B's lock alone"
    b_code = fork_wait(b) if b_running else os.waitstatus_to_exitcode(reaped[1])
    assert b_code == 0, b_err.read_text()[-3000:]
    group = zarr.open_group(download(store, work / "b.zarr"), mode="r")
    assert group.attrs["status"] == "complete" and group["done"][:].all() and group["done"].shape == (16,)
    assert [run["status"] for run in group.attrs["runs"]] == ["complete"]
    assert not lock_exists(store)
    print(f"s3 paused holder: {line}")


if __name__ == "__main__":
    {"storm": storm, "race": race, "paused": paused}[sys.argv[1]](sys.argv[2])
