"""Several processes, one job: one message for the job, no traceback, the launcher's exit status, and
no rank outliving its launcher (issue 17, items 17, 18 and 26). Three launches in all; the rest runs
ranks without a launcher, with the environment one would give them."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr
from helpers import ROOT, TINY, patience
from helpers.cli import run_cli
from helpers.forked import fork_run
from helpers.launches import environment, free_port, launcher, rank_pids

PACED = ["--model", f"{TINY}:paced_net", "--layers", "conv", "--image-size", "32", "--num-workers", "0",
         "--dtype", "float32", "--data", "synthetic:640", "--chunk-size", "16", "--batch-size", "16"]  # fmt: skip


def _launch(args, *launcher_options, pace: float = 0.1) -> subprocess.Popen:
    """A 2-rank job under ``accelerate launch``, in a session of its own (as a terminal's foreground job)."""
    return subprocess.Popen(
        [*launcher(2, *launcher_options), "extract", *map(str, args)], cwd=ROOT,
        env={**environment(), "TINY_PACE": str(pace)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return alive


def _lines(err: str, start: str) -> list[str]:
    return [line for line in err.replace("\r", "\n").splitlines() if line.startswith(start)]


@pytest.mark.slow
def test_two_ranks_give_one_error_line_and_no_launcher_traceback(tmp_path):
    """A bad --layers under 2 ranks: rank 0's line alone; ``--quiet`` drops accelerate's traceback, and
    the launcher exits 1 for any failed rank (docs/distributed.md: torch elastic's ChildFailedError), each rank 2."""
    job = _launch([*PACED, "--layers", "nope", "--out", tmp_path / "bad.zarr"], "--quiet", pace=0)
    _, err = patience.communicate(job, quiet=300)
    assert job.returncode == 1, err[-3000:]
    lines = _lines(err, "extract: error")
    assert len(lines) == 1 and "'nope' matches no module" in lines[0], err[-3000:]
    assert "Traceback" not in err and "exitcode  : 2" in err, err[-3000:]
    assert not (tmp_path / "bad.zarr").exists()


@pytest.mark.slow
def test_sigint_to_every_process_is_one_interrupted_line_and_the_rerun_completes(tmp_path):
    """Ctrl-C reaches the launcher, which forwards it; the trial also signalled every rank itself. One
    line (rank 0's, with the job's count), no traceback, exit 130, the run recorded as interrupted."""
    out = tmp_path / "int.zarr"
    job = _launch([*PACED, "--out", out])
    patience.while_running(
        lambda: (out / "done" / "c").is_dir() and len(os.listdir(out / "done" / "c")) >= 4, "4 chunks", job, quiet=240
    )
    ranks = rank_pids(job.pid)
    os.killpg(job.pid, signal.SIGINT)
    for pid in ranks:
        os.kill(pid, signal.SIGINT)
    _, err = patience.communicate(job, quiet=120)
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    lines = _lines(err, "extract: interrupted")
    assert len(lines) == 1 and lines[0].startswith("extract: interrupted by SIGINT: "), err[-3000:]
    group = zarr.open_group(out, mode="r")
    done = int(group["done"][:].sum())
    assert 4 <= done < 40 and "of 40 left" in lines[0]
    assert [run["status"] for run in group.attrs["runs"]] == ["interrupted"]

    assert fork_run([*PACED, "--out", out]) == 0
    expected = tmp_path / "expected.zarr"
    assert fork_run([*PACED, "--out", expected]) == 0
    a, b = zarr.open_group(out, mode="r"), zarr.open_group(expected, mode="r")
    assert a.attrs["status"] == "complete" and [run["status"] for run in a.attrs["runs"]] == ["interrupted", "complete"]
    for name in ("features/conv", "labels", "valid"):
        np.testing.assert_array_equal(a[name][:], b[name][:])


@pytest.mark.slow
def test_ranks_die_with_a_launcher_killed_during_their_start_up(tmp_path):
    """SIGKILL of the launcher alone, as soon as its ranks exist (they are still importing, before any
    handler of ours): the kernel's parent-death signal ends every rank within seconds."""
    job = _launch([*PACED, "--out", tmp_path / "orphan.zarr"])
    patience.while_running(lambda: len(rank_pids(job.pid)) >= 2, "the launch's 2 ranks", job, quiet=120, pause=0.005)
    ranks = rank_pids(job.pid)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    # a rank that outlives its launcher runs on (and uses CPU): only the ceiling, a multiple of 20 s, ends the wait
    deadline = time.time() + patience.ceiling(20)
    while _alive(ranks) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(ranks), f"ranks {_alive(ranks)} outlived their launcher"


ORPHAN = """
import os, subprocess, sys
env = {**os.environ, **({"TORCHELASTIC_RUN_ID": "t", "RANK": "1"} if sys.argv[2] == "launched" else {})}
with open(sys.argv[1], "w") as err:
    rank = subprocess.Popen([sys.executable, "-m", "extract", "--help"], stdout=subprocess.DEVNULL, stderr=err, env=env,
                            start_new_session=True)
print(rank.pid, flush=True)
os._exit(0)  # gone before the child has started its interpreter
"""


def _orphan(tmp_path, how: str) -> str:
    """``extract --help`` started by a parent that exits at once; the child's stderr once it has ended."""
    err = tmp_path / f"{how}.err"
    parent = subprocess.run([sys.executable, "-c", ORPHAN, str(err), how], capture_output=True, text=True,
                            env=environment(), check=True)  # fmt: skip
    child = int(parent.stdout)
    # its interpreter starts, then it exits: as long as that takes on a busy machine, while it uses CPU
    patience.until(lambda: not _alive([child]), "the orphan's exit", [child], quiet=20, pause=0.05)
    return err.read_text()


def test_a_rank_whose_launcher_is_already_gone_exits_at_once_with_one_line(tmp_path):
    err = _orphan(tmp_path, "launched")
    assert re.fullmatch(r"extract: rank 1 stops: its launcher is gone \(its parent is now pid \d+\)\n", err), err


def test_a_plain_process_whose_parent_is_gone_is_left_alone(tmp_path):
    """No launcher: ``nohup`` orphans a process on purpose, so it runs on (here: prints its help)."""
    assert _orphan(tmp_path, "plain") == ""


def test_a_rendezvous_nobody_answers_is_one_line_naming_the_port(tmp_path):
    """A rank of a 2-process job whose rank 0 is not there (or is another job's) fails to connect: one
    line naming the port and the likely cause, exit 1, no Python traceback."""
    port = free_port()
    env = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    result = run_cli(*PACED, "--out", tmp_path / "r.zarr", "--timeout", "1", env=env)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = _lines(result.stderr, "extract: error")
    assert len(lines) == 1 and f"MASTER_PORT {port}" in lines[0] and "--main_process_port" in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "r.zarr").exists()


def test_a_rendezvous_port_in_use_is_one_line_naming_it(tmp_path):
    """Rank 0 hosts the rendezvous where no launcher's agent does (srun, ranks started by hand); another
    process listens on its port: one line saying so and naming --main_process_port, exit 1, no traceback."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}  # fmt: skip
        result = run_cli(*PACED, "--out", tmp_path / "r.zarr", "--timeout", "5", env=env)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = _lines(result.stderr, "extract: error")
    assert len(lines) == 1 and f"MASTER_PORT {port} is already in use" in lines[0], result.stderr[-3000:]
    assert "--main_process_port" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "r.zarr").exists()


def test_signals_after_an_interrupt_do_not_replace_it():
    """A double Ctrl-C with the launcher's closing SIGTERM on top: the second SIGINT stops at once, and
    what follows cannot raise again while the run's record is closed (it said "0 chunks", "running")."""
    from extract.job.interrupt import Interrupted, StopRequests

    with StopRequests() as stop:
        stop.defer()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher closing its ranks: an echo
        assert stop.signum == signal.SIGINT
        with pytest.raises(Interrupted) as raised:
            os.kill(os.getpid(), signal.SIGINT)
        assert raised.value.signum == signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)  # ignored: the process is on its way out
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
