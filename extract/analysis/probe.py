"""Probes: how much each stored layer knows about the labels, by a linear classifier or k-NN.

    probe_layers(store, layers, ProbeOptions(method="knn"), test_fraction=0.2)   # records per layer
    probe(store, method="knn")                                                    # accuracy per layer

(``python -m extract.probe``, in ``extract.cli.probe``, is the command over ``probe_layers``.)

Per layer: load the features (maps average-pooled, token outputs reduced to the class token unless
``pool`` says otherwise), split the labelled samples of one store by a seeded permutation (or
train on one store and test on another), and report the test accuracy, one line per layer. A layer
that cannot be read as asked is skipped with a line saying why (the probe fails only when none is
left); a constant layer (the same features for every sample) is reported as constant, not scored.

- linear, small N: standardize with the training statistics and fit a multinomial logistic
  regression by full-batch L-BFGS on the CPU (exact and deterministic: zero init, convex loss).
- linear, large N (the training set beyond ``max_full_batch_mib``, or ``solver="sgd"``): the
  mini-batch probe of ``extract.analysis.linear`` streaming from the store, on a GPU when there is one.
- knn: DINO's weighted k-NN (cosine similarity, k 20, T 0.07) in blocks (``extract.analysis.knn``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ExtractError, InvalidRequestError
from ..read.features import Features
from .knn import knn_predict
from .linear import accuracy as streamed_accuracy
from .linear import fit_minibatch
from .options import DEFAULT_TEST_FRACTION, ProbeOptions
from .samples import Samples, UnusableLayerError, default_pool, labelled_rows, no_layer_left, open_rows, select_layers

__all__ = [
    "ProbeOptions",
    "default_pool",
    "fit_logistic_regression",
    "probe",
    "probe_layers",
    "probe_rows",
    "resolve_device",
    "split",
]


def split(labelled: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test sample indices from a seeded permutation of ``labelled``."""
    if not 0 < test_fraction < 1:
        raise InvalidRequestError(f"--test-fraction must be between 0 and 1, got {test_fraction}")
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
        raise InvalidRequestError(f"--device '{device}' is not a torch device; use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ExtractError(f"--device {device}: no CUDA device here; use --device cpu (or leave it out)")
    return resolved


def _open(path: str | Path) -> Features:
    features = open_rows(path, "extract.probe")
    if len(labelled_rows(features)) == 0:
        raise ExtractError(f"{path} has no labels (all -1): nothing to probe")
    return features


def _parts(
    store: str | Path | None, train: str | Path | None, test: str | Path | None, test_fraction: float, seed: int
) -> tuple[Features, np.ndarray, Features, np.ndarray, str]:
    """(train features, train rows, test features, test rows, how they were split)."""
    if (store is None) == (train is None and test is None) or (train is None) != (test is None):
        raise InvalidRequestError("give one STORE (split by --test-fraction) or both --train STORE and --test STORE")
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
    options: ProbeOptions | None = None,
    *,
    train: str | Path | None = None,
    test: str | Path | None = None,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """One record per layer (in model order): test accuracy and how it was obtained; logs one line each.

    Give one ``store``, whose labelled samples are split by ``test_fraction`` (seeded by
    ``options.seed``), or both ``train`` and ``test`` stores."""
    options = options or ProbeOptions()
    train_features, train_rows, test_features, test_rows, how = _parts(store, train, test, test_fraction, options.seed)
    if test_features is train_features:
        names = select_layers(train_features.layers, layers, store=train_features.path)
    else:
        names = _shared_layers(train_features, test_features, layers, log)
    return probe_rows(train_features, train_rows, test_features, test_rows, names, options, how=how, log=log)


def _shared_layers(
    train: Features, test: Features, patterns: Sequence[str] | None, log: Callable[[str], None]
) -> list[str]:
    """The layers (of ``patterns``) that both stores hold, in the train store's order; one line names
    those only one of them holds."""
    stored = [*train.layers, *(layer for layer in test.layers if layer not in train.layers)]
    names = select_layers(stored, patterns, store=f"{train.path} or {test.path}")
    shared = [name for name in names if name in train.layers and name in test.layers]
    left_out = [
        f"{name} (only in {train.path if name in train.layers else test.path})" for name in names if name not in shared
    ]
    if not shared:
        raise ExtractError(f"{train.path} and {test.path} hold no layer in common: {', '.join(left_out)}")
    if left_out:
        log(f"left out, not in both stores: {', '.join(left_out)}")
    return shared


def probe_rows(
    train_features: Features,
    train_rows: np.ndarray,
    test_features: Features,
    test_rows: np.ndarray,
    layers: Sequence[str],
    options: ProbeOptions | None = None,
    *,
    how: str,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """``probe_layers`` on given (sorted) train and test rows of opened stores; ``how`` says how they were chosen."""
    options = options or ProbeOptions()
    run_on = resolve_device(options.device)
    num_classes = int(max(train_features.labels.max(), test_features.labels.max())) + 1
    records, skipped = {}, {}
    for layer in layers:
        try:
            records[layer] = _probe_layer(
                layer, train_features, train_rows, test_features, test_rows, num_classes, options, run_on, how, log
            )
        except UnusableLayerError as e:
            skipped[layer] = e.reason
            log(f"{layer}: skipped ({e.reason})")
    if not records:
        raise no_layer_left("probe", skipped)
    return records


def _probe_layer(
    layer: str,
    train_features: Features,
    train_rows: np.ndarray,
    test_features: Features,
    test_rows: np.ndarray,
    num_classes: int,
    options: ProbeOptions,
    run_on: torch.device,
    how: str,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One layer's record, and its line in the log."""
    layer_pool = options.pool or default_pool(train_features, layer)
    train_part = Samples(train_features, layer, layer_pool, train_rows)
    test_part = Samples(test_features, layer, layer_pool, test_rows)
    if train_part.dim != test_part.dim:
        raise UnusableLayerError(
            test_features.path, layer, f"it has {train_part.dim} features in {train_features.path} but "
            f"{test_part.dim} in {test_features.path}: the stores come from different models or pooling",
        )  # fmt: skip
    extracted = pooled_at_extraction(train_features, layer)
    classes = train_features.classes
    record: dict[str, Any] = {
        "layer": layer, "method": options.method, "pool": layer_pool or "none", "pool_at_extraction": extracted,
        "split": how, "num_train": len(train_part), "num_test": len(test_part), "num_features": train_part.dim,
        "num_classes": num_classes, "chance": 1 / num_classes, "classes": classes,
    }  # fmt: skip
    sizes = f"{len(train_part)} train / {len(test_part)} test, {train_part.dim} features, pool {_pooling(layer_pool, extracted)}"
    if train_part.constant:
        record.update(constant=True, test_accuracy=None)
        log(f"{layer}: constant, not scored (every training sample has the same features: the layer does not "
            f"depend on the input; {sizes})")  # fmt: skip
        return record
    detail = _fit_and_test(record, train_part, test_part, num_classes, options, run_on)
    log(
        f"{layer}: test accuracy {record['test_accuracy']:.3f} ({detail}; {sizes}, "
        f"{num_classes} classes{named(classes)}, chance {1 / num_classes:.3f})"
    )
    return record


def pooled_at_extraction(features: Features, layer: str) -> str | None:
    """The pool ``layer`` was reduced by before it was stored (``--pool`` at extraction), or None."""
    pool = (features.attrs.get("pools") or {}).get(layer)
    return None if pool in (None, "none") else str(pool)


def _pooling(read: str | None, extracted: str | None) -> str:
    """How a layer's rows were reduced, in the log's words: a store pooled at extraction says so, rather
    than 'none' for the probe's own (lack of) pooling."""
    if extracted is None:
        return read or "none"
    return f"{extracted} at extraction" + (f", then {read}" if read else "")


def named(classes: Sequence[str] | None, shown: int = 8) -> str:
    """The store's class names for a line, `` (a, b, c)``, the first ``shown`` and a count of the rest;
    empty where the store names none."""
    if not classes:
        return ""
    more = f", ... {len(classes) - shown} more" if len(classes) > shown else ""
    return f" ({', '.join(classes[:shown])}{more})"


def _fit_and_test(
    record: dict[str, Any], train: Samples, test: Samples, num_classes: int, options: ProbeOptions, run_on: torch.device
) -> str:
    """Probe one layer by ``options.method``: add the test accuracy and what produced it to ``record``,
    and return the words the log line says about the method."""
    if options.method == "knn":
        k, temperature = options.k, options.temperature
        predictions = knn_predict(train, test, num_classes, k=k, temperature=temperature, device=run_on)
        record.update(test_accuracy=float((predictions == test.labels).mean()), k=k, temperature=temperature)
        return f"k-NN k {k}, T {temperature:g}"
    full_batch = len(train) * train.dim * 4 <= options.max_full_batch_mib * 2**20
    if options.solver == "lbfgs" or (options.solver == "auto" and full_batch):
        record.update(_probe_lbfgs(train, test, num_classes, options.epochs or 100, options.lr, options.weight_decay))
        return f"L-BFGS, train {record['train_accuracy']:.3f}"
    result = fit_minibatch(
        train, num_classes, epochs=options.epochs or 10, lrs=options.lrs, weight_decay=options.weight_decay,
        batch_size=options.batch_size, seed=options.seed, num_workers=options.num_workers, device=run_on,
    )  # fmt: skip
    (test_accuracy,) = streamed_accuracy([result.model], test, result.standardize, run_on)
    sweep = {str(rate): acc for rate, acc in result.sweep.items()}
    record.update(solver="sgd", test_accuracy=test_accuracy, lr=result.lr, lr_sweep=sweep)
    rates = "/".join(f"{rate:g}" for rate in options.lrs)
    return f"mini-batch SGD on {run_on.type}, lr {result.lr:g} from {rates}"


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


def probe(
    store: str | Path | None = None,
    layers: Sequence[str] | None = None,
    *,
    train: str | Path | None = None,
    test: str | Path | None = None,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    log: Callable[[str], None] = print,
    **options: Any,
) -> dict[str, float]:
    """Test accuracy per layer (all stored layers by default; NaN for a constant one); ``options`` are
    ``ProbeOptions`` fields (``method="knn"``, ``epochs=50``, ...), the other arguments as ``probe_layers``."""
    records = probe_layers(
        store, layers, ProbeOptions(**options), train=train, test=test, test_fraction=test_fraction, log=log
    )
    return {layer: math.nan if r.get("constant") else r["test_accuracy"] for layer, r in records.items()}
