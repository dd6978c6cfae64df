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
from pathlib import Path

from .base import Parser, command


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


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m extract.top",
        description="Each SAE latent's top activating tokens over a store's codes (--sae), with their contexts.",
    )
    p.add_argument("store", type=Path, help="a complete token store extracted with --sae LAYER=PATH")
    p.add_argument("--layer", required=True, help="the layer whose SAE codes to rank (one the store has codes of)")
    p.add_argument("--latents", type=_latents, metavar="I,J,...", help="only these latents (default: every active one)")
    p.add_argument("-k", "--k", type=int, default=20, help="top tokens per latent (default 20)")
    p.add_argument("--context", type=int, default=16, help="tokens on each side of a top token (default 16)")
    p.add_argument("--out", type=Path, default=Path("top"), help="the output directory (default ./top)")
    p.add_argument(
        "--html-latents",
        type=_latents,
        metavar="I,J,...",
        help="the latents top.html shows (default: the 8 most frequent)",
    )
    p.add_argument("--tokenizer", help="decode with this tokenizer (name or directory; default: the store's own)")
    return p


@command("extract.top")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..analysis.top_latents import top_latents  # torch: after the arguments, not for --help
    from ..read.features import open_features

    summary = top_latents(
        open_features(args.store),
        args.layer,
        latents=args.latents,
        k=args.k,
        context=args.context,
        out=args.out,
        html_latents=args.html_latents,
        tokenizer=args.tokenizer,
    )
    print(summary.line())
    return 0
