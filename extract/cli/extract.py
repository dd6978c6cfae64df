"""The command line: flags (optionally from a TOML job file) → ``JobSpec`` → ``run``."""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ExtractError, WriterError
from ..job.interrupt import Interrupted
from ..job.launcher import is_first_rank, speaks_for_machine
from ..job.spec import JobSpec, Option, check_types
from ..store.location import described, from_object_storage
from . import base
from .base import Argument, Failure, command, say

# The flags that are no job option: where the options come from, and what to do instead of a job. Declared
# as the job's are (``extract.job.spec.Option``), so that the flag reference renders them too.
CONFIG = Option(
    metavar="TOML",
    help="take options from a TOML job file; flags override it",
    reference="take options from a job file (its keys are the options' names with underscores, as "
    "`batch_size = 32`); flags given on the command line override it. Every key is type-checked against the "
    'job\'s options (`overwrite = "no"` is an error, not true) before anything is created',
)
LIST_LAYERS = Option(
    help="print every module with its output shape, then exit",
    reference="print every module (its output, then its input as `name@input`) and every alias (with the "
    "tensor it is) with its class, shape for a batch of B dummy images (for text models, B sequences of T "
    "tokens) and layout (NCHW, NHWC, NLC, NCL), then exit; builds the architecture only, never downloads",
)


def declared() -> list[Argument]:
    """Every flag of ``extract run`` in --help's order: ``--config``, then the job's options (``JobSpec``'s
    fields), ``--list-layers`` beside ``--layers``. Every default is None, so that ``parse_spec`` can tell a
    flag given from one left out (a TOML job file's value stands unless a flag overrides it)."""
    found = [Argument("config", CONFIG, {"metavar": CONFIG.metavar})]
    for argument in base.arguments(JobSpec, defaults=False):
        found.append(argument)
        if argument.dest == "layers":  # --list-layers is what to give when the layers' names are not known
            found.append(Argument("list_layers", LIST_LAYERS, {"action": "store_true"}))
    return found


def build_parser() -> argparse.ArgumentParser:
    return base.make_parser(
        "extract",
        "Capture layer activations of a PyTorch model over a dataset into a chunked zarr store.",
        declared(),
        epilog="Multi-process: accelerate launch [--multi_gpu --num_processes N] -m extract ...",
    )


def _from_config(path: str) -> dict[str, Any]:
    try:
        table = tomllib.loads(Path(path).read_bytes().decode("utf-8"))  # TOML is UTF-8, whatever the locale
    except FileNotFoundError:
        raise ExtractError(f"--config {path} does not exist") from None
    except IsADirectoryError:
        raise ExtractError(f"--config {path} is a directory; name a TOML file") from None
    except OSError as e:
        raise ExtractError(f"--config {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ExtractError(f"--config {path} is not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ExtractError(f"--config {path} is not valid TOML: {e}") from None
    known = set(JobSpec.field_names())
    options = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ExtractError(f"--config {path}: unknown key '{key}'; known keys: {', '.join(sorted(known))}")
        options[name] = value
    for name in ("layers", "layout", "sae"):
        if isinstance(options.get(name), str):
            options[name] = [options[name]]
    check_types(options, f"--config {path}: key")
    return options


def parse_spec(argv: Sequence[str]) -> tuple[JobSpec, bool]:
    """The job the arguments describe, and whether only ``--list-layers`` was asked for."""
    args = build_parser().parse_args(argv)
    options = _from_config(args.config) if args.config else {}
    options.update({k: v for k, v in vars(args).items() if v is not None and k not in ("config", "list_layers")})
    if isinstance(options.get("pool"), list) and len(options["pool"]) == 1 and "=" not in options["pool"][0]:
        options["pool"] = options["pool"][0]  # one bare value: the same job (and identity) as before
    try:
        spec = JobSpec(**options)
    except TypeError as e:
        raise ExtractError(str(e)) from None
    if not args.list_layers and not spec.layers:
        raise ExtractError("--layers is required (or --list-layers to see the names)")
    return spec, args.list_layers


def _interrupted(prog: str, e: Interrupted) -> int:
    if not e.quiet:
        say(prog, str(e))
    return e.exit_code


def _writer_failed(prog: str, e: WriterError) -> int:
    say(prog, f"error: {e}; {UNMARKED}")
    return 1


def _reader_left(prog: str, e: BrokenPipeError) -> int:
    """``--list-layers | head``: the reader left, which is fine; nothing more may reach the closed pipe."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _filesystem_failed(prog: str, e: OSError) -> int:
    """The filesystem failed under the run (full, remounted read-only): one line, no traceback."""
    where = f" ({e.filename})" if e.filename else ""
    say(prog, f"error: {e.strerror or e}{where}; {UNMARKED}")
    return 1


def _storage_failed(prog: str, e: Exception) -> int:
    """A request to object storage that failed past its retries (an outage), outside the writer."""
    if not from_object_storage(e):
        raise e
    say(prog, f"error: {described(e)}; {UNMARKED}")
    return 1


def _keyboard_interrupt(prog: str, e: KeyboardInterrupt) -> int:
    say(prog, "interrupted; rerun the same command to resume")
    return 130


UNMARKED = "chunks not fully written are not marked done, a rerun redoes them"
# in this order: a BrokenPipeError is an OSError, and is no failure
EXTRACTION_FAILURES: dict[type[BaseException], Failure] = {
    Interrupted: _interrupted,
    WriterError: _writer_failed,
    BrokenPipeError: _reader_left,
    OSError: _filesystem_failed,
    KeyboardInterrupt: _keyboard_interrupt,
    Exception: _storage_failed,  # last: only obstore's errors are handled, any other propagates
}


@command("extract", EXTRACTION_FAILURES)
def main(argv: Sequence[str] | None = None) -> int:
    try:
        spec, only_list = parse_spec(sys.argv[1:] if argv is None else argv)
        from ..job.runner import print_layers, run  # torch and the sources: not for --help or a bad flag

        if only_list:
            print_layers(spec)
        else:
            run(spec)
    except ExtractError as e:  # every rank met it: one line for the machine, not one a rank
        e.quiet = e.quiet or not (e.alone or speaks_for_machine())
        raise
    except Interrupted as e:  # rank 0 gives the job's count; before the store is open the others know none
        e.quiet = e.quiet or not is_first_rank()
        raise
    return 0
