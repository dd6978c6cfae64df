"""``python -m extract.probe``: probe test accuracy per layer of a store (``extract.analysis.probe``).

python -m extract.probe STORE [--layers L ...] [--method linear|knn] [--test-fraction 0.2] ...
python -m extract.probe --train TRAIN_STORE --test TEST_STORE [--method knn] [--json out.json]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

# the declarations, not the machinery: --help loads no torch (``probe_layers`` is imported to run)
from ..analysis.options import DEFAULT_TEST_FRACTION, ProbeOptions
from ..names.options import option
from .base import CommandLine, command, values, write_output


@dataclass(frozen=True)
class ProbeInputs:
    """What ``probe`` reads and writes, besides how it probes (``ProbeOptions``)."""

    store: str | None = field(
        default=None,
        metadata=option(
            positional=True,
            help="a complete extract store, split into train and test by --test-fraction",
        ),
    )
    train: str | None = field(
        default=None, metadata=option(metavar="STORE", help="train on this store (with --test; e.g. ImageNet train)")
    )
    test: str | None = field(
        default=None, metadata=option(metavar="STORE", help="test on this store (with --train; e.g. ImageNet val)")
    )
    layers: list[str] | None = field(
        default=None, metadata=option(metavar="L", help="layers or globs (encoder.layers.*) to probe (default: all)")
    )
    test_fraction: float = field(default=DEFAULT_TEST_FRACTION, metadata=option(help="held-out share of the samples"))
    json: str | None = field(
        default=None, metadata=option(metavar="FILE", help="also write the results to FILE as JSON")
    )


LINE = CommandLine(
    "python -m extract.probe",
    "Probe test accuracy (linear or k-NN) for each layer of a store.",
    (ProbeInputs, ProbeOptions),
)


@command("extract.probe")
def main(argv: Sequence[str] | None = None) -> int:
    args = LINE.parse_args(argv)
    inputs, options = values(args, ProbeInputs), values(args, ProbeOptions)
    from ..analysis.probe import probe_layers

    records = probe_layers(
        inputs.store, inputs.layers, options, train=inputs.train, test=inputs.test, test_fraction=inputs.test_fraction
    )
    if inputs.json:
        stores = {"store": inputs.store} if inputs.store else {"train": inputs.train, "test": inputs.test}
        write_output("--json", inputs.json, json.dumps({**stores, "layers": list(records.values())}, indent=2) + "\n")
    return 0
