"""Multi-process runs under `accelerate launch` on CPU (gloo), in subprocesses: exactly once, resume; and
tar shards with several ranks (the index split across ranks, every sample exactly once, a resume after
SIGKILL with another number of ranks that reuses the index kept in the store). One 2-rank launch and one
3-rank launch serve the module: starting one costs more than its small jobs."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import zarr
from helpers import ROOT, patience
from helpers.cli import chunks as chunks_text
from helpers.cli import run_cli
from helpers.data_files import write_shards
from helpers.launches import Sequence, free_port, launcher, rank_pids
from helpers.stores import assert_same_features

from extract import open_features

pytestmark = pytest.mark.slow

COMMON = ["--model", "resnet18", "--weights", "none", "--layers", "layer2", "layer4", "--pool", "avg",
          "--image-size", "32", "--num-workers", "0", "--dtype", "float32"]  # fmt: skip


def single_process_store(cli, tmp_path, n, chunk, batch):
    out = tmp_path / f"single-{n}-{chunk}.zarr"
    code, _, err = cli(*COMMON, "--data", f"synthetic:{n}", "--chunk-size", chunk, "--batch-size", batch, "--out", out)
    assert code == 0, err
    return out


CASES = [
    (1, 1, 4, 3),  # N = 1
    (2, 13, 4, 3),  # N not divisible by C, batches straddle chunks
    (3, 5, 4, 2),  # K = 2 < P = 3: one rank idle
    (3, 17, 4, 4),  # N = K*C + 1
    (2, 3, 8, 2),  # N < C
]
# The job a rank is killed in: tar shards, so that the resume also shows it reuses the shard index
KILLED_N, KILLED_CHUNK = 120, 3
SHARDS = [37, 5, 1, 50, 27]  # 120 samples; chunk 3 divides none of 37, 5, 1, 50


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    write_shards(root, SHARDS)
    return root


def killed_args(shards):
    return [*COMMON, "--data", f"wds:{shards}", "--chunk-size", KILLED_CHUNK, "--batch-size", KILLED_CHUNK]


def shards_args(shards):
    """The whole job over the shards that 3 ranks run (chunks of 7)."""
    return [*COMMON, "--data", f"wds:{shards}", "--chunk-size", "7", "--batch-size", "4"]


def case_args(n, chunk, batch):
    return [*COMMON, "--data", f"synthetic:{n}", "--chunk-size", chunk, "--batch-size", batch]


def case_name(processes, n, chunk, batch):
    return f"{processes}-{n}-{chunk}-{batch}"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, many_shards):
    """One launch of 2 ranks for the module: the 2-rank cases, then a longer job over the shards of which a
    rank is SIGKILLed once 6 chunks are done (resumed by ``three_ranks``). Returns the sequence and what
    the kill left: the launcher's exit status and the store's status and done count."""
    folder = tmp_path_factory.mktemp("two-ranks")
    jobs = {case_name(*case): [*case_args(*case[1:]), "--out", folder / f"{case_name(*case)}.zarr"]
            for case in CASES if case[0] == 2}  # fmt: skip
    killed = folder / "killed.zarr"
    sequence = Sequence(2, {**jobs, "killed": [*killed_args(many_shards), "--out", killed]}, folder)
    job = sequence.start()
    patience.while_running(lambda: (killed / "done" / "c").is_dir() and len(os.listdir(killed / "done" / "c")) >= 6,
                           "the launch's last job getting going", job, quiet=300)  # fmt: skip
    ranks = rank_pids(job.pid, program=b"job_sequence.py")
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    patience.communicate(job, quiet=120)
    group = zarr.open_group(killed, mode="r")
    kill = {"returncode": job.returncode, "status": group.attrs["status"], "finished": int(group["done"][:].sum())}
    return sequence, kill


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory, two_ranks, many_shards):
    """One launch of 3 ranks for the module: the 3-rank cases, the whole job over the shards, then the
    resume of the killed store."""
    folder = tmp_path_factory.mktemp("three-ranks")
    jobs = {case_name(*case): [*case_args(*case[1:]), "--out", folder / f"{case_name(*case)}.zarr"]
            for case in CASES if case[0] == 3}  # fmt: skip
    jobs["shards"] = [*shards_args(many_shards), "--out", folder / "shards.zarr"]
    jobs["resume"] = [*killed_args(many_shards), "--out", two_ranks[0].folder / "killed.zarr"]
    sequence = Sequence(3, jobs, folder)
    launch = sequence.run()
    return sequence, launch.returncode, launch.stderr


def launched(request, processes, n, chunk, batch):
    """(exit statuses: the launch's where it ended with this job, then each rank's; the job's stderr;
    its store) for one case."""
    name = case_name(processes, n, chunk, batch)
    if processes == 1:
        out = request.getfixturevalue("tmp_path") / "multi.zarr"
        result = run_cli(*case_args(n, chunk, batch), "--out", out, launcher=launcher(1))
        return [result.returncode], result.stderr, out
    if processes == 2:  # the launch itself ends with the kill of its last job
        (sequence, _), statuses = request.getfixturevalue("two_ranks"), []
    else:
        sequence, returncode, _ = request.getfixturevalue("three_ranks")
        statuses = [returncode]
    job = sequence.result(name)
    return [*statuses, *job.codes], job.stderr, sequence.folder / f"{name}.zarr"


@pytest.mark.parametrize("processes, n, chunk, batch", CASES)
def test_ranks_share_the_work_exactly_once(cli, tmp_path, request, processes, n, chunk, batch):
    expected = single_process_store(cli, tmp_path, n, chunk, batch)
    statuses, stderr, out = launched(request, processes, n, chunk, batch)
    assert set(statuses) == {0}, stderr[-3000:]
    assert_same_features(out, expected)
    run = zarr.open_group(out, mode="r").attrs["runs"][-1]
    num_chunks = -(-n // chunk)
    assert run["world_size"] == processes
    assert len(run["chunks_per_rank"]) == processes and sum(run["chunks_per_rank"]) == num_chunks
    assert max(run["chunks_per_rank"]) - min(run["chunks_per_rank"]) <= 1
    assert sum(c > 0 for c in run["chunks_per_rank"]) == min(processes, num_chunks)
    assert run["status"] == "complete" and run["seconds"] > 0 and len(run["hostnames"]) == processes
    assert f"{n} samples" in stderr


def test_two_machines_on_loopback(cli, tmp_path):
    expected = single_process_store(cli, tmp_path, 11, 2, 2)
    out = tmp_path / "two-machines.zarr"
    port = str(free_port())
    machines = []
    for rank in (0, 1):
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
            "--main_process_port", port, "--mixed_precision", "no", "--dynamo_backend", "no",
            "-m", "extract", *COMMON, "--data", "synthetic:11", "--chunk-size", "2", "--batch-size", "2",
            "--out", str(out),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        machines.append(
            subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [patience.communicate(m, quiet=300) for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert_same_features(out, expected)
    run = zarr.open_group(out, mode="r").attrs["runs"][-1]
    assert run["world_size"] == 2 and run["chunks_per_rank"] == [3, 3]


def shards_store(cli, tmp_path, *args):
    """The job ``args`` in this process, into a store of its own."""
    out = tmp_path / "single-shards.zarr"
    code, _, err = cli(*args, "--out", out)
    assert code == 0, err
    return out


def assert_same_samples(got, expected):
    """The same keys and labels in the same order, and the same features, as the single-process store."""
    assert got.complete
    assert got.keys.tolist() == expected.keys.tolist()
    assert got.labels.tolist() == expected.labels.tolist()
    np.testing.assert_allclose(got.load("layer2"), expected.load("layer2"), rtol=0, atol=1e-5)


def test_three_ranks_over_shards_equal_one(cli, tmp_path, many_shards, three_ranks):
    expected = shards_store(cli, tmp_path, *shards_args(many_shards))
    sequence, returncode, stderr = three_ranks
    result = sequence.result("shards")
    assert returncode == 0 and result.codes == [0, 0, 0], stderr[-3000:] + result.stderr[-3000:]
    got = open_features(sequence.folder / "shards.zarr")
    assert_same_samples(got, open_features(expected))
    assert got.attrs["runs"][-1]["world_size"] == 3


def test_sigkill_a_rank_then_resume_with_another_number_of_ranks(cli, tmp_path, many_shards, two_ranks, three_ranks):
    """A rank of a 2-rank job over the shards SIGKILLed after 6 done chunks (in ``two_ranks``), then the
    same job resumed by 3 ranks (in ``three_ranks``), reusing the shard index the store keeps."""
    chunks = KILLED_N // KILLED_CHUNK
    sequence, kill = two_ranks
    assert kill["returncode"] != 0
    finished = kill["finished"]
    assert kill["status"] == "running" and 0 < finished < chunks

    resumed, returncode, stderr = three_ranks
    result = resumed.result("resume")
    assert returncode == 0 and result.codes == [0, 0, 0], stderr[-3000:] + result.stderr[-3000:]
    assert "using the shard index kept in" in result.stderr  # the resume did not rescan the shards
    assert f"{finished} of {chunks} chunks already done" in result.stderr
    assert f"{chunks_text(chunks - finished)} written, {finished} reused" in result.stderr
    out = sequence.folder / "killed.zarr"
    runs = zarr.open_group(out, mode="r").attrs["runs"]
    assert len(runs) == 2 and runs[0]["status"] in ("interrupted", "killed") and runs[1]["world_size"] == 3
    assert sum(runs[1]["chunks_per_rank"]) == chunks - finished
    expected = shards_store(cli, tmp_path, *killed_args(many_shards))
    assert_same_features(out, expected)
    assert_same_samples(open_features(out), open_features(expected))


def test_mismatched_rerun_is_refused_and_overwrite_starts_afresh(cli, tmp_path):
    out = tmp_path / "job.zarr"
    base = [*COMMON, "--data", "synthetic:6", "--chunk-size", "4", "--out", out]
    assert cli(*base)[0] == 0
    before = (out / "zarr.json").read_text()
    for change, field in (
        (["--model", "resnet34"], "model"),
        (["--pool", "max"], "pool"),
        (["--layers", "layer3"], "layers"),
        (["--data", "synthetic:7"], "data"),
        (["--dtype", "float16"], "dtype"),
        (["--chunk-size", "2"], "chunk_size"),
        (["--image-size", "40"], "preprocessing"),
        (["--seed", "1"], "weights"),
        (["--precision", "bf16"], "precision"),
    ):
        code, _, err = cli(*base, *change)
        assert code == 2, change
        assert "holds a different job" in err and f"differs in: {field}" in err and "--overwrite" in err
        assert len(err.strip().splitlines()) == 1
        assert (out / "zarr.json").read_text() == before, "a refused run must not touch the store"
    code, _, err = cli(*base)
    assert code == 0 and "already complete" in err
    code, _, err = cli(*base, "--pool", "max", "--overwrite")
    assert code == 0, err
    group = zarr.open_group(out, mode="r")
    assert group.attrs["pool"] == "max" and len(group.attrs["runs"]) == 1 and group["done"][:].all()
