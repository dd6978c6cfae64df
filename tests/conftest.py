"""The suite's fixtures; what they are made of lives in ``helpers/``."""

from pathlib import Path

import pytest
import torch
from helpers.data_files import make_png_tree
from helpers.faultproxy import fault_proxy  # noqa: F401  (fixture: a fault-injecting proxy in front of the S3 server)
from helpers.s3 import s3, s3_server, s3_top  # noqa: F401  (fixtures: moto's S3 server on loopback, a prefix, a bucket's top)

# One intra-op thread: the suite's processes share 2 cores, and OpenMP threads spin while a sibling
# waits to be scheduled: a resnet18 run of 160 images took 15-45 s with 2 threads on a busy machine, 2.5 s with 1.
torch.set_num_threads(1)


@pytest.fixture
def cli(capsys):
    """The CLI in this process (fast: torch is imported once); returns (exit code, stdout, stderr)."""
    from extract.cli.extract import main

    def call(*args: object) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return call


@pytest.fixture(scope="session")
def png_tree(tmp_path_factory) -> tuple[Path, list[tuple[Path, int]]]:
    """An ImageFolder tree of 13 PNGs in 2 classes, made once for the session."""
    root = tmp_path_factory.mktemp("images")
    return root, make_png_tree(root, {"cat": 7, "dog": 6})


def pytest_configure(config):
    """``EXTRACT_REQUIRE_CUDA=1`` (benchmarks/cuda_tests.sh, the GPU check's test runs): no CUDA device is an
    error, never a run whose every test skipped and which exits 0 as if the GPU had been checked."""
    import os

    if os.environ.get("EXTRACT_REQUIRE_CUDA") == "1" and not torch.cuda.is_available():
        pytest.exit(
            "EXTRACT_REQUIRE_CUDA=1 but torch.cuda.is_available() is False: no CUDA device here, nothing of the "
            f"GPU paths would be checked (torch {torch.__version__}, built with CUDA {torch.version.cuda})",
            returncode=3,
        )
