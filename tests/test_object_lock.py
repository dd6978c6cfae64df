"""Issue 20, first part: a store argument that is a path or an object-storage URL, and the store's lock
on object storage made of conditional writes, against moto's S3 server on loopback (``tests/helpers/s3.py``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import obstore
import pytest
import zarr
from zarr.storage import LocalStore, ObjectStore

from extract.errors import ExtractError, StoreBusyError
from extract.store.location import INSTALL, LocationError, ObjectStorageMissing, is_url, open_store, parse
from extract.store.locking import lock_name
from extract.store.object_lock import ObjectStoreLock


@pytest.fixture(autouse=True)
def fast_lock(monkeypatch):
    monkeypatch.setenv("EXTRACT_LOCK_HEARTBEAT", "0.1")
    monkeypatch.setenv("EXTRACT_LOCK_STALE_AFTER", "5")


def lock_store(s3):
    """The obstore store of the test's prefix (where ``name.zarr.lock`` lives)."""
    from extract.store.location import object_store

    return object_store(s3.url())


def record(s3, name="out.zarr"):
    result = obstore.get(lock_store(s3), f"{name}.lock")
    return json.loads(bytes(result.bytes())), result.meta["e_tag"]


def plant(s3, name="out.zarr", **fields):
    """A lock record of another job, written directly."""
    fields = {"host": "elsewhere", "pid": 4242, "started": "2026-01-01T00:00:00", "token": "theirs", **fields}
    obstore.put(lock_store(s3), f"{name}.lock", json.dumps(fields).encode())


def test_our_own_create_that_landed_on_an_earlier_try_is_ours(s3):
    """A create retried after its first try landed fails its precondition on our own record."""
    lock = ObjectStoreLock(s3.url("out.zarr"))
    plant(s3, host=socket.gethostname(), pid=os.getpid(), token=lock.token, time=time.time())
    with lock:
        assert lock.held()
        time.sleep(0.3)
        assert not lock.lost.is_set() and record(s3)[0]["token"] == lock.token


def _race(locks):
    """Every lock's claim started at one instant; the locks that won and those refused."""
    barrier = threading.Barrier(len(locks))
    won, busy = [], []

    def take(lock):
        barrier.wait()
        try:
            lock.__enter__()
            won.append(lock)
        except StoreBusyError:
            busy.append(lock)

    threads = [threading.Thread(target=take, args=(lock,)) for lock in locks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return won, busy


def test_two_jobs_claiming_one_free_lock_one_wins(s3):
    won, busy = _race([ObjectStoreLock(s3.url("out.zarr")) for _ in range(3)])
    assert len(won) == 1 and len(busy) == 2 and record(s3)[0]["token"] == won[0].token
    won[0].__exit__(None, None, None)


def test_two_takers_of_one_stale_lock_one_wins(s3):
    for trial in range(4):
        name = f"out{trial}.zarr"
        plant(s3, name, time=time.time() - 3600)
        won, busy = _race([ObjectStoreLock(s3.url(name)) for _ in range(3)])
        assert len(won) == 1 and len(busy) == 2, (trial, len(won))
        assert record(s3, name)[0]["token"] == won[0].token
        won[0].__exit__(None, None, None)


HOLDER = """
import sys
from extract.store.object_lock import ObjectStoreLock
with ObjectStoreLock(sys.argv[1]) as lock:
    print("held", flush=True)
    print("lost" if lock.lost.wait(20) else "kept", flush=True)
"""


def test_a_paused_holder_comes_back_without_its_lock(s3, monkeypatch):
    """A real pause (SIGSTOP) past the stale age, as in test_reliability's paused holder on disk."""
    from helpers import ROOT

    monkeypatch.setenv("EXTRACT_LOCK_STALE_AFTER", "0.6")
    url = s3.url("out.zarr")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", HOLDER, url], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(StoreBusyError, match=f"pid {child.pid}"):
            ObjectStoreLock(url).__enter__()
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(1.0)
        with ObjectStoreLock(url) as lock:
            os.kill(child.pid, signal.SIGCONT)
            assert child.stdout.readline().strip() == "lost"
            assert child.wait(10) == 0
            assert record(s3)[0]["token"] == lock.token and lock.held() and not lock.lost.is_set()
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()


def test_lock_url_is_beside_the_store(s3):
    url = s3.url("deep/er/out.zarr")
    assert lock_name(url) == url + ".lock" and parse(url).lock == url + ".lock"
    with ObjectStoreLock(url):
        assert "deep/er/out.zarr.lock" in s3.keys()
    with pytest.raises(ExtractError, match="local path"):
        ObjectStoreLock("some/local.zarr")


@pytest.mark.parametrize(
    "text, url, bucket, key",
    [
        ("s3://bucket/prefix/name.zarr", "s3://bucket/prefix/name.zarr", "bucket", "prefix/name.zarr"),
        ("s3://bucket/name.zarr/", "s3://bucket/name.zarr", "bucket", "name.zarr"),
        ("gs://bucket/a/b.zarr", "gs://bucket/a/b.zarr", "bucket", "a/b.zarr"),
        ("az://container/b.zarr", "az://container/b.zarr", "container", "b.zarr"),
        ("abfs://c@acct.dfs.core.windows.net/x/b.zarr", "abfs://c@acct.dfs.core.windows.net/x/b.zarr",
         "c@acct.dfs.core.windows.net", "x/b.zarr"),
    ],
)  # fmt: skip
def test_store_urls_are_parsed(text, url, bucket, key):
    location = parse(text)
    assert is_url(text) and location.remote and location.path is None
    assert (location.url, location.bucket, location.key) == (url, bucket, key)
    assert location.lock == url + ".lock" and str(location) == url


@pytest.mark.parametrize("text", ["out.zarr", "/tmp/x/out.zarr", "C:\\data\\out.zarr", "a:b/out.zarr", "./s3/x.zarr"])
def test_paths_are_paths(text, tmp_path):
    location = parse(text)
    assert not is_url(text) and not location.remote and str(location.path) == str(parse(text).path)
    assert location.lock == str(location.path) + ".lock"
    assert isinstance(open_store(tmp_path / "x.zarr"), LocalStore)


@pytest.mark.parametrize(
    "text, message",
    [
        ("ftp://host/x.zarr", "unsupported scheme ftp://"),
        ("s3:///x.zarr", "names no bucket"),
        ("s3://bucket", "is a whole bucket"),
        ("s3://bucket/", "is a whole bucket"),
        ("s3://bucket/a//b.zarr", "empty, '.' or '..' part"),
        ("s3://bucket/a/../b.zarr", "empty, '.' or '..' part"),
        ("s3://bucket/b.zarr?versionId=3", "no ?query"),
    ],
)
def test_bad_store_urls_are_one_line(text, message):
    with pytest.raises(LocationError, match=message.replace("?", r"\?").replace(".", r"\.")) as error:
        parse(text)
    assert "\n" not in str(error.value) and isinstance(error.value, ExtractError)


def test_gcs_and_azure_stores_are_made_from_the_url(monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    assert isinstance(open_store("gs://bucket/x.zarr"), ObjectStore)
    assert isinstance(open_store("abfs://c@acct.dfs.core.windows.net/x/b.zarr"), ObjectStore)
    with pytest.raises(LocationError, match="set AZURE_STORAGE_ACCOUNT_NAME") as error:
        open_store("az://container/x.zarr")
    assert "\n" not in str(error.value)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    assert isinstance(open_store("az://container/x.zarr"), ObjectStore)


def test_missing_obstore_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)
    monkeypatch.setitem(sys.modules, "obstore.store", None)
    with pytest.raises(ObjectStorageMissing) as error:
        open_store("s3://bucket/out.zarr")
    assert INSTALL in str(error.value) and "\n" not in str(error.value) and isinstance(error.value, ExtractError)


def test_zarr_reads_and_writes_through_the_url_without_allow_http(s3, monkeypatch):
    """An ``http://`` endpoint is allowed by itself; ``AWS_DEFAULT_REGION`` stands in for ``AWS_REGION``."""
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = open_store(s3.url("z.zarr"))
    assert isinstance(store, ObjectStore)
    group = zarr.open_group(store, mode="w")
    group.create_array("a", shape=(6,), chunks=(2,), dtype="int32")[:] = np.arange(6)
    assert "z.zarr/a/c/2" in s3.keys()
    again = zarr.open_group(open_store(s3.url("z.zarr"), read_only=True), mode="r")
    np.testing.assert_array_equal(again["a"][:], np.arange(6))


def upload(local, s3, name):
    """Copy a locally written store's files to ``s3://BUCKET/PREFIX/name``, one object each."""
    from extract.store.location import object_store

    target = object_store(s3.url(name))
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        obstore.put(target, file.relative_to(local).as_posix(), file.read_bytes())


def test_open_features_reads_a_store_on_s3(s3, tmp_path):
    from helpers.stores import add_keys, array_store

    from extract.read.features import open_features
    from extract.store.store import FeatureStore

    rng = np.random.default_rng(0)
    layers = {"a": rng.normal(size=(10, 3)).astype("float32"), "b.c": rng.normal(size=(10, 2, 2)).astype("float32")}
    labels = rng.integers(0, 3, 10)
    local = array_store(tmp_path / "local.zarr", layers, labels, chunk_size=4)
    add_keys(local, [f"k{i}" for i in range(10)], classes=["x", "y", "z"])
    upload(local, s3, "out.zarr")
    here, there = open_features(local), open_features(s3.url("out.zarr"))
    assert there.path == s3.url("out.zarr") and s3.url("out.zarr") in repr(there)
    assert there.layers == here.layers and there.complete and there.classes == ["x", "y", "z"]
    for layer in layers:
        np.testing.assert_array_equal(there.load(layer), layers[layer])
        np.testing.assert_array_equal(there.load(layer, index=np.array([7, 1, 4])), layers[layer][[7, 1, 4]])
    np.testing.assert_array_equal(there.labels, labels)
    np.testing.assert_array_equal(there.keys, here.keys)
    from extract.read.dataset import FeatureDataset

    dataset = FeatureDataset(s3.url("out.zarr"), "a")
    value, label = dataset[5]
    np.testing.assert_array_equal(value.numpy(), layers["a"][5])
    assert label == labels[5] and dataset.path == s3.url("out.zarr")
    assert FeatureStore.open(s3.url("out.zarr")).done_flags().all()  # writable too, since issue 20's jobs


def test_a_url_with_no_store_is_not_found(s3):
    from extract.errors import StoreNotFoundError
    from extract.read.features import open_features

    with pytest.raises(StoreNotFoundError, match="is not an extract store"):
        open_features(s3.url("absent.zarr"))
    obstore.put(open_store(s3.url("other.zarr")).store, "zarr.json", b'{"zarr_format": 3, "node_type": "group"}')
    with pytest.raises(ExtractError, match="is not an extract store") as error:
        open_features(s3.url("other.zarr"))
    assert not isinstance(error.value, StoreNotFoundError)


def test_a_reader_of_a_store_being_created_on_s3_is_told_so_naming_the_job(s3, monkeypatch):
    """On object storage a store is valid once its root metadata are written, last: while its job holds
    the lock, a prefix without them (empty, or the skeleton so far) is a creation, and a reader is told
    so, naming the job; once the lock is released (or stale) it is no store, as before."""
    from extract.errors import StoreBeingCreatedError, StoreNotFoundError
    from extract.read.dataset import FeatureDataset
    from extract.read.features import open_features

    url = s3.url("new.zarr")
    with ObjectStoreLock(url):
        for skeleton in (False, True):
            if skeleton:  # the first object a creation writes; the root metadata come last
                obstore.put(open_store(url).store, "features/zarr.json", b'{"zarr_format": 3, "node_type": "group"}')
            with pytest.raises(StoreBeingCreatedError) as error:
                open_features(url)
            message = str(error.value)
            assert f"{url} is being created by a job (host {socket.gethostname()}, pid {os.getpid()}" in message
            assert f"{url}.lock" in message and "wait for the job" in message and "\n" not in message
            assert isinstance(error.value, StoreNotFoundError) and isinstance(error.value, StoreBusyError)
        with pytest.raises(StoreBeingCreatedError):
            FeatureDataset(url, "layer")
    with pytest.raises(ExtractError, match="is not an extract store") as error:  # released: debris, no job
        open_features(url)
    assert not isinstance(error.value, StoreBeingCreatedError)
    plant(s3, "new.zarr", time=time.time() - 3600)  # a holder whose heartbeat stopped long ago
    with pytest.raises(ExtractError, match="is not an extract store") as error:
        open_features(url)
    assert not isinstance(error.value, StoreBeingCreatedError)


def test_retry_settings(monkeypatch):
    from extract.store.location import RETRY_TIMEOUT_VARIABLE, retry_config

    monkeypatch.setenv(RETRY_TIMEOUT_VARIABLE, "7")
    config = retry_config()
    assert config["retry_timeout"].total_seconds() == 7 and config["max_retries"] >= 1
    assert config["backoff"]["max_backoff"].total_seconds() <= 15
    monkeypatch.setenv(RETRY_TIMEOUT_VARIABLE, "soon")
    with pytest.raises(ExtractError, match="EXTRACT_OBJECT_RETRY_TIMEOUT='soon' is not a positive number"):
        retry_config()
