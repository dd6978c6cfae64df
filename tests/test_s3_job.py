"""Issue 20: jobs whose --out is a store on S3 (moto's server on loopback, ``tests/helpers/s3.py``).

The runs here are in this process (the ``cli`` fixture). Runs that must be killed or raced are forked
by ``tests/helpers/s3_forked.py`` in a process of its own: obstore does not survive a fork of a process that
has made requests, and this one has. The job on S3 by two processes is in ``test_tokens.py``, where it
shares a launch with the other multi-process token jobs."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr
from helpers import HELPERS, ROOT, patience
from helpers.cli import TINY_JOB, one_line_error

from extract import open_features
from extract.store.location import open_store
from extract.store.lock import process_namespace


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory):
    from extract.cli.extract import main

    out = tmp_path_factory.mktemp("disk") / "disk.zarr"
    assert main([*map(str, TINY_JOB), "--out", str(out)]) == 0
    return out


@pytest.fixture(params=["prefix", "bucket-top"])
def where(request):
    """Where the test's stores go: under a prefix of the bucket (``s3://BUCKET/PREFIX/NAME.zarr``), or at
    the top of a bucket (``s3://BUCKET/NAME.zarr``), where the lock is a key at the bucket's top too."""
    return request.getfixturevalue("s3" if request.param == "prefix" else "s3_top")


def _arrays(group: zarr.Group) -> list[str]:
    return sorted(name for name, member in group.members(max_depth=None) if isinstance(member, zarr.Array))


def test_a_job_on_s3_equals_the_same_job_on_disk_and_a_rerun_finds_it_complete(where, on_disk, cli):
    s3 = where
    url = s3.url("job.zarr")
    code, _, err = cli(*TINY_JOB, "--out", url)
    assert code == 0, err
    local, remote = zarr.open_group(on_disk, mode="r"), zarr.open_group(open_store(url, read_only=True), mode="r")
    assert _arrays(remote) == _arrays(local) and {"features/heads.conv", "labels", "valid", "keys"} <= set(
        _arrays(local)
    )
    for name in _arrays(local):
        np.testing.assert_array_equal(remote[name][:], local[name][:], err_msg=name)
    assert remote.attrs["status"] == "complete" and remote.attrs["fingerprint"] == local.attrs["fingerprint"]
    files = sorted(str(p.relative_to(on_disk)) for p in on_disk.rglob("*") if p.is_file())
    assert s3.keys() == ["job.zarr/" + f for f in files]  # the same objects, and no lock left beside them
    code, _, err = cli(*TINY_JOB, "--out", url)
    assert code == 0 and "is already complete for this job" in err, err
    f = open_features(url)
    np.testing.assert_array_equal(f.load("heads.conv"), open_features(on_disk).load("heads.conv"))


def test_a_resume_on_s3_redoes_only_the_chunks_not_done(where, on_disk, cli):
    s3 = where
    url = s3.url("resumed.zarr")
    assert cli(*TINY_JOB, "--out", url)[0] == 0
    from extract.store.store import FeatureStore

    FeatureStore.open(url).integrity.clear_done([2, 7])
    s3.server.client().delete_object(Bucket=s3.server.bucket, Key=s3.key("resumed.zarr/labels/c/7"))
    code, _, err = cli(*TINY_JOB, "--out", url)
    assert code == 0 and "2 chunks written, 10 reused" in err, err
    remote = zarr.open_group(open_store(url, read_only=True), mode="r")
    for name in ("features/heads.conv", "labels", "valid", "keys", "done"):
        np.testing.assert_array_equal(remote[name][:], zarr.open_group(on_disk, mode="r")[name][:], err_msg=name)


def test_overwrite_on_s3_replaces_another_job_and_a_foreign_prefix_is_never_touched(s3, cli):
    url = s3.url("over.zarr")
    assert cli(*TINY_JOB, "--out", url)[0] == 0
    other = [*TINY_JOB[:-6], "--data", "synthetic:40", "--chunk-size", "8", "--batch-size", "8"]
    code, _, err = cli(*other, "--out", url)
    assert code == 2 and "holds a different job" in one_line_error(err) and "--overwrite" in err
    code, _, err = cli(*other, "--out", url, "--overwrite")
    assert code == 0, err
    replaced = open_features(url)
    assert len(replaced) == 40 and replaced.store.done_flags().all() and len(replaced.store.done_flags()) == 5
    assert not any(k.startswith("over.zarr/done/c/5") for k in s3.keys())  # none of the old store's chunks left

    client, bucket = s3.server.client(), s3.server.bucket
    client.put_object(Bucket=bucket, Key=f"{s3.prefix}/theirs.zarr/table.csv", Body=b"a,b\n1,2\n")
    for extra in ([], ["--overwrite"]):
        code, _, err = cli(*TINY_JOB, "--out", s3.url("theirs.zarr"), *extra)
        assert code == 2 and "not an extract store" in one_line_error(err) and "never overwritten" in err, err
    assert [k for k in s3.keys() if k.startswith("theirs.zarr")] == ["theirs.zarr/table.csv"]


def test_damaged_root_metadata_on_s3_are_refused_and_overwrite_replaces_them(s3, cli):
    url = s3.url("torn.zarr")
    assert cli(*TINY_JOB, "--out", url)[0] == 0
    s3.server.client().put_object(Bucket=s3.server.bucket, Key=f"{s3.prefix}/torn.zarr/zarr.json", Body=b'{"zarr_fo')
    code, _, err = cli(*TINY_JOB, "--out", url)
    assert code == 2 and "damaged" in one_line_error(err) and "--overwrite" in err, err
    code, _, err = cli(*TINY_JOB, "--out", url, "--overwrite")
    assert code == 0, err
    assert open_features(url).store.done_flags().all()


def _lock_record(host: str, pid: int, age: float) -> bytes:
    namespace = process_namespace()  # what proves a pid of this host to be one of ours
    record = {"host": host, "pid": pid, **namespace, "started": "2026-01-01T00:00:00", "token": "stale",
              "time": time.time() - age}  # fmt: skip
    return json.dumps(record).encode()


def test_a_stale_lock_object_is_taken_over_and_a_fresh_one_refuses(where, cli, monkeypatch):
    s3 = where
    url, client, bucket = s3.url("stale.zarr"), s3.server.client(), s3.server.bucket
    lock = s3.key("stale.zarr.lock")
    client.put_object(Bucket=bucket, Key=lock, Body=_lock_record("elsewhere", 1, age=0))
    code, _, err = cli(*TINY_JOB, "--out", url)
    assert code == 2 and "being written by another job (host elsewhere, pid 1" in one_line_error(err), err
    monkeypatch.setenv("EXTRACT_LOCK_STALE_AFTER", "30")
    client.put_object(Bucket=bucket, Key=lock, Body=_lock_record("elsewhere", 1, age=60))  # its heartbeat stopped
    assert cli(*TINY_JOB, "--out", url)[0] == 0
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    client.put_object(Bucket=bucket, Key=lock, Body=_lock_record(socket.gethostname(), int(dead.stdout), age=0))
    code, _, err = cli(*TINY_JOB, "--out", url, "--overwrite")  # a holder of this host that is gone: stale at once
    assert code == 0, err
    assert lock not in [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]


def _forked(s3, what: str, timeout: float = 300) -> str:
    """``tests/helpers/s3_forked.py WHAT PREFIX`` (an empty PREFIX: the bucket's top); ``timeout`` is what it
    takes on a quiet machine, and it runs on while it makes progress (``helpers.patience``)."""
    env = {**os.environ, **s3.server.env(), "S3_BUCKET": s3.server.bucket, "PYTHONPATH": str(ROOT)}
    done = patience.run(
        [sys.executable, str(HELPERS / "s3_forked.py"), what, s3.prefix],
        env=env, cwd=ROOT, capture_output=True, text=True, quiet=timeout,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_kill_storm_on_s3(s3):
    """SIGKILL at 10 points spread over every object a run writes to S3 (creation, chunks, the final
    marking) and at 6 chosen ones (the lock's create, the skeleton without its root metadata, mid-chunk,
    the final marking, an overwrite once it deleted the root metadata): the store holds nothing marked
    done that was not written, and one rerun gives the job's store on disk (``tests/helpers/s3_forked.py``)."""
    assert "all equal" in _forked(s3, "storm")


def test_two_jobs_started_together_on_one_s3_path_one_runs(where):
    assert "ran;" in _forked(where, "race")


def test_a_holder_paused_past_the_stale_age_on_s3_says_it_lost_the_lock(s3):
    """A job paused (SIGSTOP) with a request in flight past the lock's stale age and its write timeout,
    while another job took the store over: continued, it says it lost the lock to that job (exit 1),
    as on disk, not that its request timed out (``tests/helpers/s3_forked.py paused``)."""
    assert "lost the lock" in _forked(s3, "paused")


def test_a_job_retries_through_a_short_outage_and_stops_cleanly_after_a_long_one(
    s3, fault_proxy, on_disk, cli, monkeypatch
):
    """Through the fault proxy: 503s and resets on chunk PUTs for a while are retried, and the store
    equals the job on disk; an outage past EXTRACT_OBJECT_RETRY_TIMEOUT stops the job with one line
    naming the object (exit 1), nothing is marked done that was not written, and a rerun completes."""
    for variable, value in fault_proxy.env().items():
        monkeypatch.setenv(variable, value)
    chunk_puts = lambda method, path: method == "PUT" and "/c/" in path  # noqa: E731
    url = s3.url("flaky.zarr")
    fault_proxy.fail("503", requests=6, match=chunk_puts)
    code, _, err = cli(*TINY_JOB, "--out", url)
    assert code == 0 and fault_proxy.counts.faults["503"] == 6, err
    fault_proxy.fail("reset", requests=3, match=chunk_puts)
    code, _, err = cli(*TINY_JOB, "--out", url, "--overwrite")
    assert code == 0 and fault_proxy.counts.faults["reset"] >= 1, err
    local = zarr.open_group(on_disk, mode="r")
    for name in ("features/heads.conv", "labels", "valid", "keys", "done"):
        np.testing.assert_array_equal(
            zarr.open_group(open_store(url, read_only=True), mode="r")[name][:], local[name][:]
        )

    monkeypatch.setenv("EXTRACT_OBJECT_RETRY_TIMEOUT", "1")
    url = s3.url("outage.zarr")
    fault_proxy.fail("503", match=lambda method, path: method == "PUT" and "/heads.conv/c/6/" in path)  # until passed
    code, _, err = cli(*TINY_JOB, "--out", url)
    line = one_line_error(err)
    assert code == 1 and "object storage" in line and "heads.conv/c/6/" in line and "rerun redoes" in line, err
    fault_proxy.pass_through()
    stored = zarr.open_group(open_store(url, read_only=True), mode="r")
    done = np.flatnonzero(stored["done"][:])
    assert 6 not in done and len(done) >= 1
    features, expected = stored["features/heads.conv"][:], local["features/heads.conv"][:]
    for chunk in done:  # a chunk marked done holds its features
        np.testing.assert_array_equal(features[chunk * 4 : chunk * 4 + 4], expected[chunk * 4 : chunk * 4 + 4])
    code, _, err = cli(*TINY_JOB, "--out", url)
    assert code == 0, err
    np.testing.assert_array_equal(open_features(url).load("heads.conv"), expected)
