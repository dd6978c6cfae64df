"""Run by ``launches.Sequence`` under ``accelerate launch ... tests/job_sequence.py PLAN``: the extract jobs
of the JSON file PLAN (``{"dir": DIR, "jobs": {NAME: [ARG, ...]}}``) one after another in the same
ranks, as a script that calls extract's ``main`` several times would. Each rank writes job NAME's
stderr to DIR/NAME.rank<R>.err and, once the job is over, its exit status to DIR/NAME.rank<R>.code."""

import json
import os
import sys
from pathlib import Path

from extract.cli.extract import main

plan = json.loads(Path(sys.argv[1]).read_text())
folder, rank = Path(plan["dir"]), os.environ["RANK"]
for name, args in plan["jobs"].items():
    sys.stderr.flush()
    err = os.open(folder / f"{name}.rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)  # the job's lines, also those of loggers that hold sys.stderr, go to its own file
    os.close(err)
    code = main(args)
    sys.stderr.flush()
    (folder / f"{name}.rank{rank}.code").write_text(str(code))
