"""``python -m extract.top STORE --layer L``: each SAE latent's top-k activating tokens over a token store's
codes, with their decoded contexts (``extract.analysis.top_latents.top_latents``).

    python -m extract.top store.zarr --layer blocks.6.hook_resid_post [--latents 1,5,9] [-k 20] \\
        [--context 16] [--out DIR] [--html-latents 1,5] [--tokenizer NAME_OR_DIR]

Writes DIR/top.parquet, saedashboard.json, delphi.json and top.html, and one line saying so; bad input is
one line and exit status 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..names.options import option
from .base import CommandLine, command, values


def _latents(text: str) -> list[int]:
    try:
        chosen = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a comma-separated list of latent indices, e.g. 1,5,9"
        ) from None
    if not chosen:
        raise argparse.ArgumentTypeError("name at least one latent, e.g. 1,5,9")
    return chosen


@dataclass(frozen=True)
class TopOptions:
    """The flags of ``top``: which latents of which layer, how many tokens with how much context, where."""

    store: Path = field(metadata=option(positional=True, help="a complete token store extracted with --sae LAYER=PATH"))
    layer: str = field(
        metadata=option(required=True, help="the layer whose SAE codes to rank (one the store has codes of)")
    )
    latents: list[int] | None = field(
        default=None,
        metadata=option(parse=_latents, metavar="I,J,...", help="only these latents (default: every active one)"),
    )
    k: int = field(default=20, metadata=option(short="-k", help="top tokens per latent"))
    context: int = field(default=16, metadata=option(help="tokens on each side of a top token"))
    out: Path = field(default=Path("top"), metadata=option(help="the output directory"))
    html_latents: list[int] | None = field(
        default=None,
        metadata=option(
            parse=_latents, metavar="I,J,...", help="the latents top.html shows (default: the 8 most frequent)"
        ),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=option(help="decode with this tokenizer (name or directory; default: the store's own)"),
    )


LINE = CommandLine(
    "python -m extract.top",
    "Each SAE latent's top activating tokens over a store's codes (--sae), with their contexts.",
    (TopOptions,),
)


@command("extract.top")
def main(argv: Sequence[str] | None = None) -> int:
    options = values(LINE.parse_args(argv), TopOptions)
    from ..analysis.top_latents import top_latents  # torch: after the arguments, not for --help
    from ..read.features import open_features

    summary = top_latents(
        open_features(options.store),
        options.layer,
        latents=options.latents,
        k=options.k,
        context=options.context,
        out=options.out,
        html_latents=options.html_latents,
        tokenizer=options.tokenizer,
    )
    print(summary.line())
    return 0
