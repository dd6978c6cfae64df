"""Run by ``launches.Sequence`` (under ``accelerate launch``, or as one plain process): the extract jobs
of the JSON file PLAN (``{"dir": DIR, "jobs": {NAME: [ARG, ...]}, "env": {NAME: {VAR: VALUE}}}``) one
after another in the same process, as a script that calls extract's ``main`` several times would (a
job's variables are set for it alone: only those read at run time take effect). Each process writes
job NAME's stdout and stderr to DIR/NAME.rank<R>.out and .err and, once the job is over, its exit status to
DIR/NAME.rank<R>.code (R is the rank; 0 without a launcher).

With EXTRACT_TEST_WRITES=LOG_DIR in the environment, each process also lists every file it writes (the
target of each rename, zarr's atomic write, and each file opened for writing) in LOG_DIR/writes.rank<R>:
who wrote what, seen by the interpreter's audit hooks rather than by extract."""

import json
import os
import sys
from pathlib import Path

from extract.cli.extract import main

plan = json.loads(Path(sys.argv[1]).read_text())
folder, rank = Path(plan["dir"]), os.environ.get("RANK", "0")


def _audit_writes(log_dir: str) -> None:
    log = os.open(Path(log_dir) / f"writes.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def hook(event: str, args: tuple) -> None:
        if event == "os.rename" or event == "os.link":
            target = args[1]
        elif event == "open" and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
            target = args[0]
        else:
            return
        if isinstance(target, (str, bytes, os.PathLike)):
            os.write(log, os.fsencode(target) + b"\n")

    sys.addaudithook(hook)


if os.environ.get("EXTRACT_TEST_WRITES"):
    _audit_writes(os.environ["EXTRACT_TEST_WRITES"])
for name, args in plan["jobs"].items():
    before = dict(os.environ)
    os.environ.update(plan["env"].get(name, {}))
    for stream, suffix in ((sys.stdout, "out"), (sys.stderr, "err")):
        # the job's lines, also those of loggers that hold sys.stderr, go to files of its own
        stream.flush()
        file = os.open(folder / f"{name}.rank{rank}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, stream.fileno())
        os.close(file)
    code = main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    (folder / f"{name}.rank{rank}.code").write_text(str(code))
    os.environ.clear()
    os.environ.update(before)
