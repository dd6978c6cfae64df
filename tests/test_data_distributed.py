"""Tar shards with several ranks: the index split across ranks, every sample exactly once, and a
resume after SIGKILL with another number of ranks that reuses the index kept in the store."""

import os
import signal
import subprocess
import time

import numpy as np
import pytest
import zarr
from conftest import ROOT, run_cli
from data_files import write_shards
from launches import launcher, rank_pids

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


def test_three_ranks_equal_one(cli, tmp_path, many_shards):
    expected = single_rank_store(cli, tmp_path, many_shards, 7)
    out = tmp_path / "three.zarr"
    result = run_cli(*COMMON, "--data", f"wds:{many_shards}", "--chunk-size", "7", "--batch-size", "4", "--out", out,
                     launcher=launcher(3))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    got = open_features(out)
    assert_same(got, expected)
    assert got.attrs["runs"][-1]["world_size"] == 3


def test_sigkill_then_resume_with_another_number_of_ranks(cli, tmp_path, many_shards):
    args = [*COMMON, "--data", f"wds:{many_shards}", "--chunk-size", "3", "--batch-size", "3"]
    out = tmp_path / "killed.zarr"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([*launcher(2), "extract", *args, "--out", str(out)], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline:
        if (out / "done" / "c").is_dir() and len(os.listdir(out / "done" / "c")) >= 6:
            break
        assert job.poll() is None, "finished before it could be killed; make the job longer"
        time.sleep(0.05)
    ranks = [pid for pid in rank_pids(job.pid) if pid != job.pid]
    os.kill(ranks[-1], signal.SIGKILL)
    job.communicate(timeout=120)
    assert job.returncode != 0
    group = zarr.open_group(out, mode="r")
    finished = int(group["done"][:].sum())
    assert group.attrs["status"] == "running" and 0 < finished < 40

    result = run_cli(*args, "--out", out, launcher=launcher(3))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "using the shard index kept in" in result.stderr  # the resume did not rescan the shards
    assert f"{finished} of 40 chunks already done" in result.stderr
    assert_same(open_features(out), single_rank_store(cli, tmp_path, many_shards, 3))
