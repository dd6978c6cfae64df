#!/usr/bin/env bash
# The CUDA tests as the GPU check runs them: bash benchmarks/cuda_tests.sh TEST_FILE... [PYTEST_ARGS...]
#
# Without pytest-xdist (the GPU machine's wheels need not carry it): pyproject's addopts (-n auto, and
# -m 'not cuda') are replaced; and without a CUDA device the run fails (exit 3, one line saying so:
# tests/conftest.py) instead of skipping every test and exiting 0.
set -uo pipefail
cd "$(dirname "$0")/.."
export EXTRACT_REQUIRE_CUDA="${EXTRACT_REQUIRE_CUDA:-1}"  # 0: the dry run (collects only)
exec "${PY:-${PYTHON:-python}}" -m pytest -p no:xdist -p no:cacheprovider -o addopts="" -m cuda -q -rs "$@"
