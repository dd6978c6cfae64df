"""The command line: flags (optionally from a TOML job file) → ``JobSpec`` → ``run``."""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..data.registry import data_kinds
from ..errors import ExtractError, WriterError
from ..job.interrupt import Interrupted
from ..job.launcher import is_first_rank, speaks_for_machine
from ..job.spec import DECODES, DEFAULT_COMPRESSORS, DTYPES, PRECISIONS, JobSpec, check_types
from ..models.registry import model_kinds
from ..names.layout import Layout
from ..names.pooling import MODEL_POOL, POOL_CHOICES, TEXT_POOLS
from ..store.location import described, from_object_storage
from ..store.schema import COMPRESSORS
from .base import Failure, Parser, command, say


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="extract",
        description="Capture layer activations of a PyTorch model over a dataset into a chunked zarr store.",
        epilog="Multi-process: accelerate launch [--multi_gpu --num_processes N] -m extract ...",
    )
    p.add_argument("--config", metavar="TOML", help="take options from a TOML job file; flags override it")
    p.add_argument(
        "--model",
        help=f"{model_kinds()} (default resnet50)",
    )
    p.add_argument(
        "--weights", help="torchvision weights name, DEFAULT (the source's pretrained weights), or none (random init)"
    )
    p.add_argument("--checkpoint", metavar="PATH", help="state_dict file loaded with weights_only=True")
    p.add_argument("--seed", type=int, help="seed for random init (--weights none; default 0)")
    p.add_argument("--layers", nargs="+", metavar="L", help="module names, globs (layer*), or name:0 / name:key")
    p.add_argument("--list-layers", action="store_true", help="print every module with its output shape, then exit")
    p.add_argument(
        "--data",
        metavar="SPEC",
        help=data_kinds(),
    )
    p.add_argument(
        "--image-key", metavar="K", help="wds: image extension; parquet/hf: image column (default: detected)"
    )
    p.add_argument(
        "--label-key",
        metavar="K",
        help="wds: label extension (default cls); parquet/hf: column (label); text: field or column "
        "(integers, or jsonl strings: class names)",
    )
    p.add_argument("--text-key", metavar="K", help="text: the field or column that holds the text (default text)")
    p.add_argument(
        "--context-length",
        type=int,
        metavar="T",
        help="text: tokens kept per document, longer ones truncated (default: a sentence-transformers model's "
        "max_seq_length, else the model's positions, at most 2048)",
    )
    p.add_argument(
        "--device-map",
        metavar="auto",
        help="text: spread a model too large for one GPU over every GPU this process sees (accelerate's big-model "
        "dispatch); launch one process per node",
    )
    p.add_argument(
        "--pack",
        type=int,
        metavar="T",
        help="text: concatenate the documents (separated by EOS, or BOS where the model starts sequences with it) "
        "into contexts of exactly T tokens, each starting with BOS; the last short context is dropped",
    )
    p.add_argument(
        "--tokens-per-batch",
        type=int,
        metavar="N",
        help="text: tokens per forward, padding included, however many documents that takes (default: --batch-size x 128)",
    )
    p.add_argument(
        "--decode",
        help=f"{' | '.join(DECODES)}: PIL in full (default), PIL at a reduced JPEG scale covering the resize, "
        "or batched nvjpeg on the GPU",
    )
    p.add_argument(
        "--exif-transpose",
        action="store_true",
        default=None,
        help="rotate images as their EXIF orientation says (off by default, like torchvision's loaders)",
    )
    p.add_argument("--out", metavar="PATH", help="the zarr store to write (default features.zarr)")
    p.add_argument("--batch-size", type=int, help="images per forward (default 64)")
    p.add_argument("--num-workers", type=int, help="DataLoader workers per process")
    p.add_argument("--image-size", type=int, metavar="S", help="crop size S (resize round(S*256/224))")
    p.add_argument(
        "--pool",
        nargs="+",
        metavar="P",
        help=f"images: {' | '.join(POOL_CHOICES)}; text: none (a row per token), {' | '.join(TEXT_POOLS)} "
        f"(a row per document, over its real tokens) or {MODEL_POOL} (its sentence-transformers pooling and "
        "normalization); default none (the full map, every token); for every layer or per layer: "
        "--pool layer3=avg layer4=none (later entries override earlier ones)",
    )
    p.add_argument(
        "--layout",
        nargs="+",
        metavar="LAYER=L",
        help=f"{' | '.join(Layout)} for layers whose layout --list-layers cannot tell (pooling needs it)",
    )
    p.add_argument("--dtype", help=f"storage dtype: {' | '.join(DTYPES)} (default float16)")
    p.add_argument(
        "--precision", help=f"compute precision: {' | '.join(PRECISIONS)} (default fp32 on CPU, bf16 on CUDA)"
    )
    p.add_argument("--chunk-size", type=int, help="samples per chunk (default: about 16 MiB per chunk)")
    p.add_argument(
        "--compressor",
        help=f"{' | '.join(COMPRESSORS)} (default by the kind of store: "
        f"{', '.join(f'{kind} {name}' for kind, name in DEFAULT_COMPRESSORS.items())}; a resumed store keeps its own)",
    )
    p.add_argument(
        "--writer-threads", type=int, help="threads encoding and writing chunks (default 2 on CPU, up to 8 on GPU)"
    )
    p.add_argument("--channels-last", action="store_true", default=None, help="run the model in channels_last")
    p.add_argument(
        "--no-truncate",
        dest="truncate",
        action="store_false",
        default=None,
        help="run the whole forward even after the last requested layer",
    )
    p.add_argument(
        "--skip-bad-images",
        action="store_true",
        default=None,
        help="record undecodable images, or unreadable documents, as invalid (valid=False) instead of stopping",
    )
    p.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="how long a process waits for the others at a barrier before failing (default 1800)",
    )
    p.add_argument("--overwrite", action="store_true", default=None, help="replace a store of a different job")
    return p


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
    for name in ("layers", "layout"):
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
    from ..job.runner import print_layers, run

    try:
        spec, only_list = parse_spec(sys.argv[1:] if argv is None else argv)
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
