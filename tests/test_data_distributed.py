"""Tar shards with several ranks: the index split across ranks, every sample exactly once, and a
resume after SIGKILL with another number of ranks that reuses the index kept in the store."""

import os
import signal
import subprocess
import time

import numpy as np
import pytest
import zarr
from helpers import ROOT
from helpers.data_files import write_shards
from helpers.launches import Sequence, launcher, rank_pids

from extract import open_features

pytestmark = pytest.mark.slow

COMMON = ["--model", "resnet18", "--weights", "none", "--layers", "layer2", "--pool", "avg", "--image-size", "32",
          "--num-workers", "0", "--dtype", "float32"]  # fmt: skip


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    write_shards(root, [37, 5, 1, 50, 27])  # 120 samples; chunk 3 divides none of 37, 5, 1, 50
    return root


def single_rank_store(cli, tmp_path, root, chunk):
    out = tmp_path / "single.zarr"
    code, _, err = cli(*COMMON, "--data", f"wds:{root}", "--chunk-size", chunk, "--batch-size", "4", "--out", out)
    assert code == 0, err
    return open_features(out)


def assert_same(got, expected):
    assert got.complete
    assert got.keys.tolist() == expected.keys.tolist()
    assert got.labels.tolist() == expected.labels.tolist()
    np.testing.assert_allclose(got.load("layer2"), expected.load("layer2"), rtol=0, atol=1e-5)


KILLED = [*COMMON, "--chunk-size", "3", "--batch-size", "3"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, many_shards):
    """A 2-rank job over the shards, one rank SIGKILLed once 6 chunks are done: the store, the
    launcher's exit status, and the store's status and done count after the kill."""
    out = tmp_path_factory.mktemp("killed") / "killed.zarr"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([*launcher(2), "extract", *KILLED, "--data", f"wds:{many_shards}", "--out", str(out)],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 300
    while not ((out / "done" / "c").is_dir() and len(os.listdir(out / "done" / "c")) >= 6):
        assert job.poll() is None, "finished before it could be killed; make the job longer"
        assert time.time() < deadline, "the job did not get going"
        time.sleep(0.02)
    ranks = [pid for pid in rank_pids(job.pid) if pid != job.pid]
    os.kill(ranks[-1], signal.SIGKILL)
    job.communicate(timeout=120)
    group = zarr.open_group(out, mode="r")
    return out, {"returncode": job.returncode, "status": group.attrs["status"], "finished": int(group["done"][:].sum())}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory, many_shards, killed):
    """One 3-rank launch for the module: a whole job over the shards, then the resume of the killed one."""
    folder = tmp_path_factory.mktemp("three")
    jobs = {
        "three": [*COMMON, "--data", f"wds:{many_shards}", "--chunk-size", "7", "--batch-size", "4",
                  "--out", folder / "three.zarr"],
        "resume": [*KILLED, "--data", f"wds:{many_shards}", "--out", killed[0]],
    }  # fmt: skip
    sequence = Sequence(3, jobs, folder)
    launch = sequence.run()
    return sequence, launch


def test_three_ranks_equal_one(cli, tmp_path, many_shards, three_ranks):
    expected = single_rank_store(cli, tmp_path, many_shards, 7)
    sequence, launch = three_ranks
    result = sequence.result("three")
    assert launch.returncode == 0 and result.codes == [0, 0, 0], launch.stderr[-3000:] + result.stderr[-3000:]
    got = open_features(sequence.folder / "three.zarr")
    assert_same(got, expected)
    assert got.attrs["runs"][-1]["world_size"] == 3


def test_sigkill_then_resume_with_another_number_of_ranks(cli, tmp_path, many_shards, killed, three_ranks):
    out, kill = killed
    assert kill["returncode"] != 0
    finished = kill["finished"]
    assert kill["status"] == "running" and 0 < finished < 40

    sequence, launch = three_ranks
    result = sequence.result("resume")
    assert launch.returncode == 0 and result.codes == [0, 0, 0], launch.stderr[-3000:] + result.stderr[-3000:]
    assert "using the shard index kept in" in result.stderr  # the resume did not rescan the shards
    assert f"{finished} of 40 chunks already done" in result.stderr
    assert_same(open_features(out), single_rank_store(cli, tmp_path, many_shards, 3))
