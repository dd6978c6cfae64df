"""Multi-process runs under `accelerate launch` on CPU (gloo), in subprocesses: exactly once, resume."""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr
from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow

COMMON = ["--model", "resnet18", "--weights", "none", "--layers", "layer2", "layer4", "--pool", "avg",
          "--image-size", "32", "--num-workers", "0", "--dtype", "float32"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(processes: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu" if processes > 1 else "--cpu",
        "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), *extra, "-m",
    ]  # fmt: skip


def single_process_store(cli, tmp_path, n, chunk, batch):
    out = tmp_path / f"single-{n}-{chunk}.zarr"
    code, _, err = cli(*COMMON, "--data", f"synthetic:{n}", "--chunk-size", chunk, "--batch-size", batch, "--out", out)
    assert code == 0, err
    return out


def assert_same_store(got, expected):
    a, b = zarr.open_group(got, mode="r"), zarr.open_group(expected, mode="r")
    assert a.attrs["status"] == "complete"
    assert a.attrs["fingerprint"] == b.attrs["fingerprint"]
    for layer in ("layer2", "layer4"):
        x, y = a[f"features/{layer}"][:], b[f"features/{layer}"][:]
        assert not np.isnan(x).any(), "every sample present"
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(a["labels"][:], b["labels"][:])
    assert a["done"][:].all()


@pytest.mark.parametrize(
    "processes, n, chunk, batch",
    [
        (1, 1, 4, 3),  # N = 1
        (2, 13, 4, 3),  # N not divisible by C, batches straddle chunks
        (3, 5, 4, 2),  # K = 2 < P = 3: one rank idle
        (3, 17, 4, 4),  # N = K*C + 1
        (2, 3, 8, 2),  # N < C
    ],
)
def test_ranks_share_the_work_exactly_once(cli, tmp_path, processes, n, chunk, batch):
    expected = single_process_store(cli, tmp_path, n, chunk, batch)
    out = tmp_path / "multi.zarr"
    result = run_cli(
        *COMMON,
        "--data",
        f"synthetic:{n}",
        "--chunk-size",
        chunk,
        "--batch-size",
        batch,
        "--out",
        out,
        launcher=launcher(processes),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_store(out, expected)
    run = zarr.open_group(out, mode="r").attrs["runs"][-1]
    num_chunks = -(-n // chunk)
    assert run["world_size"] == processes
    assert len(run["chunks_per_rank"]) == processes and sum(run["chunks_per_rank"]) == num_chunks
    assert max(run["chunks_per_rank"]) - min(run["chunks_per_rank"]) <= 1
    assert sum(c > 0 for c in run["chunks_per_rank"]) == min(processes, num_chunks)
    assert run["status"] == "complete" and run["seconds"] > 0 and len(run["hostnames"]) == processes
    assert f"{n} samples" in result.stderr


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
    outputs = [m.communicate(timeout=300) for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert_same_store(out, expected)
    run = zarr.open_group(out, mode="r").attrs["runs"][-1]
    assert run["world_size"] == 2 and run["chunks_per_rank"] == [3, 3]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _rank_pids(launcher_pid: int) -> list[int]:
    pids = []
    for pid in _descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"extract" in f.read() and pid != launcher_pid:
                    pids.append(pid)
        except OSError:
            continue
    return pids


def test_sigkill_a_rank_then_resume(cli, tmp_path):
    n, chunk, batch = 160, 4, 4
    args = [*COMMON, "--data", f"synthetic:{n}", "--chunk-size", str(chunk), "--batch-size", str(batch)]
    out = tmp_path / "killed.zarr"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        [*launcher(2), "extract", *args, "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    done_dir = out / "done" / "c"
    while time.time() < deadline:
        if done_dir.is_dir() and len(os.listdir(done_dir)) >= 6:
            break
        assert job.poll() is None, "finished before it could be killed; make the job longer"
        time.sleep(0.05)
    ranks = [pid for pid in _rank_pids(job.pid) if pid != job.pid]
    assert ranks, "no rank processes found"
    os.kill(ranks[-1], signal.SIGKILL)
    job.communicate(timeout=120)
    assert job.returncode != 0
    group = zarr.open_group(out, mode="r")
    finished = int(group["done"][:].sum())
    assert group.attrs["status"] == "running" and 0 < finished < n // chunk

    result = run_cli(*args, "--out", out, launcher=launcher(3))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{finished} of {n // chunk} chunks already done" in result.stderr
    assert f"{n // chunk - finished} chunks written, {finished} reused" in result.stderr
    runs = zarr.open_group(out, mode="r").attrs["runs"]
    assert len(runs) == 2 and runs[0]["status"] in ("interrupted", "killed") and runs[1]["world_size"] == 3
    assert sum(runs[1]["chunks_per_rank"]) == n // chunk - finished
    expected = single_process_store(cli, tmp_path, n, chunk, batch)
    assert_same_store(out, expected)


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
