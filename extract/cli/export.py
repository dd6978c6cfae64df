"""``python -m extract.export STORE --to saelens DIR --layer L``: write a packed token store's layer as
SAELens's activation cache (``extract.analysis.export.export_saelens``).

    python -m extract.export packed.zarr --to saelens cache/ --layer transformer.h.6 \\
        [--hook-name blocks.6.hook_resid_post] [--dtype float16|float32] [--shard-contexts N] [--overwrite]

One line says what was written (contexts, context size, d_in, dtype, the store's scaling factor); bad
input is one line and exit status 2. Needs ``datasets``: ``pip install 'extract[datasets]'``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ..errors import ExtractError
from .base import Parser, command

FORMATS = ("saelens",)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m extract.export",
        description="Export a layer of a packed token store (extracted with --pack T) to another tool's format.",
    )
    p.add_argument("store", type=Path, help="a complete token store extracted with --pack T")
    p.add_argument(
        "--to",
        nargs=2,
        metavar=("FORMAT", "DIR"),
        required=True,
        help="saelens DIR: SAELens's activation cache (a datasets directory; cached_activations_path=DIR)",
    )
    p.add_argument("--layer", required=True, help="the layer to export (one of the store's layers)")
    p.add_argument("--hook-name", help="the column's name, SAELens's hook_name (default: the layer's name)")
    p.add_argument("--dtype", choices=("float16", "float32"), help="the cached values' dtype (default: the store's)")
    p.add_argument("--shard-contexts", type=int, metavar="N", help="contexts per arrow file (default: about 500 MB)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace DIR if it is a dataset (only once the new one is complete)"
    )
    return p


@command("extract.export")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kind, out = args.to
    if kind not in FORMATS:
        raise ExtractError(f"--to {kind}: the formats are {', '.join(FORMATS)} (see --help)")
    from ..analysis.export import export_saelens  # torch: after the arguments, not for --help

    cache = export_saelens(
        args.store,
        out,
        args.layer,
        hook_name=args.hook_name,
        dtype=args.dtype,
        shard_contexts=args.shard_contexts,
        overwrite=args.overwrite,
        progress=True,
    )
    print(cache.line(args.layer))
    return 0
