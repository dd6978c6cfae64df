"""Issue 45, reads from the first chunk: ``TokenStream(..., follow=True)`` follows a store that a live job
is writing. A real job (the paced conv net, in a subprocess) is followed from its first chunks, killed
after a few, and resumed; the stream's first pass yields every (image, patch) row exactly once, byte for
byte the complete store's as zarr reads it, its first batch before the job had finished, and ends when the
store is complete; a second pass is an ordinary shuffled epoch over the complete store. On disk and on
object storage (moto's S3)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import ROOT, TINY
from helpers.launches import environment

from extract import TokenStream
from extract.store.store import FeatureStore

IMAGES, CHUNK, SIDE = 48, 4, 7  # 12 chunks; a 16 px image through a 3x3 stride-2 conv: 7 x 7 patches of 8
JOB = ["--model", f"{TINY}:paced_net", "--layers", "conv", "--pool", "none", "--image-size", "16",
       "--num-workers", "0", "--dtype", "float32", "--data", f"synthetic:{IMAGES}", "--chunk-size", str(CHUNK),
       "--batch-size", str(CHUNK)]  # fmt: skip
PATIENCE = 600  # seconds for the job's start on a busy machine; the job itself takes a few


def _start(out, pace: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "extract", *JOB, "--out", str(out)], cwd=ROOT,
        env={**environment(), "TINY_PACE": str(pace)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def _wait(condition, job: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert job is None or job.poll() is None, job.stderr.read()[-3000:] if job else ""
        assert time.monotonic() < deadline, "waited too long"
        time.sleep(0.05)


def _done(out) -> int:
    """The chunks marked done: the objects of ``done`` (one listing, on disk or object storage)."""
    store = FeatureStore.open(out, mode="r")
    return len(store.integrity.stored_chunks("done", range(store.plan.num_chunks)))


def _status(out) -> str | None:
    try:
        return FeatureStore.open(out, mode="r").attrs.get("status")
    except Exception:  # noqa: BLE001 - not there yet
        return None


@pytest.mark.parametrize("where", ["disk", "s3"])
def test_a_stream_follows_a_job_from_its_first_chunk_through_a_kill_and_its_resume(tmp_path, request, where):
    # on S3 the ``s3`` fixture points this process's environment, which the jobs inherit, at moto's server
    out = tmp_path / "live.zarr" if where == "disk" else request.getfixturevalue("s3").url("live.zarr")
    first = _start(out, pace=0.5)
    _wait(lambda: _status(out) == "running", first)
    events: dict[str, object] = {}

    def kill_then_resume() -> None:
        _wait(lambda: _done(out) >= 3, first)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        events["done at the kill"] = _done(out)
        time.sleep(1.0)  # the stream waits on a dead job: nothing new is done
        events["done after a second"] = _done(out)
        resumed = _start(out, pace=0.05)
        resumed.wait(timeout=PATIENCE)
        events["resumed"] = resumed.returncode, resumed.stderr.read()[-3000:]

    killer = threading.Thread(target=kill_then_resume)
    killer.start()
    stream = TokenStream(out, "conv", 50, window=2, follow=True, poll=0.1, return_index=True, dtype="float32")
    values, rows = [], []
    try:
        for batch, index in stream:
            if not values:
                events["status at the first batch"] = _status(out)
            values.append(batch.numpy())
            rows.append(index.numpy())
    finally:
        killer.join()
    assert events["resumed"][0] == 0, events["resumed"][1]
    assert events["status at the first batch"] == "running"  # read while the job wrote
    assert 3 <= events["done at the kill"] == events["done after a second"] < IMAGES // CHUNK  # a real kill
    assert _status(out) == "complete"

    stored = FeatureStore.open(out, mode="r").group["features/conv"][:]  # (N, C, H, W): zarr's own read
    assert stored.shape == (IMAGES, 8, SIDE, SIDE)
    per_patch = stored.reshape(IMAGES, 8, SIDE * SIDE).transpose(0, 2, 1)  # (image, patch, C)
    values, rows = np.concatenate(values), np.concatenate(rows)
    flat = rows[:, 0] * SIDE * SIDE + rows[:, 1]
    assert np.array_equal(np.sort(flat), np.arange(IMAGES * SIDE * SIDE))  # every row exactly once
    np.testing.assert_array_equal(values, per_patch[rows[:, 0], rows[:, 1]])

    # Features.follow over the same (now complete) store: every chunk once, in its bounds
    from extract import open_features

    followed = list(open_features(out, allow_partial=True).follow(poll=0.1))
    assert sorted(followed) == [(k, k * CHUNK, (k + 1) * CHUNK) for k in range(IMAGES // CHUNK)]

    again = [index.numpy() for _, index in stream]  # the next pass: a shuffled epoch of the complete store
    again = np.concatenate(again)
    assert np.array_equal(np.sort(again[:, 0] * SIDE * SIDE + again[:, 1]), np.arange(IMAGES * SIDE * SIDE))


def test_features_follow_a_live_job_chunk_by_chunk(tmp_path):
    """``Features.follow`` yields each chunk once as the job marks it done; its rows read then (checked) are
    the complete store's."""
    from extract import open_features

    out = tmp_path / "live.zarr"
    job = _start(out, pace=0.3)
    _wait(lambda: _status(out) == "running", job)
    features = open_features(out, allow_partial=True)
    chunks, rows, statuses = [], {}, []
    for chunk, start, stop in features.follow(poll=0.05):
        statuses.append(_status(out))
        chunks.append(chunk)
        rows[chunk] = features.load("conv", slice(start, stop), dtype=None)
    assert job.wait(timeout=PATIENCE) == 0, job.stderr.read()[-3000:]
    assert sorted(chunks) == list(range(IMAGES // CHUNK)) and statuses[0] == "running"
    stored = FeatureStore.open(out, mode="r").group["features/conv"][:]
    for chunk, values in rows.items():
        np.testing.assert_array_equal(values, stored[chunk * CHUNK : (chunk + 1) * CHUNK])
