"""Linear probe: how linearly decodable the labels are from each stored layer.

    python -m extract.probe STORE [--layers L ...] [--test-fraction 0.2] [--epochs 100] [--lr 1] ...

Per layer: load the features (maps average-pooled, token outputs reduced to the class token unless
``--pool`` says otherwise), split the labelled samples by a seeded permutation, standardize with
the training statistics, fit a multinomial logistic regression with full-batch L-BFGS on the CPU,
and report the test accuracy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .cli import Parser
from .errors import ExtractError
from .reader import Features, open_features


def default_pool(features: Features, layer: str) -> str | None:
    """avg for (C, H, W) maps, cls for (T, D) tokens, nothing for vectors."""
    return {3: "avg", 2: "cls"}.get(len(features.shapes[layer]))


def split(labelled: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test sample indices from a seeded permutation of ``labelled``."""
    if not 0 < test_fraction < 1:
        raise ExtractError(f"--test-fraction must be between 0 and 1, got {test_fraction}")
    order = np.random.default_rng(seed).permutation(labelled)
    num_test = max(1, round(test_fraction * len(order)))
    if num_test >= len(order):
        raise ExtractError(f"{len(order)} labelled samples are too few to split into train and test")
    return np.sort(order[num_test:]), np.sort(order[:num_test])


def fit_logistic_regression(
    x: torch.Tensor, y: torch.Tensor, num_classes: int, *, epochs: int, lr: float, weight_decay: float
) -> nn.Linear:
    """Multinomial logistic regression by full-batch L-BFGS. The loss is convex, so starting from
    zero weights makes the result independent of any random state."""
    model = nn.Linear(x.shape[1], num_classes, dtype=x.dtype)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=lr, max_iter=epochs, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y) + weight_decay / 2 * model.weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return model


def probe(
    store: str | Path,
    layers: Sequence[str] | None = None,
    *,
    pool: str | None = None,
    test_fraction: float = 0.2,
    epochs: int = 100,
    lr: float = 1.0,
    weight_decay: float = 1e-3,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Test accuracy of a linear probe on each layer (all stored layers by default); logs one line each."""
    features = open_features(store)
    labelled = np.flatnonzero((features.labels >= 0) & features.valid)
    if len(labelled) == 0:
        raise ExtractError(f"{store} has no labels (all -1): nothing to probe")
    train, test = split(labelled, test_fraction, seed)
    labels = torch.from_numpy(features.labels)
    num_classes = int(labels.max()) + 1
    accuracies = {}
    for layer in layers or features.layers:
        layer_pool = pool or default_pool(features, layer)
        values = features.load(layer, labelled, pool=layer_pool, as_torch=True).flatten(1)
        x_train, x_test = (values[np.searchsorted(labelled, part)] for part in (train, test))
        mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-6)
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
        model = fit_logistic_regression(
            x_train, labels[train], num_classes, epochs=epochs, lr=lr, weight_decay=weight_decay
        )
        with torch.no_grad():
            train_accuracy = (model(x_train).argmax(1) == labels[train]).float().mean().item()
            accuracies[layer] = (model(x_test).argmax(1) == labels[test]).float().mean().item()
        log(
            f"{layer}: test accuracy {accuracies[layer]:.3f} (train {train_accuracy:.3f}; "
            f"{len(train)} train / {len(test)} test, {x_train.shape[1]} features, pool {layer_pool or 'none'}, "
            f"{num_classes} classes, chance {1 / num_classes:.3f})"
        )
    return accuracies


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m extract.probe", description="Linear-probe test accuracy for each layer of a store.")
    p.add_argument("store", help="a complete extract store")
    p.add_argument("--layers", nargs="+", metavar="L", help="layers to probe (default: all)")
    p.add_argument("--pool", help="avg | max | cls | mean | none (default: avg for maps, cls for tokens)")
    p.add_argument("--test-fraction", type=float, default=0.2, help="held-out share of the samples (default 0.2)")
    p.add_argument("--epochs", type=int, default=100, help="full-batch L-BFGS iterations (default 100)")
    p.add_argument("--lr", type=float, default=1.0, help="L-BFGS step size (default 1)")
    p.add_argument("--weight-decay", type=float, default=1e-3, help="L2 penalty on the weights (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/test split (default 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        probe(
            args.store,
            args.layers,
            pool=args.pool,
            test_fraction=args.test_fraction,
            epochs=args.epochs,
            lr=args.lr,
            weight_decay=args.weight_decay,
            seed=args.seed,
        )
    except ExtractError as e:
        print(f"extract.probe: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
