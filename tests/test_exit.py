"""How a run ends when something goes wrong: one line, the right exit status, no hang, no traceback."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, TINY, patience
from helpers.cli import RESNET_LAYER3, SMALL, one_line_error

# The disk fills at chunk 2; and each DataLoader worker holds a thread that never ends, as a decoding
# library's thread, or a lock inherited locked across fork, can: the worker then does not exit when
# torch asks it to, and only its parent's SIGTERM can end it.
FULL_DISK_WITH_STUCK_WORKERS = """
import sys, threading, time
import torch.utils.data._utils as loader_utils
loader_utils.MP_STATUS_CHECK_INTERVAL = 0.5  # torch joins each worker this long before terminate(): 5 s a worker
from extract.data.synthetic import SyntheticSource
from extract.store.store import FeatureStore

real_write, real_load, stuck = FeatureStore.write_chunk, SyntheticSource.load, []

def write_chunk(self, chunk, *rest):
    if chunk >= 2:
        raise OSError(28, "No space left on device")
    return real_write(self, chunk, *rest)

def load(self, index):
    if not stuck:
        stuck.append(threading.Thread(target=time.sleep, args=(3600,)))
        stuck[0].start()
    return real_load(self, index)

FeatureStore.write_chunk, SyntheticSource.load = write_chunk, load
from extract.cli.extract import main
sys.exit(main(sys.argv[1:]))
"""


def run_python(code: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS`` in its own session; once it stalls, its whole group is killed (workers too)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    out, err = patience.communicate(job, quiet=timeout, what="the job (hung at exit?)")
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


@pytest.mark.parametrize("workers", [1, 2])
def test_full_disk_with_loader_workers_exits_instead_of_hanging(tmp_path, workers):
    result = run_python(
        FULL_DISK_WITH_STUCK_WORKERS, *RESNET_LAYER3, "--num-workers", workers, "--data", "synthetic:400",
        "--chunk-size", "3", "--batch-size", "2", "--out", tmp_path / "full.zarr", timeout=240,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "No space left on device" in one_line_error(result.stderr), result.stderr[-3000:]


# The disk fills while the skeleton is built: the 21st object zarr writes fails, as on a full filesystem,
# while zarr's other writes of the same array are still queued on its event loop.
FULL_DISK_AT_CREATION = """
import errno, itertools, sys
import zarr.storage._local as local

real_put, calls = local._put, itertools.count()

def put(path, value, exclusive=False):
    if next(calls) >= 20:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_put(path, value, exclusive=exclusive)

local._put = put
from extract.cli.extract import main
sys.exit(main(sys.argv[1:]))
"""


def test_full_disk_at_creation_is_exactly_one_line_and_leaves_nothing(tmp_path):
    out = tmp_path / "full.zarr"
    result = run_python(
        FULL_DISK_AT_CREATION, "--model", f"{TINY}:dict_net", "--layers", "heads.conv", "--image-size", "32",
        "--num-workers", "0", "--data", "synthetic:400", "--chunk-size", "3", "--out", out, timeout=240,
    )  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.strip() and "NOTE" not in line]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"extract: error: --out {out}: cannot create the store (No space left on device)")
    assert os.listdir(tmp_path) == []  # no write of the failed creation lands after its scratch is removed


def _has_loaded(pid: int, library: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return library in maps.read()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="watches /proc/PID/maps for the imports")
@pytest.mark.parametrize("library", ["_multiarray_umath", "libtorch_cpu"])
def test_ctrl_c_during_the_imports_is_one_line_and_130(library):
    """SIGINT while numpy's or torch's extension is being loaded, before any handler of the job's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        [sys.executable, "-m", "extract", "--model", "resnet18", "--weights", "none", "--list-layers"],
        cwd=ROOT, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        while job.poll() is None and not _has_loaded(job.pid, library):
            time.sleep(0.002)
        job.send_signal(signal.SIGINT)
        _, err = patience.communicate(job, quiet=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        "extract: interrupted; rerun the same command to resume"
    ], err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--timeout", "nan"], "--timeout must be"),
        (["--timeout", "inf"], "--timeout must be"),
        (["--timeout", "1e300"], "--timeout must be"),
        (["--seed", str(2**70)], "--seed must be"),
        (["--out", ""], "--out is empty"),
        (["--out", "."], "is the current directory"),
        (["--data", "synthetic:99999999999999"], "memory"),
    ],
    ids=["timeout-nan", "timeout-inf", "timeout-1e300", "seed-2**70", "out-empty", "out-dot", "synthetic-huge"],
)
def test_inputs_that_cannot_work_are_one_line_and_2(cli, tmp_path, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(*SMALL, "--data", "synthetic:8", "--out", tmp_path / "s.zarr", *flags)
    assert code == 2 and message in one_line_error(err), err
    assert not (tmp_path / "s.zarr").exists() and os.listdir(tmp_path) == []
