"""The CLI as the tests run it (in a subprocess, as a user does), the argument lists many tests share,
and the check that a refused run said so in one line."""

import os
import subprocess
import sys
from collections.abc import Sequence

from . import ROOT, TINY, patience

# resnet18 with random weights on 32-pixel images: a forward costs little, and nothing is downloaded
RESNET18 = ["--model", "resnet18", "--weights", "none", "--image-size", "32"]
# its layer3, average-pooled, in float32; add --num-workers (tests of DataLoader workers choose theirs)
RESNET_LAYER3 = [*RESNET18, "--layers", "layer3", "--pool", "avg", "--dtype", "float32"]
# the small job of most tests, in the main process (no DataLoader workers to start)
SMALL = [*RESNET_LAYER3, "--num-workers", "0"]
# a whole job on the tiny dict_net: 48 synthetic images in 12 chunks of 4 (many points to kill a run at)
TINY_JOB = ["--model", f"{TINY}:dict_net", "--layers", "heads.conv", "--image-size", "32", "--num-workers", "0",
            "--dtype", "float32", "--data", "synthetic:48", "--chunk-size", "4", "--batch-size", "4"]  # fmt: skip
# paced_by_seed: two jobs that differ only in --seed store different features (add --data and --seed)
SEEDED = ["--model", f"{TINY}:paced_by_seed", "--layers", "conv", "--image-size", "32", "--num-workers", "0",
          "--dtype", "float32", "--chunk-size", "4", "--batch-size", "4"]  # fmt: skip
# the lock's heartbeat and stale age, shortened: a lost lock is found within seconds
FAST_LOCK = {"EXTRACT_LOCK_HEARTBEAT": "0.2", "EXTRACT_LOCK_STALE_AFTER": "1"}


def run_cli(
    *args: object, env: dict[str, str] | None = None, timeout: float = 300, launcher: Sequence[str] | None = None
) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, as a user runs it; returns the CompletedProcess. ``timeout`` is what it may
    take on a quiet machine: it runs on while it makes progress (``patience``), up to a multiple of that."""
    command = [*(launcher or [sys.executable, "-m"]), "extract", *map(str, args)]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return patience.run(command, quiet=timeout, capture_output=True, text=True, env=full_env, cwd=ROOT)


def one_line_error(err: str) -> str:
    """The one ``extract: error`` line of a refused run's stderr (no traceback, no second error line)."""
    lines = [line for line in err.strip().splitlines() if line.startswith("extract: error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def chunks(count: int) -> str:
    """``N chunks`` as the job's summary and interruption lines say it (``1 chunk``)."""
    return f"{count} chunk{'s' if count != 1 else ''}"
