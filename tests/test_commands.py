"""The command-line layer: one wrapper turns exceptions into one line and an exit status, and the
analysis commands (run as users run them, ``python -m extract.probe``) load none of the pipeline."""

import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT
from helpers.stores import array_store

from extract import ExtractError
from extract.cli.base import command


def test_an_extract_error_is_one_line_and_status_2(capsys):
    @command("extract.demo")
    def main(argv=None):
        raise ExtractError("store x.zarr is busy")

    assert main() == 2
    assert capsys.readouterr().err == "extract.demo: error: store x.zarr is busy\n"


def test_failures_go_to_the_first_matching_handler_and_the_rest_propagate(capsys):
    seen = []
    failures = {
        BrokenPipeError: lambda prog, e: seen.append(("pipe", prog)) or 0,
        OSError: lambda prog, e: seen.append(("os", prog)) or 1,
    }

    def raising(error):
        @command("extract.demo", failures)
        def main():
            raise error

        return main

    assert raising(BrokenPipeError())() == 0  # a BrokenPipeError is an OSError: order decides
    assert raising(FileNotFoundError("gone"))() == 1
    assert seen == [("pipe", "extract.demo"), ("os", "extract.demo")]
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        raising(ZeroDivisionError())()
    with pytest.raises(SystemExit):  # --help and argparse's own exits pass through
        raising(SystemExit(0))()
    assert capsys.readouterr().err == ""


# Runs the commands through their documented module names (the root entry points), then lists what
# of the extraction pipeline got imported: none of it.
COMMANDS = """
import runpy, sys
store, out = sys.argv[1:]

def run(module, *args):
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        assert e.code in (0, None), (module, args, e.code)

for module in ("extract.probe", "extract.compare", "extract.report", "extract.export"):
    run(module, "--help")
run("extract.probe", store, "--method", "knn")
run("extract.probe", store, "--solver", "sgd", "--epochs", "1", "--lrs", "0.1")
run("extract.compare", store, "--heatmap", out + ".png")
run("extract.report", store, "--out", out)
pipeline = ("extract.job", "extract.store.writer", "extract.store.lock", "extract.capture.staging",
            "extract.capture.setup", "extract.cli.extract", "extract.models", "extract.data")
print(sorted(m for m in sys.modules if m.startswith(pipeline)))
"""


def test_analysis_commands_do_not_load_the_extraction_pipeline(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 60)
    layers = {"a": rng.normal(size=(60, 8)).astype(np.float32), "b": rng.normal(size=(60, 4)).astype(np.float32)}
    store = array_store(tmp_path / "s.zarr", layers, labels, chunk_size=16)
    result = subprocess.run(
        [sys.executable, "-c", COMMANDS, str(store), str(tmp_path / "r.html")],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage: python -m extract.report" in result.stdout  # the root entry points ran the commands
    assert (tmp_path / "r.html").is_file() and (tmp_path / "r.html.png").is_file()
    assert result.stdout.splitlines()[-1] == "[]"


def _entry_point(capsys, *args: object) -> tuple[int, str, str]:
    """``extract ARGS`` through the console script's own ``main``, in this process: the commands that
    import torch cost seconds each in a subprocess. Returns (exit code, stdout, stderr)."""
    from extract.cli.startup import main

    handler = signal.getsignal(signal.SIGINT)
    try:
        code = main([str(a) for a in args])
    finally:
        signal.signal(signal.SIGINT, handler)  # the entry point's: a Ctrl-C would end pytest with os._exit
    out, err = capsys.readouterr()
    return code, out, err


def test_one_extract_command_with_subcommands(tmp_path, capsys):
    """``extract <command>``: each command behind one entry, with its own --help; flags alone still run a job
    (``accelerate launch -m extract --model ...``, as before), and ``extract.X`` modules still work. The
    entry point runs as users run it (a subprocess) where that is cheap, in this process where it imports torch."""
    from helpers.cli import run_cli

    listed = run_cli("--help")
    assert listed.returncode == 0
    for name in ("run", "list-layers", "verify", "probe", "compare", "report", "export"):
        assert f"\n  {name} " in listed.stdout, listed.stdout
    assert "--repair" in run_cli("verify", "--help").stdout
    out = tmp_path / "s.zarr"
    job = ["--model", "resnet18", "--weights", "none", "--layers", "layer4", "--pool", "avg", "--image-size", "32",
           "--data", "synthetic:8", "--num-workers", "0", "--out", str(out)]  # fmt: skip
    code, _, err = _entry_point(capsys, "run", *job)
    assert code == 0, err
    code, _, err = _entry_point(capsys, *job)  # flags alone: the same job, already complete
    assert code == 0 and "already complete" in err, err
    verified = run_cli("verify", str(out))
    assert verified.returncode == 0 and "done chunks are present" in verified.stdout, verified.stdout + verified.stderr
    modules = subprocess.run(
        [sys.executable, "-m", "extract.verify", str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert modules.stdout == verified.stdout
    code, layers, err = _entry_point(capsys, "list-layers", "--model", "resnet18")
    assert code == 0 and "layer4" in layers, err
    # not a command: read as run's arguments, refused in one line
    code, _, err = _entry_point(capsys, "verfy", str(out))
    assert code == 2 and "extract: error:" in err, err
