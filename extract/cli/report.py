"""``python -m extract.report``: one self-contained HTML page about a store (``extract.analysis.report``).

    python -m extract.report STORE [--out report.html] [--layers L ...] [--max-samples 5000] [--k 20]

Needs matplotlib: ``pip install 'extract[report]'``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

# the defaults, not the machinery: --help loads no torch (``build_report`` is imported to run)
from ..analysis.options import ReportConfig
from .base import Parser, command, write_output

DEFAULTS = ReportConfig()


def build_parser() -> argparse.ArgumentParser:
    """The flags: the store, the output file, and one per ``ReportConfig`` field (same name, its default)."""
    p = Parser(prog="python -m extract.report", description="An HTML report with figures about a store.")
    p.add_argument("store", help="a complete extract store")
    p.add_argument("--out", default="report.html", help="the HTML file to write (default report.html)")
    p.add_argument("--layers", nargs="+", metavar="L", help="layers or globs (default: all)")
    p.add_argument("--pca-layer", metavar="L", help="the layer of the PCA and neighbour figures (default: the deepest)")
    p.add_argument(
        "--probe-json",
        nargs="+",
        metavar="FILE",
        default=DEFAULTS.probe_json,
        help="accuracies from extract.probe --json instead of probing here",
    )
    p.add_argument(
        "--max-samples",
        type=int,
        default=DEFAULTS.max_samples,
        help="samples (drawn at random) the probes and CKA use (default 5000)",
    )
    p.add_argument(
        "--pca-samples", type=int, default=DEFAULTS.pca_samples, help="samples in the PCA plot (default 2000)"
    )
    p.add_argument(
        "--queries", type=int, default=DEFAULTS.queries, help="query samples with neighbour thumbnails (default 4)"
    )
    p.add_argument("--neighbours", type=int, default=DEFAULTS.neighbours, help="neighbours shown per query (default 6)")
    p.add_argument(
        "--k",
        type=int,
        default=DEFAULTS.k,
        help=f"neighbours that vote in the k-NN probe (default {DEFAULTS.k}, as probe's)",
    )
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed of the samples drawn (default 0)")
    p.add_argument("--device", help="cpu | cuda[:N] (default: a GPU if there is one)")
    return p


@command("extract.report")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = ReportConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(ReportConfig)})
    from ..analysis.report import build_report

    report = build_report(args.store, config)
    write_output("--out", args.out, report.html())
    print(f"{args.out}: {len(report.figures)} figures" + "".join(f"; {n}" for n in report.notes))
    return 0
