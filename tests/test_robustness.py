"""Bad input, preemption and faults: exit status, message, and the store afterwards."""

import json
import os
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
import torch
import zarr
from helpers import ROOT, TINY, patience, tiny_models
from helpers.cli import SMALL, chunks, one_line_error
from helpers.data_files import make_png_tree
from helpers.forked import fork_run, fork_start, fork_wait
from helpers.launches import launcher, rank_pids
from helpers.reference import load_images, reference, resnet18, synthetic_images

from extract import open_features
from extract.store.lock import lock_path, process_namespace
from extract.store.store import FeatureStore


def test_out_is_a_regular_file(cli, tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("precious")
    code, _, err = cli(*SMALL, "--data", "synthetic:2", "--out", out, "--overwrite")
    assert code == 2 and "regular file" in one_line_error(err)
    assert out.read_text() == "precious"


def test_out_is_a_foreign_directory(cli, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    code, _, err = cli(*SMALL, "--data", "synthetic:2", "--out", out, "--overwrite")
    assert code == 2 and "not an extract store" in one_line_error(err)
    assert os.listdir(out) == ["thesis.tex"]


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_out_cannot_be_written(cli, tmp_path, where):
    if where == "under-a-file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "f.zarr"
    else:
        out = "/proc/extract-test.zarr"
    code, _, err = cli(*SMALL, "--data", "synthetic:2", "--out", out)
    assert code == 2 and "--out" in one_line_error(err)


def test_empty_datasets(cli, tmp_path):
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    code, _, err = cli(*SMALL, "--data", f"imagefolder:{empty_dir}", "--out", tmp_path / "a.zarr")
    assert code == 2 and "imagefolder" in one_line_error(err)
    empty_list = tmp_path / "list.txt"
    empty_list.write_text("\n")
    code, _, err = cli(*SMALL, "--data", f"filelist:{empty_list}", "--out", tmp_path / "b.zarr")
    assert code == 2 and "is empty" in one_line_error(err)
    assert not (tmp_path / "a.zarr").exists() and not (tmp_path / "b.zarr").exists()


@pytest.fixture
def broken_tree(tmp_path):
    root = tmp_path / "images"
    files = make_png_tree(root, {"a": 6, "b": 6})
    good = (root / "a" / "000.png").read_bytes()
    (root / "a" / "003.png").write_bytes(good[: len(good) // 2])  # truncated
    (root / "b" / "001.png").write_text("not an image at all")
    (root / "b" / "004.png").write_bytes(b"")  # zero bytes
    bad = {root / "a" / "003.png", root / "b" / "001.png", root / "b" / "004.png"}
    return root, files, bad


def test_bad_image_stops_the_run_naming_the_file(cli, tmp_path, broken_tree):
    root, files, bad = broken_tree
    out = tmp_path / "stop.zarr"
    code, _, err = cli(*SMALL, "--data", f"imagefolder:{root}", "--out", out, "--chunk-size", "2", "--batch-size", "2")
    line = one_line_error(err)
    assert code == 2 and "cannot decode image" in line and str(root / "a" / "003.png") in line
    assert "--skip-bad-images" in line
    group = zarr.open_group(out, mode="r")
    assert group["done"][:].tolist() == [True, False, False, False, False, False]  # the chunk before it is kept
    assert group.attrs["status"] == "running"


def test_skip_bad_images_records_them_invalid(cli, tmp_path, broken_tree):
    root, files, bad = broken_tree
    out = tmp_path / "skip.zarr"
    code, _, err = cli(
        *SMALL, "--data", f"imagefolder:{root}", "--out", out, "--chunk-size", "4", "--batch-size", "3",
        "--skip-bad-images",
    )  # fmt: skip
    assert code == 0, err
    assert "3 bad images skipped" in err
    group = zarr.open_group(out, mode="r")
    valid = group["valid"][:]
    assert [f for (f, _), ok in zip(files, valid, strict=True) if not ok] == sorted(bad)
    features = group["features/layer3"][:]
    assert np.isnan(features[~valid]).all()
    good = [f for f, _ in files if f not in bad]
    expected = reference(resnet18(), load_images(good, 32), {"layer3": ("layer3", None)}, pool="avg")["layer3"]
    assert np.abs(features[valid] - expected).max() <= 1e-5
    assert group.attrs["summary"]["invalid_samples"] == 3


def test_each_way_the_bad_image_message_offers_works(cli, tmp_path):
    """The message offers two ways on: --skip-bad-images resumes and records the image invalid; removing
    the image changes the data, so that rerun needs --overwrite (without it the store is refused)."""
    root = tmp_path / "images"
    files = make_png_tree(root, {"a": 6, "b": 6})
    broken = root / "b" / "002.png"
    broken.write_bytes(b"not an image")
    args = [*SMALL, "--data", f"imagefolder:{root}", "--chunk-size", "2", "--batch-size", "2"]
    first = tmp_path / "first.zarr"
    code, _, err = cli(*args, "--out", first)
    line = one_line_error(err)
    assert code == 2 and "rerun with --skip-bad-images to resume" in line and "rerun with --overwrite" in line
    assert "(4 chunks written)" in line
    copy = tmp_path / "copy.zarr"
    shutil.copytree(first, copy)

    code, _, err = cli(*args, "--out", first, "--skip-bad-images")
    assert code == 0 and "resuming" in err and "4 of 6 chunks already done" in err, err
    valid = zarr.open_group(first, mode="r")["valid"][:]
    assert [f for (f, _), ok in zip(files, valid, strict=True) if not ok] == [broken]

    broken.unlink()
    code, _, err = cli(*args, "--out", copy)
    assert code == 2 and "holds a different job" in one_line_error(err)
    code, _, err = cli(*args, "--out", copy, "--overwrite")
    assert code == 0, err
    group = zarr.open_group(copy, mode="r")
    assert group.attrs["status"] == "complete" and group["valid"][:].all() and group["valid"].shape == (11,)


def test_a_value_float16_would_make_inf_stops_the_job_in_one_line_and_bfloat16_starts_over(cli, tmp_path):
    """Issue 31: massive_net's channel 5 passes 65504 on some images. The batch whose cast would store inf
    stops the job (exit 2, one line: the layer, its largest |x|, the fix); the chunks before it are written
    and intact; the store resumes only as float16, and --dtype bfloat16 --overwrite starts it over."""
    out = tmp_path / "massive.zarr"
    job = ["--model", f"{TINY}:massive_net", "--layers", "conv", "--pool", "avg", "--data", "synthetic:12",
           "--image-size", "32", "--num-workers", "0", "--chunk-size", "1", "--batch-size", "1", "--out", out]  # fmt: skip
    model = tiny_models.massive_net().eval()
    expected = reference(model, synthetic_images(12), {"conv": ("conv", None)}, "avg")["conv"]
    with np.errstate(over="ignore"):
        first = int(np.flatnonzero(np.isinf(expected.astype(np.float16)).any(axis=1))[0])
    assert 0 < first < 11  # written chunks before it, and data after it
    code, _, err = cli(*job)
    line = one_line_error(err)
    assert code == 2 and "layer 'conv'" in line and f"|x| = {np.abs(expected[first]).max():.4g}" in line, line
    assert "--dtype bfloat16" in line and "--dtype float32" in line and "--overwrite" in line
    group = zarr.open_group(out, mode="r")
    assert group["done"][:].tolist() == [k < first for k in range(12)] and group.attrs["status"] == "running"
    stored = group["features/conv"][:]
    assert not np.isinf(stored).any() and np.isnan(stored[first:]).all()
    np.testing.assert_array_equal(stored[:first], expected[:first].astype(np.float16))
    assert not lock_path(out).exists() and sorted(p.name for p in tmp_path.iterdir()) == ["massive.zarr"]
    code, _, err = cli(*job)  # the same job resumes, and stops at the same batch
    assert code == 2 and one_line_error(err) == line and "resuming" in err
    code, _, err = cli(*job, "--dtype", "bfloat16")
    assert code == 2 and "holds a different job" in one_line_error(err)
    code, _, err = cli(*job, "--dtype", "bfloat16", "--overwrite")
    assert code == 0, err
    f = open_features(out)
    assert f.storage_dtypes == {"conv": "bfloat16"}
    stored = f.load("conv", dtype=None, as_torch=True)
    assert torch.equal(stored.view(torch.int16), torch.from_numpy(expected).to(torch.bfloat16).view(torch.int16))


def _disk_full_at_chunk_3():
    """For ``before``: the write of chunk 3 stores part of it, then the disk is full."""
    real_write = FeatureStore.write_chunk

    def failing_write(self, chunk, *rest):
        if chunk == 3:
            self.array("features/layer3")[9:10] = np.zeros((1, 256), dtype=np.float32)  # a partial write...
            raise OSError(28, "No space left on device")  # ...then the disk is full
        return real_write(self, chunk, *rest)

    FeatureStore.write_chunk = failing_write


def test_write_error_stops_the_run_and_a_rerun_completes(cli, tmp_path):
    args = [*SMALL, "--data", "synthetic:24", "--chunk-size", "3", "--batch-size", "2", "--out", tmp_path / "w.zarr"]
    # in a child of its own: fork_wait fails the test if the run does not stop by itself (a writer that
    # dies must not leave the forward loop waiting for it)
    assert fork_run(args, before=_disk_full_at_chunk_3, stderr=tmp_path / "err") == 1
    err = (tmp_path / "err").read_text()
    assert "No space left on device" in one_line_error(err) and "rerun" in err
    done = zarr.open_group(tmp_path / "w.zarr", mode="r")["done"][:]
    assert not done[3], "a chunk that was not fully written must not be marked done"
    code, _, err = cli(*args)
    assert code == 0, err
    reused = int(done.sum())
    assert f"{chunks(8 - reused)} written, {reused} reused" in err
    code, _, err = cli(
        *SMALL, "--data", "synthetic:24", "--chunk-size", "3", "--batch-size", "2", "--out", tmp_path / "clean.zarr"
    )
    np.testing.assert_array_equal(
        zarr.open_group(tmp_path / "w.zarr", mode="r")["features/layer3"][:],
        zarr.open_group(tmp_path / "clean.zarr", mode="r")["features/layer3"][:],
    )


LONG_N = 320
# 40 batches of a model paced at TINY_PACE seconds a batch (set for the runs that are signalled only):
# the job lasts while the test signals it, and the reruns that complete it cost little.
LONG = ["--model", f"{TINY}:paced_net", "--layers", "conv", "--pool", "avg", "--image-size", "32",
        "--num-workers", "0", "--dtype", "float32", "--data", f"synthetic:{LONG_N}", "--chunk-size", "8",
        "--batch-size", "8"]  # fmt: skip
PACE = "0.2"


def _paced():
    os.environ["TINY_PACE"] = PACE


def _fork(out, err):
    """The paced job in a forked child leading its own process group; its stderr goes to ``err``."""
    return fork_start([*LONG, "--out", out], before=_paced, stderr=err, own_group=True)


def _launch(out):
    """The paced job under ``accelerate launch`` with 2 ranks, in a session of its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TINY_PACE": PACE}
    return subprocess.Popen(
        [*launcher(2), "extract", *LONG, "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _running(job) -> bool:
    if isinstance(job, subprocess.Popen):
        return job.poll() is None
    return os.waitpid(job, os.WNOHANG) == (0, 0)


def _wait_for_chunks(job, out, count=3, timeout=120):
    """``count`` chunks done, the job still running; ``timeout``: a quiet machine's time (``patience``)."""

    def reached() -> bool:
        done = out / "done" / "c"
        if done.is_dir() and len(os.listdir(done)) >= count:
            return True
        assert _running(job), "the job ended before it could be signalled"
        return False

    pid = job.pid if isinstance(job, subprocess.Popen) else job
    patience.until(reached, f"{count} chunks", [pid], quiet=timeout)


def _assert_consistent(out):
    """Every chunk marked done holds real features; nothing else is marked."""
    group = zarr.open_group(out, mode="r")
    done = group["done"][:]
    features = group["features/conv"][:]
    for chunk in np.flatnonzero(done):
        assert not np.isnan(features[chunk * 8 : chunk * 8 + 8]).any()
    return int(done.sum())


@pytest.fixture(scope="module")
def clean_long_store(tmp_path_factory):
    from extract.cli.extract import main

    out = tmp_path_factory.mktemp("clean") / "clean.zarr"
    assert main([*LONG, "--out", str(out)]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM-process", "SIGINT-launcher-2-ranks", "SIGTERM-one-of-2-ranks"])
def test_preemption_writes_what_is_done_and_a_rerun_completes(cli, tmp_path, how, clean_long_store):
    out = tmp_path / "pre.zarr"
    job = _launch(out) if "ranks" in how else _fork(out, tmp_path / "err")
    _wait_for_chunks(job, out)
    if how == "SIGTERM-process":
        os.kill(job, signal.SIGTERM)
    elif how == "SIGTERM-one-of-2-ranks":
        os.kill(rank_pids(job.pid)[-1], signal.SIGTERM)  # the launcher then stops the other rank
    else:
        os.killpg(job.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the whole process group
    # the job stops by itself (the waits' timeouts fail the test otherwise), long before its batches are over
    if how == "SIGTERM-process":
        returncode, err = fork_wait(job), (tmp_path / "err").read_text()
        assert returncode == 128 + signal.SIGTERM, err[-2000:]
    else:
        _, err = patience.communicate(job, quiet=60)
        returncode = job.returncode
    assert returncode != 0
    assert "rerun the same command to resume" in err, err[-2000:]
    finished = _assert_consistent(out)
    assert 3 <= finished < LONG_N // 8
    assert not lock_path(out).exists()

    code, _, err = cli(*LONG, "--out", out)
    assert code == 0, err[-2000:]
    assert f"{finished} of {LONG_N // 8} chunks already done" in err
    np.testing.assert_array_equal(
        zarr.open_group(out, mode="r")["features/conv"][:],
        zarr.open_group(clean_long_store, mode="r")["features/conv"][:],
    )


@pytest.mark.slow
def test_live_job_holds_the_store(cli, tmp_path):
    out = tmp_path / "busy.zarr"
    job = _fork(out, tmp_path / "err")
    try:
        _wait_for_chunks(job, out, count=1)
        os.killpg(job, signal.SIGSTOP)  # alive and holding the store, but not finishing under our feet
        code, _, err = cli(*LONG, "--out", out)
        line = one_line_error(err)
        assert code == 2 and "being written by another job" in line
        assert f"pid {job}" in line and socket.gethostname() in line
        code, _, err = cli(*LONG, "--out", out, "--overwrite")
        assert code == 2 and "being written by another job" in err
    finally:
        os.killpg(job, signal.SIGKILL)
        assert fork_wait(job) == -signal.SIGKILL
    # SIGKILL leaves the lock behind, but its holder is dead: the next run takes it over
    assert lock_path(out).exists()
    holder = json.loads(lock_path(out).read_text())
    assert holder["pid"] == job
    code, _, err = cli(*LONG, "--out", out)
    assert code == 0, err[-2000:]


def test_lock_of_another_host(cli, tmp_path):
    out = tmp_path / "remote.zarr"
    args = [*SMALL, "--data", "synthetic:4", "--out", out]
    assert cli(*args)[0] == 0
    lock = lock_path(out)
    zarr.open_group(out, mode="r+").attrs["status"] = "running"
    lock.write_text(json.dumps({"host": "node-17", "pid": 4242, "started": "2026-12-01T00:00:00"}))
    code, _, err = cli(*args)
    assert code == 2 and "host node-17, pid 4242" in one_line_error(err)
    old = time.time() - 3600
    os.utime(lock, (old, old))  # its heartbeat stopped an hour ago: stale
    code, _, err = cli(*args)
    assert code == 0, err
    assert not lock.exists()


def test_the_next_holder_sweeps_what_killed_claims_and_creations_left(cli, tmp_path):
    out = tmp_path / "swept.zarr"
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid of this host that no longer runs
    record = lock_path(out).name
    here = socket.gethostname()
    claimers = {  # the dead one proves its pid is of this PID namespace; the other is a container's
        f".{record}-{here}-{dead.pid}": {"host": here, "pid": dead.pid, **process_namespace()},
        f".{record}-{here}-{dead.pid + 1}": {"host": here, "pid": dead.pid + 1, "pid_ns": "pid:[4026599999]"},
    }
    debris = {
        f".{record}-{here}-{dead.pid}": "swept",  # a claimer of this host, dead
        f".{record}-{here}-{dead.pid + 1}": "kept",  # a claimer of another PID namespace, young: maybe mid-claim
        f".{record}-node-17-4242": "kept",  # another host's, young: maybe mid-claim
        f".{record}-node-17-4343": "swept",  # another host's, a minute old
        f".{out.name}.creating-{dead.pid}": "swept",
        f".{out.name}.trash-{dead.pid}": "swept",
    }
    for name in debris:
        if ".lock-" in name:  # a claimer's record, which says where its pid is one
            (tmp_path / name).write_text(json.dumps(claimers.get(name, {"host": "node-17", "pid": 4242})))
        else:
            (tmp_path / name).mkdir()
    old = time.time() - 120
    os.utime(tmp_path / f".{record}-node-17-4343", (old, old))
    code, _, err = cli(*SMALL, "--data", "synthetic:4", "--out", out)
    assert code == 0, err
    assert {name: "kept" if (tmp_path / name).exists() else "swept" for name in debris} == debris


def test_resuming_on_changed_files_is_refused_and_overwrite_recomputes(cli, tmp_path):
    root = tmp_path / "images"
    make_png_tree(root, {"a": 3, "b": 3})
    args = [*SMALL, "--data", f"imagefolder:{root}", "--out", tmp_path / "f.zarr"]
    assert cli(*args)[0] == 0
    (root / "a" / "001.png").rename(root / "a" / "renamed.png")  # same N, other files
    code, _, err = cli(*args)
    assert code == 2 and "differs in: data_listing_sha256" in one_line_error(err)
    code, _, err = cli(*args, "--overwrite")
    assert code == 0 and "6 samples" in err
    group = zarr.open_group(tmp_path / "f.zarr", mode="r")
    assert len(group.attrs["runs"]) == 1 and group.attrs["status"] == "complete"
    code, _, err = cli(*args, "--overwrite")  # the same job again: --overwrite still starts afresh
    assert code == 0 and "6 chunks written, 0 reused" in err  # the default gives a small job several chunks
