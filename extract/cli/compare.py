"""``python -m extract.compare``: linear CKA between the layers of one store or two (``extract.analysis.cka``).

python -m extract.compare A.zarr[:LAYERS] [B.zarr[:LAYERS]] [--match keys|rows] [--heatmap cka.png] [--json cka.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from ..analysis.options import MATCHES  # the machinery (torch) is imported to run, not for --help
from ..errors import ExtractError
from .base import Parser, command, write_output


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m extract.compare", description="Linear CKA between the layers of one store or two.")
    p.add_argument("first", metavar="A.zarr[:LAYERS]", help="a store, optionally with comma-separated layers or globs")
    p.add_argument(
        "second",
        nargs="?",
        metavar="B.zarr[:LAYERS]",
        help="a second store: compare A's layers with B's over shared keys",
    )
    p.add_argument("--pool", help="avg | max | cls | mean | none (default: avg for maps, cls for tokens)")
    p.add_argument(
        "--match",
        choices=MATCHES,
        default="keys",
        help="pair two stores' samples by key (default), or by row: the same images from different sources",
    )
    p.add_argument("--batch-size", type=int, default=1024, help="samples per CKA minibatch (default 1024)")
    p.add_argument(
        "--window", type=int, help="chunks read together and mixed into minibatches (default: as many as 512 MiB hold)"
    )
    p.add_argument("--max-samples", type=int, help="use this many samples drawn at random (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the minibatches (default 0)")
    p.add_argument("--device", help="cpu | cuda[:N] (default: a GPU if there is one)")
    p.add_argument("--heatmap", metavar="PNG", help="also draw the matrix as a heatmap (needs extract[report])")
    p.add_argument("--json", metavar="FILE", help="also write the matrix to FILE as JSON")
    return p


@command("extract.compare")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import numpy as np

    from ..analysis.cka import compare, format_matrix
    from ..analysis.figures import cka_heatmap, require_matplotlib, save
    from ..analysis.probe import resolve_device

    if (args.window is not None and args.window < 1) or (args.max_samples is not None and args.max_samples < 4):
        raise ExtractError("--window must be positive and --max-samples at least 4")
    if args.heatmap:
        require_matplotlib()
    cka = compare(
        args.first, args.second, pool=args.pool, match=args.match, batch_size=args.batch_size, window=args.window,
        max_samples=args.max_samples, seed=args.seed, device=resolve_device(args.device),
    )  # fmt: skip
    for note in cka.notes:
        print(note)
    print(f"linear CKA (minibatch, unbiased; {cka.num_samples} samples, {cka.matched})")
    if args.second is not None:
        print(f"rows: layers of {cka.row_store}; columns: layers of {cka.col_store}")
    print(format_matrix(cka))
    if args.heatmap:
        save(cka_heatmap(cka), args.heatmap)
    if args.json:
        matrix = [[None if np.isnan(v) else float(v) for v in row] for row in cka.matrix]  # JSON has no NaN
        record = {"rows": cka.rows, "cols": cka.cols, "row_store": cka.row_store, "col_store": cka.col_store,
                  "cka": matrix, "num_samples": cka.num_samples, "matched": cka.matched,
                  "constant": list(cka.constant), "notes": list(cka.notes)}  # fmt: skip
        write_output("--json", args.json, json.dumps(record, indent=2) + "\n")
    return 0
