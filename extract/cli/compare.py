"""``python -m extract.compare``: linear CKA between the layers of one store or two (``extract.analysis.cka``).

python -m extract.compare A.zarr[:LAYERS] [B.zarr[:LAYERS]] [--match keys|rows] [--heatmap cka.png] [--json cka.json]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..analysis.options import CompareOptions  # the machinery (torch) is imported to run, not for --help
from ..names.options import option
from .base import CommandLine, command, values, write_output


@dataclass(frozen=True)
class CompareFiles:
    """What ``compare`` reads and writes, besides how it computes CKA (``CompareOptions``)."""

    first: str = field(
        metadata=option(
            positional=True,
            metavar="A.zarr[:LAYERS]",
            help="a store, optionally with comma-separated layers or globs",
        )
    )
    second: str | None = field(
        default=None,
        metadata=option(
            positional=True,
            metavar="B.zarr[:LAYERS]",
            help="a second store: compare A's layers with B's over shared keys",
        ),
    )
    heatmap: str | None = field(
        default=None, metadata=option(metavar="PNG", help="also draw the matrix as a heatmap (needs extract[report])")
    )
    json: str | None = field(
        default=None, metadata=option(metavar="FILE", help="also write the matrix to FILE as JSON")
    )


LINE = CommandLine(
    "python -m extract.compare",
    "Linear CKA between the layers of one store or two.",
    (CompareFiles, CompareOptions),
)


@command("extract.compare")
def main(argv: Sequence[str] | None = None) -> int:
    args = LINE.parse_args(argv)
    files, options = values(args, CompareFiles), values(args, CompareOptions)
    import numpy as np

    from ..analysis.cka import compare, format_matrix
    from ..analysis.figures import cka_heatmap, require_matplotlib, save
    from ..analysis.probe import resolve_device

    if files.heatmap:
        require_matplotlib()
    cka = compare(
        files.first, files.second, pool=options.pool, match=options.match, batch_size=options.batch_size,
        window=options.window, max_samples=options.max_samples, seed=options.seed,
        device=resolve_device(options.device),
    )  # fmt: skip
    for note in cka.notes:
        print(note)
    print(f"linear CKA (minibatch, unbiased; {cka.num_samples} samples, {cka.matched})")
    if files.second is not None:
        print(f"rows: layers of {cka.row_store}; columns: layers of {cka.col_store}")
    print(format_matrix(cka))
    if files.heatmap:
        save(cka_heatmap(cka), files.heatmap)
    if files.json:
        matrix = [[None if np.isnan(v) else float(v) for v in row] for row in cka.matrix]  # JSON has no NaN
        record = {"rows": cka.rows, "cols": cka.cols, "row_store": cka.row_store, "col_store": cka.col_store,
                  "cka": matrix, "num_samples": cka.num_samples, "matched": cka.matched,
                  "constant": list(cka.constant), "notes": list(cka.notes)}  # fmt: skip
        write_output("--json", files.json, json.dumps(record, indent=2) + "\n")
    return 0
