"""Run by ``launches.Sequence`` (under ``accelerate launch``, or as one plain process): the extract jobs
of the JSON file PLAN (``{"dir": DIR, "jobs": {NAME: [ARG, ...]}, "env": {NAME: {VAR: VALUE}}}``) one
after another in the same process, as a script that calls extract's ``main`` several times would (a
job's variables are set for it alone: only those read at run time take effect). Each process writes
job NAME's stdout and stderr to DIR/NAME.rank<R>.out and .err and, once the job is over, its exit status to
DIR/NAME.rank<R>.code (R is the rank; 0 without a launcher)."""

import json
import os
import sys
from pathlib import Path

from extract.cli.extract import main

plan = json.loads(Path(sys.argv[1]).read_text())
folder, rank = Path(plan["dir"]), os.environ.get("RANK", "0")
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
