"""Probes: how much each stored layer knows about the labels, by a linear classifier or k-NN.

    python -m extract.probe STORE [--layers L ...] [--method linear|knn] [--test-fraction 0.2] ...
    python -m extract.probe --train TRAIN_STORE --test TEST_STORE [--method knn] [--json out.json]

Per layer: load the features (maps average-pooled, token outputs reduced to the class token unless
``--pool`` says otherwise), split the labelled samples of one store by a seeded permutation (or
train on one store and test on another), and report the test accuracy, one line per layer.

- linear, small N: standardize with the training statistics and fit a multinomial logistic
  regression by full-batch L-BFGS on the CPU (exact and deterministic: zero init, convex loss).
- linear, large N (the training set beyond ``--max-full-batch-mib``, or ``--solver sgd``): the
  mini-batch probe of ``extract.linear`` streaming from the store, on a GPU when there is one.
- knn: DINO's weighted k-NN (cosine similarity, k 20, T 0.07) in blocks (``extract.knn``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..cli.base import Parser, write_output
from ..errors import ExtractError
from ..read.features import Features, open_features
from .knn import DEFAULT_K, DEFAULT_TEMPERATURE, knn_predict
from .linear import DEFAULT_LRS, fit_minibatch
from .linear import accuracy as streamed_accuracy
from .samples import Samples, default_pool, labelled_rows, select_layers

__all__ = ["default_pool", "fit_logistic_regression", "probe", "probe_layers", "probe_rows", "split"]

METHODS = ("linear", "knn")
SOLVERS = ("auto", "lbfgs", "sgd")
DEFAULT_MAX_FULL_BATCH_MIB = 1024


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


def resolve_device(device: str | None) -> torch.device:
    """``device``, or a GPU when there is one, else the CPU; asking for a missing GPU is an error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ExtractError(f"--device '{device}' is not a torch device; use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ExtractError(f"--device {device}: no CUDA device here; use --device cpu (or leave it out)")
    return resolved


def _open(path: str | Path) -> Features:
    features = open_features(path)
    if len(labelled_rows(features)) == 0:
        raise ExtractError(f"{path} has no labels (all -1): nothing to probe")
    return features


def _parts(
    store: str | Path | None, train: str | Path | None, test: str | Path | None, test_fraction: float, seed: int
) -> tuple[Features, np.ndarray, Features, np.ndarray, str]:
    """(train features, train rows, test features, test rows, how they were split)."""
    if (store is None) == (train is None and test is None) or (train is None) != (test is None):
        raise ExtractError("give one STORE (split by --test-fraction) or both --train STORE and --test STORE")
    if store is not None:
        features = _open(store)
        train_rows, test_rows = split(labelled_rows(features), test_fraction, seed)
        return features, train_rows, features, test_rows, f"split {1 - test_fraction:g}/{test_fraction:g} seed {seed}"
    train_features, test_features = _open(train), _open(test)
    return (
        train_features,
        labelled_rows(train_features),
        test_features,
        labelled_rows(test_features),
        "train/test stores",
    )


def probe_layers(
    store: str | Path | None = None,
    layers: Sequence[str] | None = None,
    *,
    train: str | Path | None = None,
    test: str | Path | None = None,
    method: str = "linear",
    pool: str | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    epochs: int | None = None,
    lr: float = 1.0,
    weight_decay: float = 1e-3,
    solver: str = "auto",
    max_full_batch_mib: float = DEFAULT_MAX_FULL_BATCH_MIB,
    batch_size: int = 256,
    lrs: Sequence[float] = DEFAULT_LRS,
    num_workers: int = 0,
    k: int = DEFAULT_K,
    temperature: float = DEFAULT_TEMPERATURE,
    device: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """One record per layer (in model order): test accuracy and how it was obtained; logs one line each."""
    train_features, train_rows, test_features, test_rows, how = _parts(store, train, test, test_fraction, seed)
    names = select_layers(train_features.layers, layers, store=train_features.path)
    if test_features is not train_features:
        select_layers(test_features.layers, names, store=test_features.path)  # every layer in both stores
    return probe_rows(
        train_features, train_rows, test_features, test_rows, names, how=how, method=method, pool=pool, seed=seed,
        epochs=epochs, lr=lr, weight_decay=weight_decay, solver=solver, max_full_batch_mib=max_full_batch_mib,
        batch_size=batch_size, lrs=lrs, num_workers=num_workers, k=k, temperature=temperature, device=device, log=log,
    )  # fmt: skip


def probe_rows(
    train_features: Features,
    train_rows: np.ndarray,
    test_features: Features,
    test_rows: np.ndarray,
    layers: Sequence[str],
    *,
    how: str,
    method: str = "linear",
    pool: str | None = None,
    seed: int = 0,
    epochs: int | None = None,
    lr: float = 1.0,
    weight_decay: float = 1e-3,
    solver: str = "auto",
    max_full_batch_mib: float = DEFAULT_MAX_FULL_BATCH_MIB,
    batch_size: int = 256,
    lrs: Sequence[float] = DEFAULT_LRS,
    num_workers: int = 0,
    k: int = DEFAULT_K,
    temperature: float = DEFAULT_TEMPERATURE,
    device: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """``probe_layers`` on given (sorted) train and test rows of opened stores; ``how`` says how they were chosen."""
    if method not in METHODS:
        raise ExtractError(f"unknown --method '{method}'; choose one of {', '.join(METHODS)}")
    if solver not in SOLVERS:
        raise ExtractError(f"unknown --solver '{solver}'; choose one of {', '.join(SOLVERS)}")
    if k < 1 or temperature <= 0:
        raise ExtractError(f"--k must be positive and --temperature above 0; got {k} and {temperature}")
    if (epochs is not None and epochs < 1) or batch_size < 1 or num_workers < 0:
        raise ExtractError(
            f"--epochs and --batch-size must be positive, --num-workers 0 or more; got {epochs}, {batch_size}, {num_workers}"
        )
    run_on = resolve_device(device)
    num_classes = int(max(train_features.labels.max(), test_features.labels.max())) + 1
    records = {}
    for layer in layers:
        layer_pool = pool or default_pool(train_features, layer)
        train_part = Samples(train_features, layer, layer_pool, train_rows)
        test_part = Samples(test_features, layer, layer_pool, test_rows)
        if train_part.dim != test_part.dim:
            raise ExtractError(
                f"layer '{layer}' has {train_part.dim} features in {train_features.path} but {test_part.dim} in "
                f"{test_features.path}: the stores come from different models or pooling"
            )
        record: dict[str, Any] = {
            "layer": layer, "method": method, "pool": layer_pool or "none", "split": how,
            "num_train": len(train_part), "num_test": len(test_part), "num_features": train_part.dim,
            "num_classes": num_classes, "chance": 1 / num_classes,
        }  # fmt: skip
        if method == "knn":
            predictions = knn_predict(train_part, test_part, num_classes, k=k, temperature=temperature, device=run_on)
            record.update(test_accuracy=float((predictions == test_part.labels).mean()), k=k, temperature=temperature)
            detail = f"k-NN k {k}, T {temperature:g}"
        else:
            full_batch = len(train_part) * train_part.dim * 4 <= max_full_batch_mib * 2**20
            if solver == "lbfgs" or (solver == "auto" and full_batch):
                record.update(_probe_lbfgs(train_part, test_part, num_classes, epochs or 100, lr, weight_decay))
                detail = f"L-BFGS, train {record['train_accuracy']:.3f}"
            else:
                result = fit_minibatch(
                    train_part, num_classes, epochs=epochs or 10, lrs=lrs, weight_decay=weight_decay,
                    batch_size=batch_size, seed=seed, num_workers=num_workers, device=run_on,
                )  # fmt: skip
                (test_accuracy,) = streamed_accuracy([result.model], test_part, result.standardize, run_on)
                sweep = {str(rate): acc for rate, acc in result.sweep.items()}
                record.update(solver="sgd", test_accuracy=test_accuracy, lr=result.lr, lr_sweep=sweep)
                detail = f"mini-batch SGD on {run_on.type}, lr {result.lr:g} from {'/'.join(map(format, lrs, ['g'] * len(lrs)))}"
        records[layer] = record
        log(
            f"{layer}: test accuracy {record['test_accuracy']:.3f} ({detail}; {len(train_part)} train / "
            f"{len(test_part)} test, {train_part.dim} features, pool {record['pool']}, "
            f"{num_classes} classes, chance {1 / num_classes:.3f})"
        )
    return records


def _probe_lbfgs(
    train: Samples, test: Samples, num_classes: int, epochs: int, lr: float, weight_decay: float
) -> dict[str, Any]:
    """The exact full-batch path: both parts in memory, standardized with the training statistics."""
    x_train, x_test = train.load(), test.load()
    y_train, y_test = torch.from_numpy(train.labels), torch.from_numpy(test.labels)
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-6)
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    model = fit_logistic_regression(x_train, y_train, num_classes, epochs=epochs, lr=lr, weight_decay=weight_decay)
    with torch.no_grad():
        train_accuracy = (model(x_train).argmax(1) == y_train).float().mean().item()
        test_accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return {"solver": "lbfgs", "test_accuracy": test_accuracy, "train_accuracy": train_accuracy}


def probe(store: str | Path | None = None, layers: Sequence[str] | None = None, **options: Any) -> dict[str, float]:
    """Test accuracy per layer (all stored layers by default); options as ``probe_layers``."""
    return {layer: r["test_accuracy"] for layer, r in probe_layers(store, layers, **options).items()}


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of numbers, e.g. 0.01,0.1") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"learning rates must be positive, got '{text}'")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m extract.probe", description="Probe test accuracy (linear or k-NN) for each layer of a store."
    )
    p.add_argument("store", nargs="?", help="a complete extract store, split into train and test by --test-fraction")
    p.add_argument("--train", metavar="STORE", help="train on this store (with --test; e.g. ImageNet train)")
    p.add_argument("--test", metavar="STORE", help="test on this store (with --train; e.g. ImageNet val)")
    p.add_argument(
        "--layers", nargs="+", metavar="L", help="layers or globs (encoder.layers.*) to probe (default: all)"
    )
    p.add_argument("--method", default="linear", help="linear (default) or knn")
    p.add_argument("--pool", help="avg | max | cls | mean | none (default: avg for maps, cls for tokens)")
    p.add_argument("--test-fraction", type=float, default=0.2, help="held-out share of the samples (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split and of the mini-batch order (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    p.add_argument("--device", help="cpu | cuda[:N] for k-NN and mini-batch training (default: a GPU if there is one)")
    linear = p.add_argument_group("linear")
    linear.add_argument(
        "--solver",
        default="auto",
        help="lbfgs | sgd | auto (default: L-BFGS when the train set fits --max-full-batch-mib)",
    )
    linear.add_argument(
        "--max-full-batch-mib",
        type=float,
        default=DEFAULT_MAX_FULL_BATCH_MIB,
        help="largest float32 train set for L-BFGS (default 1024)",
    )
    linear.add_argument(
        "--epochs", type=int, help="L-BFGS iterations (default 100) or SGD passes over the train set (default 10)"
    )
    linear.add_argument("--lr", type=float, default=1.0, help="L-BFGS step size (default 1)")
    linear.add_argument(
        "--lrs",
        type=_rates,
        default=list(DEFAULT_LRS),
        help="SGD learning rates swept on a held-out 10%% of the train set (default 0.01,0.03,0.1,0.3)",
    )
    linear.add_argument("--batch-size", type=int, default=256, help="SGD batch size (default 256)")
    linear.add_argument("--num-workers", type=int, default=0, help="DataLoader workers reading SGD batches (default 0)")
    linear.add_argument("--weight-decay", type=float, default=1e-3, help="L2 penalty on the weights (default 1e-3)")
    knn = p.add_argument_group("knn")
    knn.add_argument("--k", type=int, default=DEFAULT_K, help=f"neighbours that vote (default {DEFAULT_K})")
    knn.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help=f"vote weight exp(similarity / T) (default {DEFAULT_TEMPERATURE})")  # fmt: skip
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        records = probe_layers(
            args.store, args.layers, train=args.train, test=args.test, method=args.method, pool=args.pool,
            test_fraction=args.test_fraction, seed=args.seed, epochs=args.epochs, lr=args.lr,
            weight_decay=args.weight_decay, solver=args.solver, max_full_batch_mib=args.max_full_batch_mib,
            batch_size=args.batch_size, lrs=args.lrs, num_workers=args.num_workers, k=args.k,
            temperature=args.temperature, device=args.device,
        )  # fmt: skip
        if args.json:
            stores = {"store": args.store} if args.store else {"train": args.train, "test": args.test}
            write_output("--json", args.json, json.dumps({**stores, "layers": list(records.values())}, indent=2) + "\n")
    except ExtractError as e:
        print(f"extract.probe: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
