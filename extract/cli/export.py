"""``python -m extract.export STORE --to saelens DIR --layer L``: write a packed token store's layer as
SAELens's activation cache (``extract.analysis.export.export_saelens``).

    python -m extract.export packed.zarr --to saelens cache/ --layer transformer.h.6 \\
        [--hook-name blocks.6.hook_resid_post] [--dtype float16|float32] [--shard-contexts N] [--overwrite]

One line says what was written (contexts, context size, d_in, dtype, the store's scaling factor); bad
input is one line and exit status 2. Needs ``datasets``: ``pip install 'extract[datasets]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ExtractError
from ..names.options import option
from .base import CommandLine, command, values

FORMATS = ("saelens",)


@dataclass(frozen=True)
class ExportOptions:
    """The flags of ``export``: which layer of which store, in which format, where."""

    store: Path = field(metadata=option(positional=True, help="a complete token store extracted with --pack T"))
    to: tuple[str, str] = field(
        metadata=option(
            nargs=2,
            metavar=("FORMAT", "DIR"),
            required=True,
            help="saelens DIR: SAELens's activation cache (a datasets directory; cached_activations_path=DIR)",
        )
    )
    layer: str = field(metadata=option(required=True, help="the layer to export (one of the store's layers)"))
    hook_name: str | None = field(
        default=None, metadata=option(help="the column's name, SAELens's hook_name (default: the layer's name)")
    )
    dtype: str | None = field(
        default=None,
        metadata=option(choices=("float16", "float32"), help="the cached values' dtype (default: the store's)"),
    )
    shard_contexts: int | None = field(
        default=None, metadata=option(metavar="N", help="contexts per arrow file (default: about 500 MB)")
    )
    overwrite: bool = field(
        default=False,
        metadata=option(help="replace DIR if it is a dataset (only once the new one is complete)"),
    )


LINE = CommandLine(
    "python -m extract.export",
    "Export a layer of a packed token store (extracted with --pack T) to another tool's format.",
    (ExportOptions,),
)


@command("extract.export")
def main(argv: Sequence[str] | None = None) -> int:
    options = values(LINE.parse_args(argv), ExportOptions)
    kind, out = options.to
    if kind not in FORMATS:
        raise ExtractError(f"--to {kind}: the formats are {', '.join(FORMATS)} (see --help)")
    from ..analysis.export import export_saelens  # torch: after the arguments, not for --help

    cache = export_saelens(
        options.store,
        out,
        options.layer,
        hook_name=options.hook_name,
        dtype=options.dtype,
        shard_contexts=options.shard_contexts,
        overwrite=options.overwrite,
        progress=True,
    )
    print(cache.line(options.layer))
    return 0
