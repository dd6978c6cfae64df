"""Issue 20: a store on S3 read, and its lock held, through a flaky network: moto's S3 server behind
the fault-injecting proxy (``tests/helpers/faultproxy.py``), which resets connections or answers ``503 Slow
Down`` for a while. Short outages are retried by obstore (``location.py``'s retry configuration); a
long one ends, after ``EXTRACT_OBJECT_RETRY_TIMEOUT``, in an ``extract`` error of one line."""

from __future__ import annotations

import time

import numpy as np
import obstore
import pytest

from extract.errors import ExtractError
from extract.read.features import open_features
from extract.store.location import RETRY_TIMEOUT_VARIABLE, object_store
from extract.store.object_lock import ObjectStoreLock

LAYERS = ("a", "b")


@pytest.fixture
def stored(s3, tmp_path):
    """A small complete store (2 layers, 6 chunks each) written locally and uploaded to
    ``s3://BUCKET/PREFIX/out.zarr`` (straight to the server); its URL and the arrays it holds."""
    from helpers.stores import array_store

    rng = np.random.default_rng(0)
    layers = {"a": rng.normal(size=(24, 5)).astype("float32"), "b": rng.normal(size=(24, 2, 3)).astype("float32")}
    labels = rng.integers(0, 3, 24)
    local = array_store(tmp_path / "local.zarr", layers, labels, chunk_size=4)
    target = object_store(s3.url("out.zarr"))
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        obstore.put(target, file.relative_to(local).as_posix(), file.read_bytes())
    return s3.url("out.zarr"), layers, labels


@pytest.fixture
def proxied(s3, fault_proxy, monkeypatch):
    """This process's obstore clients (made from now on) reach the server through the proxy."""
    monkeypatch.setenv(RETRY_TIMEOUT_VARIABLE, "20")  # a hung test fails in seconds, not 2 minutes
    for variable, value in fault_proxy.env().items():
        monkeypatch.setenv(variable, value)
    return fault_proxy


def read_all(url):
    features = open_features(url)
    return {layer: features.load(layer) for layer in LAYERS}, features.labels


@pytest.mark.parametrize("mode", ["reset", "503"])
def test_reading_survives_a_few_failed_requests(stored, proxied, mode):
    url, layers, labels = stored
    proxied.fail(mode, requests=6)  # the first requests: the metadata reads of open_features
    loaded, got_labels = read_all(url)
    for layer in LAYERS:
        np.testing.assert_array_equal(loaded[layer], layers[layer])
    np.testing.assert_array_equal(got_labels, labels)
    assert proxied.counts.faults[mode] == 6 and not proxied.failing
    assert proxied.counts.requests["GET"] > 6  # the failed ones, retried, and the rest


def test_reading_survives_a_short_outage_of_chunk_reads(stored, proxied):
    """An outage in the middle of a whole-layer load (zarr's concurrent chunk GETs), resets then 503s.
    The outage is counted per chunk, not timed: a window of 0.4 s passed, on a loaded machine, before
    any chunk GET was sent (issue 29, item 14)."""
    url, layers, _ = stored
    features = open_features(url)
    is_chunk = lambda method, path: "/features/" in path and "/c/" in path  # noqa: E731
    gets = lambda: sum(n for (method, key), n in proxied.counts.keys.items() if is_chunk(method, key))  # noqa: E731
    for mode in ("reset", "503"):
        before = gets()
        proxied.fail(mode, per_key=2, match=is_chunk)  # each of the 6 chunks fails twice, then comes
        np.testing.assert_array_equal(features.load("b"), layers["b"])
        assert proxied.counts.faults[mode] == 12  # every chunk failed, and was retried past it
        assert gets() - before == 6 + 12
        proxied.pass_through()
    np.testing.assert_array_equal(features.load("a", index=np.array([23, 0, 9])), layers["a"][[23, 0, 9]])


@pytest.mark.parametrize("mode", ["reset", "503"])
@pytest.mark.parametrize("when", ["open", "load"])
def test_a_long_outage_is_one_extract_error_naming_the_object(stored, proxied, monkeypatch, mode, when):
    url, _, _ = stored
    monkeypatch.setenv(RETRY_TIMEOUT_VARIABLE, "1")
    features = open_features(url) if when == "load" else None
    proxied.fail(mode)  # until switched off
    started = time.monotonic()
    with pytest.raises(ExtractError) as error:
        open_features(url) if features is None else features.load("a")
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert "\n" not in message, message
    assert url in message or "out.zarr" in message, message
    assert ("503" in message or "SlowDown" in message) if mode == "503" else "reset" in message.lower(), message
    assert proxied.counts.faults[mode] > 2  # retried before giving up


def test_the_lock_is_taken_and_kept_through_a_short_outage_of_503s(s3, proxied, monkeypatch):
    monkeypatch.setenv("EXTRACT_LOCK_HEARTBEAT", "0.1")
    monkeypatch.setenv("EXTRACT_LOCK_STALE_AFTER", "5")
    url = s3.url("out.zarr")
    proxied.fail("503", requests=3)  # the claim's conditional create, retried
    with ObjectStoreLock(url) as lock:
        assert proxied.counts.faults["503"] == 3 and lock.held()
        beats = proxied.counts.classes["PUT", "lock"]
        proxied.fail("503", seconds=0.6, match=lambda method, path: method == "PUT")  # heartbeats fail meanwhile
        time.sleep(1.0)
        assert proxied.counts.faults["503"] > 3
        time.sleep(0.3)
        assert proxied.counts.classes["PUT", "lock"] > beats and not lock.lost.is_set() and lock.held()
    assert "out.zarr.lock" not in s3.keys()


def test_the_heartbeat_goes_on_after_connection_resets(s3, proxied, monkeypatch):
    """Conditional PUTs are not retried by obstore after a reset (they are not idempotent), so beats
    fail during the outage; the holder keeps beating and still holds the lock after it."""
    monkeypatch.setenv("EXTRACT_LOCK_HEARTBEAT", "0.1")
    monkeypatch.setenv("EXTRACT_LOCK_STALE_AFTER", "5")
    url = s3.url("out.zarr")
    with ObjectStoreLock(url) as lock:
        proxied.fail("reset", seconds=0.6)
        time.sleep(0.8)
        assert proxied.counts.faults["reset"] >= 2
        beats = proxied.counts.classes["PUT", "lock"]
        time.sleep(0.3)
        assert proxied.counts.classes["PUT", "lock"] > beats and not lock.lost.is_set() and lock.held()
    assert "out.zarr.lock" not in s3.keys()


def test_the_lock_is_taken_through_a_few_connection_resets(s3, proxied, monkeypatch):
    monkeypatch.setenv("EXTRACT_LOCK_HEARTBEAT", "0.1")
    monkeypatch.setenv("EXTRACT_LOCK_STALE_AFTER", "5")
    url = s3.url("out.zarr")
    proxied.fail("reset", requests=2)
    with ObjectStoreLock(url) as lock:
        assert proxied.counts.faults["reset"] == 2 and lock.held()
    assert "out.zarr.lock" not in s3.keys()


def test_the_proxy_counts_requests_and_bytes(s3, proxied):
    store = object_store(s3.url("x.zarr"))
    obstore.put(store, "a/c/0", b"x" * 300_000)
    assert bytes(obstore.get(store, "a/c/0").bytes()) == b"x" * 300_000
    obstore.put(store, "zarr.json", b"{}")
    counts = proxied.counts
    assert counts.requests == {"PUT": 2, "GET": 1}
    assert counts.classes["PUT", "chunk"] == 1 and counts.classes["PUT", "meta"] == 1
    assert counts.body_up["PUT", "chunk"] == 300_000 and counts.body_down["GET", "chunk"] == 300_000
    assert counts.up > 300_002 and counts.down > 300_000 and counts.connections >= 1
