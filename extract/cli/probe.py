"""``python -m extract.probe``: probe test accuracy per layer of a store (``extract.analysis.probe``).

python -m extract.probe STORE [--layers L ...] [--method linear|knn] [--test-fraction 0.2] ...
python -m extract.probe --train TRAIN_STORE --test TEST_STORE [--method knn] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence

# the defaults, not the machinery: --help loads no torch (``probe_layers`` is imported to run)
from ..analysis.options import DEFAULT_TEST_FRACTION, ProbeOptions
from .base import Parser, command, write_output

DEFAULTS = ProbeOptions()


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of numbers, e.g. 0.01,0.1") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"learning rates must be positive, got '{text}'")
    return rates


def build_parser() -> argparse.ArgumentParser:
    """The flags: one per ``ProbeOptions`` field (same name, its default), and the stores to probe."""
    p = Parser(
        prog="python -m extract.probe", description="Probe test accuracy (linear or k-NN) for each layer of a store."
    )
    p.add_argument("store", nargs="?", help="a complete extract store, split into train and test by --test-fraction")
    p.add_argument("--train", metavar="STORE", help="train on this store (with --test; e.g. ImageNet train)")
    p.add_argument("--test", metavar="STORE", help="test on this store (with --train; e.g. ImageNet val)")
    p.add_argument(
        "--layers", nargs="+", metavar="L", help="layers or globs (encoder.layers.*) to probe (default: all)"
    )
    p.add_argument("--method", default=DEFAULTS.method, help="linear (default) or knn")
    p.add_argument(
        "--pool",
        help="avg | max | cls | mean | none (default: avg for maps, cls for tokens; a layer pooled at extraction "
        "is read as stored)",
    )
    p.add_argument(
        "--test-fraction",
        type=float,
        default=DEFAULT_TEST_FRACTION,
        help="held-out share of the samples (default 0.2)",
    )
    p.add_argument(
        "--seed", type=int, default=DEFAULTS.seed, help="seed of the split and of the mini-batch order (default 0)"
    )
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    p.add_argument("--device", help="cpu | cuda[:N] for k-NN and mini-batch training (default: a GPU if there is one)")
    _add_linear_flags(p)
    knn = p.add_argument_group("knn")
    knn.add_argument("--k", type=int, default=DEFAULTS.k, help=f"neighbours that vote (default {DEFAULTS.k})")
    knn.add_argument(
        "--temperature",
        type=float,
        default=DEFAULTS.temperature,
        help=f"vote weight exp(similarity / T) (default {DEFAULTS.temperature})",
    )
    return p


def _add_linear_flags(p: argparse.ArgumentParser) -> None:
    linear = p.add_argument_group("linear")
    linear.add_argument(
        "--solver",
        default=DEFAULTS.solver,
        help="lbfgs | sgd | auto (default: L-BFGS when the train set fits --max-full-batch-mib)",
    )
    linear.add_argument(
        "--max-full-batch-mib",
        type=float,
        default=DEFAULTS.max_full_batch_mib,
        help="largest float32 train set for L-BFGS (default 1024)",
    )
    linear.add_argument(
        "--epochs", type=int, help="L-BFGS iterations (default 100) or SGD passes over the train set (default 10)"
    )
    linear.add_argument("--lr", type=float, default=DEFAULTS.lr, help="L-BFGS step size (default 1)")
    linear.add_argument(
        "--lrs",
        type=_rates,
        default=DEFAULTS.lrs,
        help="SGD learning rates swept on a held-out 10%% of the train set (default 0.01,0.03,0.1,0.3)",
    )
    linear.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size, help="SGD batch size (default 256)")
    linear.add_argument(
        "--num-workers",
        type=int,
        default=DEFAULTS.num_workers,
        help="DataLoader workers reading SGD batches (default 0)",
    )
    linear.add_argument(
        "--weight-decay", type=float, default=DEFAULTS.weight_decay, help="L2 penalty on the weights (default 1e-3)"
    )


@command("extract.probe")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..analysis.probe import probe_layers

    options = ProbeOptions(**{field.name: getattr(args, field.name) for field in dataclasses.fields(ProbeOptions)})
    records = probe_layers(
        args.store, args.layers, options, train=args.train, test=args.test, test_fraction=args.test_fraction
    )
    if args.json:
        stores = {"store": args.store} if args.store else {"train": args.train, "test": args.test}
        write_output("--json", args.json, json.dumps({**stores, "layers": list(records.values())}, indent=2) + "\n")
    return 0
