"""jobs/slurm_multinode.sh under a real SLURM: a one-node cluster on loopback (tests/slurm/local_cluster.sh).

Skipped where SLURM is not installed (`apt-get install slurm-wlm munge`) or not running as root (slurmd
starts jobs as their user). Every job runs the shipped script, its #SBATCH lines overridden for a CPU
node, and its store is compared with a single-process run of the same job.
"""

import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import ROOT
from helpers.cli import chunks
from helpers.stores import assert_same_features

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HELPER = ROOT / "tests" / "slurm" / "local_cluster.sh"
SCRIPT = ROOT / "jobs" / "slurm_multinode.sh"
SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
MISSING = [name for name in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(name, path=SEARCH) is None]
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL"}

# Two CPU processes (fewer on a one-CPU machine): the node has `nproc` CPUs, --cpus-per-task sets the processes.
PROCESSES = min(2, len(os.sched_getaffinity(0)))


def cpu_node(processes: int = PROCESSES) -> list[str]:
    """sbatch flags overriding the script's #SBATCH lines (4 nodes, 8 GPUs, 64 CPUs, 12 h) for this node."""
    return ["--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={processes}", "--time=10"]


COMMON = ["--layers", "layer2", "layer4", "--pool", "avg", "--image-size", "32", "--num-workers", "0",
          "--dtype", "float32", "--chunk-size", "8", "--batch-size", "2"]  # fmt: skip
# Preemption tests: a model that sleeps EXTRACT_TEST_PACE seconds per batch runs long on idle CPUs.
PACED = [*COMMON, "--model", f"{ROOT / 'tests' / 'slurm' / 'paced_model.py'}:resnet18_paced", "--data", "synthetic:96"]
PACED_CHUNKS = 96 // 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, state: Path, env: dict[str, str]) -> None:
        self.state, self.env = state, env

    def __call__(self, *command: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env={**self.env, **env}, cwd=ROOT
        )
        assert result.returncode == 0, f"{shlex.join(command)}: {result.stderr}"
        return result

    def sbatch(self, *args: str, **env: str) -> str:
        return self("sbatch", "--parsable", *map(str, args), **env).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        return dict(re.findall(r"(\w+)=(\S*)", self("scontrol", "show", "job", "-o", job_id).stdout))

    def wait(self, job_id: str, timeout: float = 240) -> dict[str, str]:
        """The job's final record, once the node has cleaned up after it (its steps may outlive its
        batch script by seconds; a requeue before that is refused: "Job credential revoked")."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job_id)
            if info["JobState"] in FINAL and self("sinfo", "-h", "-o", "%T").stdout.strip() == "idle":
                return info
            time.sleep(0.3)
        self("scancel", "--full", job_id)
        raise AssertionError(f"job {job_id} still {info['JobState']} after {timeout} s: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"{p.name}: ...{p.read_text()[-1500:]}" for p in sorted((self.state / "log").glob("*.log")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if MISSING:
        pytest.skip(f"SLURM is not installed ({', '.join(MISSING)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (slurmd starts jobs as their user)")
    state = tmp_path_factory.mktemp("slurm")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(PATH=os.pathsep.join([str(Path(sys.executable).parent), SEARCH]), PYTHONPATH=str(ROOT))
    env.update(OMP_NUM_THREADS="1", SLURMCTLD_PORT=str(_free_port()), SLURMD_PORT=str(_free_port()))
    started = subprocess.run([HELPER, "start", state], env=env, capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stderr
        yield Cluster(state, {**env, "SLURM_CONF": str(state / "slurm.conf")})
    finally:
        subprocess.run([HELPER, "stop", state], env=env, capture_output=True, timeout=120)


def _reference(out: Path, *args: str) -> Path:
    """The same job in one process, in this one (torch is imported already)."""
    import torch

    from extract.cli.extract import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as fast, and much faster on a loaded machine
    try:
        assert main([*args, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def paced_reference(tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("ref") / "paced.zarr", *PACED)


def _done(out: Path) -> int:
    done = out / "done" / "c"
    return len(os.listdir(done)) if done.is_dir() else 0


def _wait_for_chunks(cluster: Cluster, job_id: str, out: Path, count: int, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while _done(out) < count:
        assert time.time() < deadline, f"no chunks after {timeout} s: {cluster.logs()}"
        state = cluster.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job_id} {state} early"
        time.sleep(0.1)


def _stopped_cleanly(out: Path, reference: Path) -> int:
    """The store of a stopped job: still running, some chunks done, each of them complete and right."""
    group, expected = zarr.open_group(out, mode="r"), zarr.open_group(reference, mode="r")
    done = group["done"][:]
    assert group.attrs["status"] == "running"
    assert 0 < done.sum() < len(done), f"stopped mid-run ({int(done.sum())} of {len(done)} chunks done)"
    for layer in ("layer2", "layer4"):
        got, want = group[f"features/{layer}"][:], expected[f"features/{layer}"][:]
        for chunk in np.flatnonzero(done):
            np.testing.assert_array_equal(got[chunk * 8 : chunk * 8 + 8], want[chunk * 8 : chunk * 8 + 8])
    assert not _lock(out).exists()
    return int(done.sum())


def _lock(out: Path) -> Path:
    import extract.store.lock

    # The reliability work moves the lock beside the store (lock_path); until then it is inside.
    return (
        extract.store.lock.lock_path(out)
        if hasattr(extract.store.lock, "lock_path")
        else out / extract.store.lock.LOCK_NAME
    )


def _seconds(clock: str) -> int:
    """SLURM's [D-]HH:MM:SS."""
    days, _, rest = clock.rpartition("-")
    h, m, s = map(int, rest.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


# ------------------------------------------------------------------------------------------------


def _dry_run(config: Path, nodelist: str, **env: str) -> list[tuple[str, list[str]]]:
    """What the script runs on each node, from its EXTRACT_SLURM_DRY_RUN output."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "GPUS_", "PROCESSES_"))}
    result = subprocess.run(
        ["bash", SCRIPT, "--data", "imagefolder:/data/my images", "--layers", "layer*"],
        env={**clean, "SLURM_CONF": str(config), "EXTRACT_SLURM_DRY_RUN": "1", "SLURM_JOB_NODELIST": nodelist, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    lines = []
    for line in result.stdout.splitlines():
        head, _, command = line.partition(":")
        lines.append((head, shlex.split(command)))
    return lines


def _flags(command: list[str]) -> dict[str, str | None]:
    """The launcher's flags (before `-m extract`) as {flag: value or None}."""
    assert command[:2] == ["accelerate", "launch"]
    launcher = command[2 : command.index("-m")]
    flags: dict[str, str | None] = {}
    for i, word in enumerate(launcher):
        if word.startswith("--"):
            following = launcher[i + 1] if i + 1 < len(launcher) else "--"
            flags[word] = None if following.startswith("--") else following
    return flags


@pytest.mark.skipif(shutil.which("scontrol", path=SEARCH) is None, reason="scontrol is not installed")
def test_launcher_arguments_for_several_nodes(tmp_path):
    """The multi-node arguments for a node list of several hosts (expanded by SLURM's own scontrol)."""
    subprocess.run([HELPER, "config", tmp_path], check=True, capture_output=True, timeout=30)
    config = tmp_path / "slurm.conf"

    nodes = _dry_run(config, "gpu[01-03],login7", SLURM_GPUS_PER_NODE="a100:8", SLURM_CPUS_PER_TASK="64",
                     SLURM_JOB_ID="1234")  # fmt: skip
    assert [head for head, _ in nodes] == ["node 0 gpu01", "node 1 gpu02", "node 2 gpu03", "node 3 login7"]
    for rank, (_, command) in enumerate(nodes):
        assert _flags(command) == {
            "--multi_gpu": None, "--num_processes": "32", "--num_machines": "4", "--main_process_ip": "gpu01",
            "--main_process_port": "21234", "--mixed_precision": "no", "--dynamo_backend": "no",
            "--num_cpu_threads_per_process": "8", "--machine_rank": str(rank),
        }  # fmt: skip
        assert command[command.index("-m") :] == ["-m", "extract", "--data", "imagefolder:/data/my images",
                                                   "--layers", "layer*"]  # fmt: skip

    # GPUS_PER_NODE overrides what SLURM allocated; on CPU nodes --cpus-per-task sets the processes.
    (_, command), *_ = _dry_run(config, "a[1-2]", SLURM_GPUS_PER_NODE="8", GPUS_PER_NODE="2")
    assert _flags(command)["--num_processes"] == "4"
    cpu = _dry_run(config, "cpu[7-8]", SLURM_GPUS_PER_NODE="0", SLURM_CPUS_PER_TASK="4")
    assert [_flags(c)["--num_processes"] for _, c in cpu] == ["8", "8"]
    assert _flags(cpu[1][1])["--num_cpu_threads_per_process"] == "1" and "--multi_gpu" in _flags(cpu[1][1])
    (_, command), *_ = _dry_run(config, "c1", GPUS_PER_NODE="0", SLURM_CPUS_PER_TASK="8", PROCESSES_PER_NODE="2")
    assert _flags(command)["--num_processes"] == "2" and _flags(command)["--num_cpu_threads_per_process"] == "4"
    # No GPUs and no --cpus-per-task: one process per node; a single process runs without a launcher.
    assert [_flags(c)["--num_processes"] for _, c in _dry_run(config, "c[1-3]")] == ["3", "3", "3"]
    assert _dry_run(config, "c1") == [
        ("node 0 c1", ["python", "-m", "extract", "--data", "imagefolder:/data/my images", "--layers", "layer*"])
    ]


def test_sbatch_the_shipped_script_on_a_cpu_node(cluster, tmp_path):
    args = [*COMMON, "--model", "resnet18", "--weights", "none", "--data", "synthetic:40"]
    expected = _reference(tmp_path / "single.zarr", *args)
    out, log = tmp_path / "slurm.zarr", tmp_path / "job.out"
    job_id = cluster.sbatch(*cpu_node(), f"--output={log}", SCRIPT, *args, "--out", out)
    info = cluster.wait(job_id)
    output = log.read_text()
    assert info["JobState"] == "COMPLETED", output[-3000:]
    assert f"1 node(s) x {PROCESSES} process(es)" in output
    assert "5 chunks written, 0 reused" in output
    assert_same_features(out, expected)
    assert zarr.open_group(out, mode="r").attrs["runs"][-1]["world_size"] == PROCESSES


def test_scancel_term_then_requeue_resumes(cluster, tmp_path, paced_reference):
    out, log = tmp_path / "preempted.zarr", tmp_path / "job.out"
    # --open-mode=append: the requeued run adds to the same log.
    job_id = cluster.sbatch(*cpu_node(), f"--output={log}", "--open-mode=append", SCRIPT, *PACED, "--out", out,
                            EXTRACT_TEST_PACE="0.1")  # fmt: skip
    _wait_for_chunks(cluster, job_id, out, 2)
    cluster("scancel", "--signal=TERM", job_id)  # to the job's steps: every process of the extraction
    info = cluster.wait(job_id, timeout=60)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "143:0", log.read_text()[-3000:]
    # Each rank gets SIGTERM from SLURM and again from its launcher; an echo within 2 s is the same
    # request, so it stops after its batch ("interrupted by SIGTERM: ..."). A later one would stop it at
    # once ("interrupted; ..."), which a loaded machine could cause: either way only complete chunks
    # are marked done.
    assert "rerun the same command to resume" in log.read_text()
    finished = _stopped_cleanly(out, paced_reference)

    # slurmd revoked the job's credential when it was killed, with a time in whole seconds: a requeued
    # run whose new credential bears the same second is refused ("Job credential revoked").
    time.sleep(2)
    cluster("scontrol", "requeue", job_id)
    cluster("scontrol", "update", f"JobId={job_id}", "StartTime=now")  # a requeued job waits 2 minutes
    info = cluster.wait(job_id)
    output = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", output[-3000:]
    assert f"{finished} of {PACED_CHUNKS} chunks already done" in output
    assert f"{chunks(PACED_CHUNKS - finished)} written, {finished} reused" in output
    assert_same_features(out, paced_reference)


def test_time_limit_signal_stops_the_job_in_time_and_a_resubmission_completes(cluster, tmp_path, paced_reference):
    out, log = tmp_path / "limited.zarr", tmp_path / "job.out"
    submit = [f"--output={log}", "--open-mode=append", SCRIPT, *PACED, "--out", out]
    # SLURM checks time limits every 30 s. To have the signal land mid-run, whatever the phase of those
    # checks, the limit is lowered once the extraction runs: the lead time (90 s) exceeds what is then
    # left, so SIGTERM comes at the next check (within 30 s), and the limit itself is still ahead.
    job_id = cluster.sbatch(*cpu_node(1), "--signal=TERM@90", *submit, EXTRACT_TEST_PACE="1")
    _wait_for_chunks(cluster, job_id, out, 1)
    elapsed = _seconds(cluster.job(job_id)["RunTime"])
    limit = math.ceil((elapsed + 40) / 60)
    cluster("scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit}")
    info = cluster.wait(job_id, timeout=120)
    output = log.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "143:0", output[-3000:]  # not TIMEOUT
    # One process runs without a launcher, so the signal reaches it once: it stops after its batch.
    assert "interrupted by SIGTERM" in output
    assert _seconds(info["RunTime"]) < limit * 60, "stopped before the limit"
    # slurmstepd logs when it signals the step; the job ended seconds later, well within the lead time.
    signalled = re.search(r"STEP \S+ ON \S+ CANCELLED AT (\S+) \*\*\*", output)
    assert signalled, output[-3000:]
    grace = datetime.fromisoformat(info["EndTime"]) - datetime.fromisoformat(signalled[1])
    assert grace.total_seconds() < 30
    finished = _stopped_cleanly(out, paced_reference)
    assert f"interrupted by SIGTERM: {chunks(finished)} written and marked done" in output

    job_id = cluster.sbatch(*cpu_node(1), *submit)
    info = cluster.wait(job_id)
    output = log.read_text()
    assert info["JobState"] == "COMPLETED", output[-3000:]
    assert f"{chunks(PACED_CHUNKS - finished)} written, {finished} reused" in output
    assert_same_features(out, paced_reference)
