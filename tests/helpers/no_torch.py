"""Reading without torch (issue 46): a script run in a fresh interpreter, and the torch stack it imported."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import ROOT

TORCH = ("torch", "torchvision", "transformers")  # what a numpy reader must not pay for


def imported_by(script: str, **values: object) -> list[str]:
    """Which of ``TORCH`` a fresh interpreter imported running ``script`` (its asserts must hold), with
    each of ``values`` bound to its name first (paths, layer names: their ``repr``)."""
    bound = "".join(
        f"{name} = {(str(value) if isinstance(value, Path) else value)!r}\n" for name, value in values.items()
    )
    code = f"{bound}{textwrap.dedent(script)}\nimport sys\nprint(sorted(m for m in {TORCH!r} if m in sys.modules))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])
