"""Issue 11: one job per store from the first instant, atomic creation, verified chunks, strict job files,
signals. Most runs are forked from this process (torch is imported once), so a SIGKILL costs a fraction
of a second; the multi-process ones use ``accelerate launch``."""

import contextlib
import functools
import io
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers import ROOT, TINY, patience
from helpers.cli import FAST_LOCK, SEEDED, TINY_JOB, one_line_error
from helpers.forked import (
    EXIT_TIMEOUT,
    die_after,
    die_on,
    fork_run,
    fork_start,
    fork_wait,
    set_environment,
    started_together,
    the_one_that_ran,
)  # fmt: skip
from helpers.launches import launcher, rank_pids
from helpers.stores import TINY_ARRAYS, assert_same_store

import extract.store.lock
from extract.cli.verify import main as verify_main
from extract.errors import LockLostError, StoreDamagedError
from extract.read.features import open_features
from extract.store.lock import lock_path
from extract.store.store import FeatureStore


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny job, uninterrupted; its features checked against the model run directly."""
    out = tmp_path_factory.mktemp("ref") / "ref.zarr"
    assert fork_run([*TINY_JOB, "--out", out]) == 0
    from helpers.tiny_models import dict_net

    from extract.data import build_dataset
    from extract.models import build_model

    loaded = build_model(f"{TINY}:dict_net", "DEFAULT", None, 0, 32)
    dataset = build_dataset("synthetic:48", loaded.preprocess, max(loaded.input_size))
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    net = dict_net().eval()
    with torch.no_grad():
        expected = net.heads.conv(images).numpy()
    stored = zarr.open_group(out, mode="r")["features/heads.conv"][:]
    np.testing.assert_allclose(stored, expected, rtol=0, atol=1e-5)
    return out


# ----------------------------------------------------------------------------------- kill storm


def _completing(self, **values):
    return values.get("status") == "complete"


TARGETED = {
    # the lock: its record written, not yet linked into place
    "claim-lock": die_on(os, "link", 1),
    # creation: after the group's zarr.json, between arrays, before the rename into place
    "create-first-array": die_on(zarr.Group, "create_array", 1),
    "create-third-array": die_on(zarr.Group, "create_array", 3),
    "create-rename": die_on(os, "rename", 1, lambda src, dst: ".creating-" in str(src)),
    # the final marking: before and after the status is written
    "before-complete": die_on(FeatureStore, "update_attrs", 1, _completing),
    "after-complete": die_after(FeatureStore, "update_attrs", _completing),
    "mid-chunk": die_on(FeatureStore, "write_chunk", 5),
}


def _log_store_writes(log: Path, die_at: int | None = None):
    """For ``before``: append ``store:KEY`` to ``log`` for every object zarr writes (``scratch:KEY`` while
    the store is built beside its target), and SIGKILL ourselves instead of write number ``die_at``."""
    from zarr.storage import LocalStore

    original = LocalStore.set
    written = itertools.count()

    async def logged(self, key, value):
        where = "scratch" if ".creating-" in str(self.root) else "store"
        with open(log, "a") as f:
            f.write(f"{where}:{key}\n")
        if next(written) == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return await original(self, key, value)

    return lambda: setattr(LocalStore, "set", logged)


def _assert_holds_only_what_was_written(out: Path, logged: list[str]) -> None:
    """After a kill at the last write ``logged`` (never made): the store is in place once its skeleton
    was renamed there, which is before the first write into the store (and after the last into the
    scratch skeleton); a chunk marked done had its done flag among the writes made, and holds real features."""
    writes = logged[:-1]
    assert out.exists() == logged[-1].startswith("store:")
    if not out.exists():
        return
    group = zarr.open_group(out, mode="r")
    done = np.flatnonzero(group["done"][:]).tolist()
    logged = {int(w.rsplit("/", 1)[1]) for w in writes if w.startswith("store:done/c/")}
    assert set(done) <= logged, (done, logged)
    features = group["features/heads.conv"][:]
    for chunk in done:
        assert not np.isnan(features[chunk * 4 : chunk * 4 + 4]).any(), chunk


def _rerun_gives_the_reference(tmp_path: Path, out: Path, reference: Path, name: str) -> None:
    assert fork_run([*TINY_JOB, "--out", out]) == 0, f"the rerun after the kill at {name} failed"
    assert_same_store(out, reference)
    assert not lock_path(out).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".storm")] == [], "scratch left behind"


def test_kill_storm_one_process(tmp_path, reference):
    """SIGKILL at 20 points of a run: 13 spread evenly over the objects zarr writes in a whole run
    (creation, every chunk, the final marking; counted by a first, uninterrupted run), and 7 chosen
    calls (claiming the lock, creation, mid-chunk and the final marking). Each kill lands at its
    point; what it leaves holds nothing marked done that was not written; one rerun of the same
    command gives the uninterrupted store."""
    whole = tmp_path / "whole.log"
    assert fork_run([*TINY_JOB, "--out", tmp_path / "whole.zarr"], before=_log_store_writes(whole)) == 0
    assert_same_store(tmp_path / "whole.zarr", reference)
    writes = whole.read_text().splitlines()
    points = sorted(set(np.linspace(0, len(writes) - 1, 13).round().astype(int).tolist()))
    assert len(points) == 13 and writes[0].startswith("scratch:") and writes[-1].startswith("store:"), writes
    out = tmp_path / "storm.zarr"
    for point in points:
        name = f"write {point} of {len(writes)}"
        shutil.rmtree(out, ignore_errors=True)
        log = tmp_path / f"write-{point}.log"
        assert fork_run([*TINY_JOB, "--out", out], before=_log_store_writes(log, die_at=point)) == -signal.SIGKILL
        logged = log.read_text().splitlines()
        assert len(logged) == point + 1, f"the kill at {name} landed at write {len(logged) - 1}"
        _assert_holds_only_what_was_written(out, logged)
        _rerun_gives_the_reference(tmp_path, out, reference, name)
    for name, before in TARGETED.items():
        shutil.rmtree(out, ignore_errors=True)
        assert fork_run([*TINY_JOB, "--out", out], before=before) == -signal.SIGKILL, f"the kill at {name} did not land"
        _rerun_gives_the_reference(tmp_path, out, reference, name)


def _launch(processes, args, out, pace: float = 0):
    """The job under ``accelerate launch`` in a session of its own; ``pace``: TINY_PACE for ``PACED``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TINY_PACE": str(pace)}
    return subprocess.Popen(
        [*launcher(processes), "extract", *map(str, args), "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _ranks(launcher_pid):
    return rank_pids(launcher_pid)


def _gone(pids, within):
    deadline = time.time() + within
    while time.time() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split()[2] != "Z":
                        alive.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


LONGER = [*TINY_JOB[:-6], "--data", "synthetic:2000", "--chunk-size", "16", "--batch-size", "16"]  # a few seconds


# A model that sleeps TINY_PACE seconds a batch in the launched runs (the job lasts while the test looks,
# at no CPU cost) and not in the reruns, which then cost little.
PACED = ["--model", f"{TINY}:paced_net", "--layers", "conv", "--image-size", "32", "--num-workers", "0",
         "--dtype", "float32"]  # fmt: skip


@pytest.mark.slow
def test_launcher_death_stops_the_ranks_and_a_rerun_completes(tmp_path):
    """``kill -9`` of the launcher's process group (ranks run in sessions of their own): every rank is
    gone within 10 s, marking nothing it did not finish, and a rerun completes the store."""
    args = [*PACED, "--data", "synthetic:640", "--chunk-size", "16", "--batch-size", "16"]
    out = tmp_path / "orphan.zarr"
    job = _launch(2, args, out, pace=0.1)
    patience.while_running(
        lambda: (out / "done" / "c").is_dir() and len(os.listdir(out / "done" / "c")) >= 2, "2 chunks", job, quiet=120
    )
    ranks = _ranks(job.pid)
    assert len(ranks) == 2
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert _gone(ranks, patience.ceiling(10)), "orphaned ranks must stop"
    group = zarr.open_group(out, mode="r")
    assert group.attrs["status"] == "running" and group["done"][:].sum() < 40  # 20 batches a rank: it stopped early
    assert not lock_path(out).exists()
    features = group["features/conv"][:]
    for chunk in np.flatnonzero(group["done"][:]):
        assert not np.isnan(features[chunk * 16 : chunk * 16 + 16]).any()
    assert fork_run([*args, "--out", out]) == 0

    from extract.data import build_dataset
    from extract.models import build_model

    loaded = build_model(f"{TINY}:paced_net", "DEFAULT", None, 0, 32)
    dataset = build_dataset("synthetic:640", loaded.preprocess, max(loaded.input_size))
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    with torch.no_grad():
        expected = loaded.model.conv(images).numpy()
    np.testing.assert_allclose(zarr.open_group(out, mode="r")["features/conv"][:], expected, rtol=0, atol=1e-5)
    runs = zarr.open_group(out, mode="r").attrs["runs"]
    assert [run["status"] for run in runs] == ["interrupted", "complete"] and runs[0]["seconds"] is not None


@pytest.mark.slow
def test_sigterm_to_the_launcher_with_workers_stops_cleanly_with_one_line(tmp_path):
    """torch elastic signals each rank's process group, DataLoader workers included: the workers leave
    it to their rank, every rank stops after its batch, and one line gives the job's count."""
    out = tmp_path / "launcher.zarr"
    job = _launch(2, [*LONGER, "--num-workers", "1"], out)
    patience.while_running(
        lambda: (out / "done" / "c").is_dir() and len(os.listdir(out / "done" / "c")) >= 2, "2 chunks", job, quiet=120
    )
    job.send_signal(signal.SIGTERM)
    _, err = patience.communicate(job, quiet=60)
    assert job.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "DataLoader worker" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("extract: interrupted by SIGTERM")]
    assert len(lines) == 1 and "rerun the same command to resume" in lines[0], err[-3000:]
    group = zarr.open_group(out, mode="r")
    assert group.attrs["runs"][-1]["status"] == "interrupted" and group.attrs["status"] == "running"
    features = group["features/heads.conv"][:]
    for chunk in np.flatnonzero(group["done"][:]):
        assert not np.isnan(features[chunk * 16 : chunk * 16 + 16]).any()
    assert not lock_path(out).exists()


@pytest.mark.slow
def test_kill_storm_two_processes(tmp_path):
    """SIGKILL of everything (launcher and ranks) at points of a 2-process run seen in the store (just
    created; half the chunks done), then one rerun (a single process: resumes may change the process
    count) gives the uninterrupted store. The model sleeps 100 ms a batch, so the kills land in the run."""
    args = [*PACED, "--data", "synthetic:96", "--chunk-size", "4", "--batch-size", "4"]
    expected = tmp_path / "expected.zarr"
    assert fork_run([*args, "--out", expected]) == 0
    points = {
        "created": lambda out: (out / "zarr.json").exists(),  # renamed into place
        "half done": lambda out: (out / "done" / "c").is_dir() and len(os.listdir(out / "done" / "c")) >= 12,
    }
    for trial, reached in enumerate(points.values()):
        out = tmp_path / f"storm2-{trial}.zarr"
        job = _launch(2, args, out, pace=0.1)
        patience.while_running(functools.partial(reached, out), "the point to kill at", job, quiet=120, pause=0.005)
        ranks = _ranks(job.pid)
        os.killpg(job.pid, signal.SIGKILL)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.wait()
        assert _gone(ranks, patience.ceiling(10))
        group = zarr.open_group(out, mode="r")
        assert group.attrs["status"] == "running" and group["done"][:].sum() < 24  # it landed in the run
        rerun = fork_start([*args, "--out", out], stderr=tmp_path / f"rerun-{trial}.err")
        assert fork_wait(rerun) == 0, (tmp_path / f"rerun-{trial}.err").read_text()[-2000:]
        a, b = zarr.open_group(out, mode="r"), zarr.open_group(expected, mode="r")
        assert a.attrs["status"] == "complete" and a["done"][:].all()
        for name in ("features/conv", "labels", "valid"):
            np.testing.assert_array_equal(a[name][:], b[name][:])


# ---------------------------------------------------------------------------------- verify and repair


def _chunk_file(out, array, chunk):
    group = zarr.open_group(out, mode="r")
    arr = group[array]
    return Path(out) / array / arr.metadata.encode_chunk_key((chunk, *[0] * (arr.ndim - 1)))


TAMPER = {
    "delete-feature": ("features/heads.conv", lambda f: f.unlink(), "is missing"),
    "truncate-feature": ("features/heads.conv", lambda f: f.write_bytes(f.read_bytes()[:40]), "fails its check"),
    "corrupt-feature": (
        "features/heads.conv",
        lambda f: f.write_bytes(f.read_bytes()[:20] + b"\xff" * 8 + f.read_bytes()[28:]),
        "fails its check",
    ),
    "empty-feature": ("features/heads.conv", lambda f: f.write_bytes(b""), "fails its check"),
    "delete-labels": ("labels", lambda f: f.unlink(), "is missing"),
    "delete-valid": ("valid", lambda f: f.unlink(), "is missing"),
    "delete-keys": ("keys", lambda f: f.unlink(), "is missing"),  # written at creation, restored by the rerun
}


@pytest.mark.parametrize("how", TAMPER)
def test_verify_finds_damage_the_reader_refuses_it_and_repair_recomputes(tmp_path, reference, capsys, how):
    array, tamper, problem = TAMPER[how]
    out = tmp_path / "t.zarr"
    shutil.copytree(reference, out)
    assert verify_main([str(out)]) == 0
    assert "all 12 done chunks" in capsys.readouterr().out
    tamper(_chunk_file(out, array, 5))

    assert verify_main([str(out)]) == 1
    line = capsys.readouterr().out.strip()
    assert len(line.splitlines()) == 1 and "1 of 12 chunks damaged" in line and f"chunk 5: {array}" in line

    features = open_features(out)
    what = "layer 'heads.conv'" if array.startswith("features") else array
    with pytest.raises(StoreDamagedError, match=rf"{what}, chunk 5 \(samples 20-23\) {problem}") as error:
        if array in ("labels", "valid", "keys"):
            getattr(features, array)
        else:
            features.load("heads.conv")
    assert "extract.verify" in str(error.value) and "--repair" in str(error.value)
    assert features.load("heads.conv", slice(0, 20)).shape == (20, 4, 15, 15)  # other chunks still read

    assert verify_main([str(out), "--repair"]) == 1
    assert "cleared their done flags" in capsys.readouterr().out
    assert zarr.open_group(out, mode="r")["done"][:].tolist() == [k != 5 for k in range(12)]
    assert fork_run([*TINY_JOB, "--out", out]) == 0
    assert_same_store(out, reference)
    assert verify_main([str(out)]) == 0


def test_a_complete_rerun_checks_presence_before_saying_done(tmp_path, reference, cli):
    out = tmp_path / "lost.zarr"
    shutil.copytree(reference, out)
    _chunk_file(out, "features/heads.conv", 2).unlink()
    code, _, err = cli(*TINY_JOB, "--out", out)
    assert code == 0 and "lost objects (chunk 2: features/heads.conv)" in err and "1 chunk written, 11 reused" in err
    assert_same_store(out, reference)


def test_verify_of_something_else_is_a_one_line_error(tmp_path, capsys):
    assert verify_main([str(tmp_path)]) == 2
    assert "not an extract store" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- metadata


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda a: a.update(num_samples=40), "num_samples 40"),
        (lambda a: a.update(chunk_size=6), "chunk_size 6"),
        (lambda a: a.update(format_version=99), "format_version 99"),
        (lambda a: a.update(layers=["heads.conv", "fc"]), "no array 'features/fc'"),
    ],
)
def test_edited_metadata_are_refused_on_open(tmp_path, reference, cli, edit, message):
    out = tmp_path / "edited.zarr"
    shutil.copytree(reference, out)
    meta = json.loads((out / "zarr.json").read_text())
    edit(meta["attributes"])
    (out / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreDamagedError, match=message):
        open_features(out)
    code, _, err = cli(*TINY_JOB, "--out", out)
    assert code == 2 and message in one_line_error(err)


@pytest.mark.parametrize("inside", ["x.zarr", "features/x.zarr", "features/new/x.zarr"])
def test_out_inside_another_store_is_refused(tmp_path, reference, cli, inside):
    store = tmp_path / "ref.zarr"
    shutil.copytree(reference, store)
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    code, _, err = cli(*TINY_JOB, "--out", store / inside)
    line = one_line_error(err)
    assert code == 2 and f"is inside the extract store {store};" in line, err
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before and os.listdir(tmp_path) == ["ref.zarr"]
    assert_same_store(store, reference)


def _torn_root(tmp_path: Path, reference: Path, recognisable: bool) -> Path:
    """A copy of the reference whose root zarr.json is cut half-way, recognisable as an extract store
    by its arrays, or not at all (no ``done``; a stale lock named for it is no proof)."""
    out = tmp_path / "torn.zarr"
    shutil.copytree(reference, out)
    if not recognisable:
        shutil.rmtree(out / "done")
        lock_path(out).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "2026-01-01T00:00:00"}))
        os.utime(lock_path(out), (time.time() - 600, time.time() - 600))
    meta = (out / "zarr.json").read_bytes()
    (out / "zarr.json").write_bytes(meta[: len(meta) // 2])
    return out


def test_a_torn_root_is_refused_then_replaced_with_overwrite(tmp_path, reference, cli):
    out = _torn_root(tmp_path, reference, recognisable=True)
    torn = (out / "zarr.json").read_bytes()
    code, _, err = cli(*TINY_JOB, "--out", out)
    line = one_line_error(err)
    assert code == 2 and f"root metadata {out / 'zarr.json'} are damaged" in line and "--overwrite" in line, err
    assert (out / "zarr.json").read_bytes() == torn and (out / "features").is_dir()
    code, _, err = cli(*TINY_JOB, "--out", out, "--overwrite")
    assert code == 0, err
    assert_same_store(out, reference)
    assert sorted(os.listdir(tmp_path)) == ["torn.zarr"]  # the old store moved aside, then deleted


def test_a_torn_zarr_json_in_a_directory_that_is_no_store_is_never_replaced(tmp_path, reference, cli):
    out = _torn_root(tmp_path, reference, recognisable=False)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    code, _, err = cli(*TINY_JOB, "--out", out, "--overwrite")
    assert code == 2 and "is a directory that is not an extract store" in one_line_error(err)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


# ------------------------------------------------------------------------------------ job files


BAD_TOML = [
    ('overwrite = "no"', "'overwrite' = 'no' must be a boolean"),
    ("chunk_size = true", "'chunk_size' = True must be an integer"),
    ('batch_size = "8"', "'batch_size' = '8' must be an integer"),
    ("layers = 4", "'layers' = 4 must be a list of strings"),
    ("image_size = 32.5", "'image_size' = 32.5 must be an integer"),
    ("skip_bad_images = 1", "'skip_bad_images' = 1 must be a boolean"),
    ("timeout = true", "'timeout' = True must be a number"),
    ('seed = "0"', "'seed' = '0' must be an integer"),
]


@pytest.mark.parametrize("line, message", BAD_TOML)
def test_bad_job_file_types_are_refused_before_anything_exists(tmp_path, cli, line, message):
    job = tmp_path / "job.toml"
    layers = "" if line.startswith("layers") else 'layers = ["heads.conv"]\n'
    job.write_text(f'model = "{TINY}:dict_net"\n{layers}data = "synthetic:4"\n{line}\n')
    out = tmp_path / "never.zarr"
    code, _, err = cli("--config", job, "--out", out)
    assert code == 2 and message in one_line_error(err) and str(job) in err
    assert sorted(os.listdir(tmp_path)) == ["job.toml"]


def test_overwrite_no_in_a_job_file_keeps_the_store(tmp_path, reference, cli):
    out = tmp_path / "kept.zarr"
    shutil.copytree(reference, out)
    before = (out / "zarr.json").read_text()
    job = tmp_path / "job.toml"
    job.write_text('overwrite = "no"\nseed = 1\n')
    code, _, err = cli("--config", job, *TINY_JOB, "--out", out)
    assert code == 2 and "'overwrite' = 'no' must be a boolean" in one_line_error(err)
    assert (out / "zarr.json").read_text() == before
    assert_same_store(out, reference)


def test_verify_of_a_store_being_written_is_refused_naming_the_job(tmp_path):
    args = [*PACED, "--data", "synthetic:320", "--chunk-size", "16", "--batch-size", "16"]
    out, link = tmp_path / "live.zarr", tmp_path / "link.zarr"
    link.symlink_to(out)
    job = fork_start([*args, "--out", out], lambda: os.environ.update(TINY_PACE="0.1"), stderr=tmp_path / "err")
    try:
        patience.until(
            lambda: (out / "done" / "c").is_dir() and len(os.listdir(out / "done" / "c")) >= 2,
            "2 chunks", [job], quiet=EXIT_TIMEOUT, detail=lambda: (tmp_path / "err").read_text(),
        )  # fmt: skip
        for store, flags in [(out, []), (link, []), (out, ["--repair"])]:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                assert verify_main([str(store), *flags]) == 2
            (line,) = err.getvalue().splitlines()
            assert "being written by another job" in line and f"pid {job}," in line, line
    finally:
        assert fork_wait(job) == 0, (tmp_path / "err").read_text()
    assert fork_run([*args, "--out", tmp_path / "expected.zarr"]) == 0
    with contextlib.redirect_stdout(io.StringIO()) as said:
        assert verify_main([str(out)]) == 0, said.getvalue()
    got, expected = (zarr.open_group(p, mode="r") for p in (out, tmp_path / "expected.zarr"))
    for name in ("features/conv", "labels", "valid", "keys"):
        np.testing.assert_array_equal(got[name][:], expected[name][:], err_msg=name)


# --------------------------------------------------------------------------------- one job per store


@pytest.mark.parametrize("second", ["same job", "other seed", "through a link"])
def test_two_jobs_started_together_one_runs(tmp_path, reference, second):
    out = tmp_path / "race.zarr"
    longer = [*TINY_JOB[:-6], "--data", "synthetic:400", "--chunk-size", "16", "--batch-size", "16"]
    jobs = {"first": [*longer, "--out", out], "second": [*longer, "--out", out]}
    if second == "other seed":
        jobs["second"].extend(["--seed", "1"])
    if second == "through a link":  # one store by two names: one lock, race.zarr.lock
        (tmp_path / "link.zarr").symlink_to(out)
        jobs["second"] = [*longer, "--out", tmp_path / "link.zarr"]
    results = started_together(jobs, extract.store.lock, "_create", tmp_path)  # both claim the lock at once
    winner, loser = the_one_that_ran(results)
    _, code, err = results[loser]
    line = one_line_error(err)
    assert code == 2 and "being written by another job" in line and f"pid {results[winner][0]}" in line
    assert socket.gethostname() in line
    if second == "through a link":
        assert (tmp_path / "link.zarr").is_symlink()
        assert loser == "first" or f"link.zarr (resolves to {out}; the lock is {lock_path(out)})" in line
    expected = tmp_path / "expected.zarr"
    assert fork_run([*jobs[winner][:-2], "--out", expected]) == 0
    group, clean = zarr.open_group(out, mode="r"), zarr.open_group(expected, mode="r")
    assert group.attrs["fingerprint"] == clean.attrs["fingerprint"] and group.attrs["status"] == "complete"
    for name in TINY_ARRAYS:
        np.testing.assert_array_equal(group[name][:], clean[name][:])
    assert len(group.attrs["runs"]) == 1


def test_stale_lock_of_a_live_reused_pid_is_taken_over_by_age(tmp_path, cli):
    out = tmp_path / "reused.zarr"
    lock = lock_path(out)
    # this host, a live pid (our own parent), but a heartbeat stopped ten minutes ago
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "started": "2026-01-01T00:00:00"}))
    code, _, err = cli(*TINY_JOB[:-6], "--data", "synthetic:4", "--out", out)
    assert code == 2 and "being written by another job" in one_line_error(err)
    old = time.time() - 600
    os.utime(lock, (old, old))
    code, _, err = cli(*TINY_JOB[:-6], "--data", "synthetic:4", "--out", out)
    assert code == 0, err
    assert not lock.exists()


# A lock of this host whose holder is in another PID namespace (issue 29, item 5): a container on the same
# host (pyxis/enroot, a pod with hostNetwork, ``docker run``, ``unshare --pid``) shares the hostname and
# the filesystem, not the pids. Its holder's pid proves nothing here: only its heartbeat's age frees it.
# The lock's own tests (a stale holder in another PID namespace, the heartbeat's) are test_locks.py's.


def _in_a_new_pid_namespace() -> bool:
    try:
        made = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
        return made.returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _in_a_new_pid_namespace(), reason="needs unshare --pid (root, or user namespaces)")
def test_a_job_in_another_pid_namespace_does_not_take_a_live_holders_lock(tmp_path):
    """A holds the store (its model's factory waits); B, started by ``unshare --pid --fork --mount-proc`` on
    the same host (a container), cannot see A's pid: it is refused with one line, and A completes."""
    factory, building, release = tmp_path / "held.py", tmp_path / "building", tmp_path / "release"
    factory.write_text(
        f"import pathlib, time, torch\ndef net():\n    pathlib.Path({str(building)!r}).touch()\n"
        f"    deadline = time.time() + 900\n    while not pathlib.Path({str(release)!r}).exists() and time.time() < deadline:\n"
        "        time.sleep(0.02)\n    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))\n"
    )
    out, a_err = tmp_path / "held.zarr", tmp_path / "a.err"
    a_job = [*TINY_JOB[4:], "--model", f"{factory}:net", "--layers", "0", "--out", out]
    a = fork_start(a_job, stderr=a_err)
    try:
        _until(building.exists, a, a_err)  # A holds the lock: its factory is running
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        b = patience.run(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "extract", *map(str, TINY_JOB),
             "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, quiet=300,
        )  # fmt: skip
        line = one_line_error(b.stderr)
        assert b.returncode == 2 and "being written by another job" in line, b.stderr[-2000:]
        assert f"pid {a} in another PID namespace" in line, line
        assert _lock_pid(out) == a
    finally:
        release.touch()
    assert fork_wait(a, timeout=120) == 0, a_err.read_text()[-2000:]
    assert zarr.open_group(out, mode="r").attrs["status"] == "complete" and not lock_path(out).exists()


def test_interrupted_overwrite_leaves_old_store_or_nothing(tmp_path, reference):
    """A kill at every step of --overwrite: afterwards --out holds the old store or nothing, and the same
    command completes the new one."""
    other = [*TINY_JOB, "--seed", "1"]
    for step in ("rename-aside", "rename-into-place", "delete-old"):
        out = tmp_path / f"over-{step}.zarr"
        shutil.copytree(reference, out)
        if step == "delete-old":
            before = die_on(shutil, "rmtree", 1, lambda path, **k: ".trash-" in str(path))
        elif step == "rename-aside":
            before = die_on(os, "rename", 1, lambda src, dst: ".trash-" in str(dst))
        else:
            before = die_on(os, "rename", 1, lambda src, dst: ".creating-" in str(src))
        assert fork_run([*other, "--out", out, "--overwrite"], before=before) == -signal.SIGKILL
        if step == "rename-into-place":
            assert not out.exists()  # the old store was moved aside, the new one not yet in place
        else:
            FeatureStore.open(out, mode="r")  # a whole store: the old one, or the new one
        assert fork_run([*other, "--out", out, "--overwrite"]) == 0
        assert zarr.open_group(out, mode="r").attrs["status"] == "complete"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f".over-{step}")] == []


@pytest.mark.parametrize("status", ["complete", "running"])
def test_a_store_on_a_read_only_mount(tmp_path, reference, cli, monkeypatch, status):
    """The lock cannot be created (EROFS; as root, permissions would not stop us): a complete store is
    "already complete", an unfinished one is refused as not writable, untouched either way."""
    import errno

    import extract.store.lock

    out = tmp_path / "ro.zarr"
    shutil.copytree(reference, out)
    if status == "running":
        zarr.open_group(out, mode="r+").attrs["status"] = "running"

    def read_only(path, record):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(extract.store.lock, "_create", read_only)
    code, _, err = cli(*TINY_JOB, "--out", out)
    if status == "complete":
        assert code == 0 and "already complete" in err
    else:
        assert code == 2 and "not writable" in one_line_error(err)
    assert sorted(os.listdir(tmp_path)) == ["ro.zarr"]


def test_a_store_still_being_created_is_an_error_not_a_keyerror(tmp_path):
    out = tmp_path / "half.zarr"
    zarr.open_group(out, mode="w", attributes={"format": "extract-features", "format_version": 2,
                                               "num_samples": 4, "chunk_size": 2, "layers": ["x"]})  # fmt: skip
    with pytest.raises(StoreDamagedError, match="has no array 'features/x'"):
        open_features(out, allow_partial=True)


# ------------------------------------------------------------------------- a holder that lost its lock

# Two jobs that differ in their seed only (paced_by_seed's weights follow --seed); A also differs in
# length, so that it runs on while B runs. The lock goes stale after 1 s (a heartbeat of 0.2 s).
JOB_A = [*SEEDED, "--data", "synthetic:160", "--seed", "0"]
JOB_B = [*SEEDED, "--data", "synthetic:64", "--seed", "1"]


def _chunks_done(out: Path) -> int:
    done = out / "done" / "c"
    return len(os.listdir(done)) if done.is_dir() else 0


def _lock_pid(out: Path) -> int | None:
    try:
        return json.loads(lock_path(out).read_text()).get("pid")
    except (OSError, ValueError):
        return None


def _until(reached, pid: int, err: Path, within: float = 120) -> None:
    """Wait until ``reached()``, with the job ``pid`` still running (and making progress: ``patience``)."""

    def done() -> bool:
        if reached():
            return True
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), err.read_text()[-2000:]
        return False

    patience.until(done, "the point awaited", [pid], quiet=within, pause=0.01)


@pytest.fixture(scope="module")
def reference_b(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref-b") / "b.zarr"
    assert fork_run([*JOB_B, "--out", out]) == 0
    return out


def _assert_is_b(out: Path, reference_b: Path, capsys) -> None:
    """``out`` is B's store, chunk by chunk, with B's run its only record, and verify finds it clean."""
    got, expected = zarr.open_group(out, mode="r"), zarr.open_group(reference_b, mode="r")
    assert got.attrs["status"] == "complete" and got["done"][:].all() and got["done"].shape == (16,)
    assert got.attrs["fingerprint"] == expected.attrs["fingerprint"]
    assert [run["status"] for run in got.attrs["runs"]] == ["complete"]
    for name in ("features/conv", "labels", "valid", "keys"):
        for chunk in range(16):
            rows = slice(4 * chunk, 4 * chunk + 4)
            np.testing.assert_array_equal(got[name][rows], expected[name][rows], err_msg=f"{name}, chunk {chunk}")
    assert verify_main([str(out)]) == 0, capsys.readouterr().out


def _assert_lost_the_lock(code: int, err: str, out: Path) -> None:
    line = one_line_error(err)
    assert code == 1, err[-2000:]
    assert f"lost the lock on --out {out}" in line and "marked nothing more" in line, line


def test_a_paused_holder_stops_and_leaves_the_store_to_the_job_that_took_it(tmp_path, reference_b, capsys):
    """A is stopped (SIGSTOP) past the stale age; B takes the store over with --overwrite for another job;
    A, continued while B runs, stops with one line (exit 1), leaves B's lock alone, and B's store is B's."""
    out, a_err, b_err = tmp_path / "taken.zarr", tmp_path / "a.err", tmp_path / "b.err"
    a = fork_start([*JOB_A, "--out", out], set_environment(TINY_PACE="0.1", **FAST_LOCK), stderr=a_err)
    try:
        _until(lambda: _chunks_done(out) >= 3, a, a_err)
        os.kill(a, signal.SIGSTOP)
        lock = lock_path(out)
        while time.time() - lock.stat().st_mtime < 1.1:  # A's heartbeat has stopped: the lock goes stale
            time.sleep(0.02)
        b = fork_start([*JOB_B, "--out", out, "--overwrite"], set_environment(TINY_PACE="0.15", **FAST_LOCK), b_err)
        _until(lambda: _lock_pid(out) == b and _chunks_done(out) >= 2, b, b_err)
        os.kill(a, signal.SIGCONT)
        code = fork_wait(a, timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(a, signal.SIGCONT)
    _assert_lost_the_lock(code, a_err.read_text(), out)
    assert f"pid {b}" in one_line_error(a_err.read_text())
    assert os.waitpid(b, os.WNOHANG) == (0, 0), "B should still be running, for its lock to be seen"
    assert _lock_pid(out) == b, "A must leave B's lock alone"
    assert fork_wait(b) == 0, b_err.read_text()[-2000:]
    _assert_is_b(out, reference_b, capsys)
    assert not lock.exists()


def test_a_holder_whose_lock_was_removed_stops_at_its_next_write(tmp_path, reference_b, capsys):
    """The lock is removed by hand while A runs (its heartbeat too slow to notice); B, another job, takes
    the store with --overwrite and completes while A goes on: the store refuses A's writes, A stops with
    one line (exit 1), and the store is B's."""
    out, a_err = tmp_path / "unlocked.zarr", tmp_path / "a.err"
    slow_lock = {"EXTRACT_LOCK_HEARTBEAT": "30", "EXTRACT_LOCK_STALE_AFTER": "60"}
    a = fork_start([*JOB_A, "--out", out], set_environment(TINY_PACE="0.1", **slow_lock), stderr=a_err)
    _until(lambda: _chunks_done(out) >= 3, a, a_err)
    lock_path(out).unlink()
    b_err = tmp_path / "b.err"
    assert fork_run([*JOB_B, "--out", out, "--overwrite"], stderr=b_err) == 0, b_err.read_text()[-2000:]
    _assert_lost_the_lock(fork_wait(a, timeout=60), a_err.read_text(), out)
    _assert_is_b(out, reference_b, capsys)
    assert not lock_path(out).exists()


def test_a_store_from_before_fencing_is_resumed_and_gets_a_writer(tmp_path, reference, cli):
    out = tmp_path / "old.zarr"
    shutil.copytree(reference, out)
    group = zarr.open_group(out, mode="r+")
    group.attrs.pop("writer")
    FeatureStore.open(out).integrity.clear_done([3])
    code, _, err = cli(*TINY_JOB, "--out", out)
    assert code == 0 and "1 chunk written, 11 reused" in err, err
    assert_same_store(out, reference)
    assert len(zarr.open_group(out, mode="r").attrs["writer"]) == 32


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"EXTRACT_LOCK_STALE_AFTER": "soon"}, "EXTRACT_LOCK_STALE_AFTER='soon' is not a positive number of seconds"),
        ({"EXTRACT_LOCK_HEARTBEAT": "5", "EXTRACT_LOCK_STALE_AFTER": "5"}, "must be shorter than"),
    ],
)
def test_bad_lock_timings_are_one_line_before_anything_exists(tmp_path, cli, monkeypatch, variables, message):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    code, _, err = cli(*TINY_JOB, "--out", tmp_path / "x.zarr")
    assert code == 2 and message in one_line_error(err)
    assert os.listdir(tmp_path) == []


def test_a_store_refuses_every_write_of_another_writer(tmp_path, reference):
    out = tmp_path / "fenced.zarr"
    shutil.copytree(reference, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    ours = FeatureStore.open(out, writer=zarr.open_group(out, mode="r").attrs["writer"])
    ours.check_writer()
    stale = FeatureStore.open(out, writer="an older generation")
    rows = np.zeros((4, 4, 15, 15), dtype=np.float32)
    writes = {
        "a chunk": lambda: stale.write_chunk(0, 0, 4, {"heads.conv": rows}, np.zeros(4), np.ones(4, dtype=bool)),
        "attributes": lambda: stale.update_attrs(status="complete"),
        "a done flag": lambda: stale.integrity.clear_done([1]),
        "the check": stale.check_writer,
    }
    for what, write in writes.items():
        with pytest.raises(LockLostError, match=f"lost the lock on --out {out}"):
            write()
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before, what


# ----------------------------------------------------------------------------------- signals, records


def test_sigterm_during_start_up_stops_cleanly(tmp_path):
    """A signal while the model is being built (after --out is claimed, before anything is created)."""
    factory = tmp_path / "slow.py"
    building = tmp_path / "building"
    factory.write_text(
        f"import pathlib, time, torch\ndef net():\n    pathlib.Path({str(building)!r}).touch()\n"
        "    time.sleep(30)\n    return torch.nn.Conv2d(3, 4, 3)\n"
    )
    out = tmp_path / "early.zarr"
    job = fork_start([*TINY_JOB[2:], "--model", f"{factory}:net", "--out", out], stderr=tmp_path / "err")
    while not building.exists():  # the factory is running
        assert os.waitpid(job, os.WNOHANG) == (0, 0), (tmp_path / "err").read_text()
        time.sleep(0.01)
    assert lock_path(out).exists()
    os.kill(job, signal.SIGTERM)
    assert fork_wait(job) == 128 + signal.SIGTERM
    err = (tmp_path / "err").read_text()
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) in (
        ["building", "err", "slow.py"],
        ["__pycache__", "building", "err", "slow.py"],
    )


def test_sigterm_to_the_process_group_with_workers_keeps_chunks_and_records_the_run(tmp_path):
    out = tmp_path / "group.zarr"
    args = [*LONGER, "--num-workers", "2"]
    job = fork_start([*args, "--out", out], stderr=tmp_path / "err", own_group=True)
    patience.until(
        lambda: (out / "done" / "c").is_dir() and len(os.listdir(out / "done" / "c")) >= 2, "2 chunks", [job],
        quiet=120, pause=0.01,
    )  # fmt: skip
    os.killpg(job, signal.SIGTERM)  # what SLURM sends: the process and its DataLoader workers
    assert fork_wait(job) == 143
    err = (tmp_path / "err").read_text()
    messages = [line for line in err.splitlines() if line.startswith("extract: interrupted")]
    assert len(messages) == 1 and "Traceback" not in err and "DataLoader worker" not in err, err
    group = zarr.open_group(out, mode="r")
    done = int(group["done"][:].sum())
    assert f"{done} chunks written" in messages[0]
    run = group.attrs["runs"][-1]
    assert run["status"] == "interrupted" and run["seconds"] > 0
    assert fork_run([*args, "--out", out]) == 0
    runs = zarr.open_group(out, mode="r").attrs["runs"]
    assert [r["status"] for r in runs] == ["interrupted", "complete"]


def test_a_killed_run_is_recorded_as_killed_after_a_resume(tmp_path, reference):
    out = tmp_path / "k.zarr"
    assert fork_run([*TINY_JOB, "--out", out], before=die_on(FeatureStore, "write_chunk", 4)) == -signal.SIGKILL
    assert fork_run([*TINY_JOB, "--out", out]) == 0
    runs = zarr.open_group(out, mode="r").attrs["runs"]
    assert [r["status"] for r in runs] == ["killed", "complete"]


def test_disk_full_during_creation_is_one_line_and_leaves_nothing(tmp_path, cli, monkeypatch):
    from extract.store.skeleton import Skeleton

    real = Skeleton.build

    def full(skeleton, path, attrs):
        real(skeleton, path, attrs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Skeleton, "build", full)
    out = tmp_path / "full.zarr"
    code, _, err = cli(*TINY_JOB, "--out", out)
    assert code == 2 and "No space left on device" in one_line_error(err)
    assert os.listdir(tmp_path) == []


def test_a_sigterm_echoed_by_the_launcher_is_one_request_a_second_kind_stops_at_once():
    """SLURM signals every process of the step and accelerate's launcher forwards it to its ranks: one
    preemption reaches a rank twice, and must still stop it after the batch."""
    from extract.job.interrupt import Interrupted, StopRequests

    with StopRequests() as stop:
        stop.defer()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the echo: ignored
        assert stop.signum == signal.SIGTERM
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C on top: at once
