import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from faultproxy import fault_proxy  # noqa: F401  (fixture: a fault-injecting proxy in front of the S3 server)
from PIL import Image
from s3 import s3, s3_server, s3_top  # noqa: F401  (fixtures: moto's S3 server on loopback, a prefix, a bucket's top)

ROOT = Path(__file__).resolve().parent.parent
TINY = Path(__file__).resolve().parent / "tiny_models.py"

# One intra-op thread: the suite's processes share 2 cores, and OpenMP threads spin while a sibling
# waits to be scheduled: a resnet18 run of 160 images took 15-45 s with 2 threads on a busy machine, 2.5 s with 1.
torch.set_num_threads(1)


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, launcher: list[str] | None = None):
    """The CLI in a subprocess, as a user runs it; returns the CompletedProcess."""
    command = [*(launcher or [sys.executable, "-m"]), "extract", *map(str, args)]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


@pytest.fixture
def cli(capsys):
    """The CLI in this process (fast: torch is imported once); returns (exit code, stdout, stderr)."""
    from extract.cli.extract import main

    def call(*args: str):
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return call


def make_png_tree(root: Path, classes: dict[str, int], seed: int = 0) -> list[tuple[Path, int]]:
    """ImageFolder layout ROOT/CLASS/N.png with random RGB images of varied sizes."""
    rng = np.random.default_rng(seed)
    files = []
    for label, (name, count) in enumerate(sorted(classes.items())):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            h, w = rng.integers(36, 56, size=2)
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            path = root / name / f"{i:03d}.png"
            Image.fromarray(pixels).save(path)
            files.append((path, label))
    return files


@pytest.fixture(scope="session")
def png_tree(tmp_path_factory) -> tuple[Path, list[tuple[Path, int]]]:
    root = tmp_path_factory.mktemp("images")
    return root, make_png_tree(root, {"cat": 7, "dog": 6})
