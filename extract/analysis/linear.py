"""The mini-batch linear probe, for training sets too large for full-batch L-BFGS in memory.

One streaming pass computes the training mean and std; a few learning rates are tried at once on
most of the training set and judged on a held-out part of it; the best is retrained on the whole
training set. Batches stream from the store through ``FeatureDataset`` and ``ChunkShuffleSampler``
(each chunk read about once per epoch), so memory holds a window of chunks, never the layer. The
model is multinomial logistic regression (zero init) trained by SGD with momentum and a cosine
schedule, on ``device`` (a GPU when there is one). The order of batches depends only on the seed, so
a run is deterministic for a seed (on CPU; cuBLAS may reorder sums on a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from ..read.dataset import ChunkShuffleSampler, FeatureDataset
from .options import DEFAULT_LRS
from .samples import Samples


@dataclass(frozen=True)
class Standardizer:
    mean: torch.Tensor
    std: torch.Tensor

    def __call__(self, x: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
        return x.sub_(self.mean).div_(self.std) if in_place else (x - self.mean) / self.std

    def to(self, device: torch.device) -> Standardizer:
        return Standardizer(self.mean.to(device), self.std.to(device))


def streaming_standardizer(samples: Samples) -> Standardizer:
    """Mean and std of ``samples`` in one pass over the store, accumulated in float64 (per block:
    Chan et al.'s pairwise merge of count, mean and sum of squared deviations)."""
    count, mean, m2 = 0, torch.zeros(samples.dim, dtype=torch.float64), torch.zeros(samples.dim, dtype=torch.float64)
    rows = max(1, 2**22 // (8 * samples.dim))  # float64 copies of 4 MiB at a time, not of the whole block
    for _, block, _ in samples.blocks():
        for x in block.split(rows):
            x = x.double()
            n, part_mean = len(x), x.mean(0)
            part_m2 = x.sub_(part_mean).square_().sum(0)
            delta = part_mean - mean
            total = count + n
            mean = mean + delta * (n / total)
            m2 = m2 + part_m2 + delta.square() * (count * n / total)
            count = total
    std = (m2 / max(1, count - 1)).sqrt()  # unbiased, as torch.std in the full-batch path
    return Standardizer(mean.float(), std.float().clamp_min(1e-6))


class _Batches:
    """Shuffled mini-batches of some rows of one layer, from the store."""

    def __init__(
        self, samples: Samples, rows: np.ndarray, batch_size: int, seed: int, window: int, workers: int, pin: bool
    ):
        features = samples.features
        self.dataset = FeatureDataset(features.path, samples.layer, pool=samples.pool, cache_chunks=window)
        self.sampler = ChunkShuffleSampler(
            features.num_samples, features.chunk_size, batch_size,
            num_workers=workers, window=window, seed=seed, rank=0, world_size=1, subset=rows,
        )  # fmt: skip
        self.loader = DataLoader(self.dataset, batch_sampler=self.sampler, num_workers=workers, pin_memory=pin)

    def epoch(self, epoch: int):
        self.sampler.set_epoch(epoch)
        for x, y in self.loader:
            yield x.flatten(1), y

    def __len__(self) -> int:
        return len(self.sampler)


def train_sgd(
    batches: _Batches,
    standardize: Standardizer,
    dim: int,
    num_classes: int,
    lrs: Sequence[float],
    *,
    epochs: int,
    weight_decay: float,
    device: torch.device,
) -> list[nn.Linear]:
    """One logistic regression per learning rate, all trained on the same batches (one read of the data)."""
    models = [nn.Linear(dim, num_classes).to(device) for _ in lrs]
    for model in models:
        nn.init.zeros_(model.weight)
        nn.init.zeros_(model.bias)
    groups = [{"params": list(m.parameters()), "lr": lr} for m, lr in zip(models, lrs, strict=True)]
    optimizer = torch.optim.SGD(groups, momentum=0.9, nesterov=True)
    steps = max(1, epochs * len(batches))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    standardize = standardize.to(device)
    for epoch in range(epochs):
        for x, y in batches.epoch(epoch):
            x, y = standardize(x.to(device, non_blocking=True), in_place=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            # the models are independent, so the summed loss gives each its own gradient
            loss = sum(
                nn.functional.cross_entropy(m(x), y) + weight_decay / 2 * m.weight.square().sum() for m in models
            )
            loss.backward()
            optimizer.step()
            schedule.step()
    return models


@torch.no_grad()
def accuracy(
    models: Sequence[nn.Linear], samples: Samples, standardize: Standardizer, device: torch.device
) -> list[float]:
    """Accuracy of each model on ``samples``, streamed block by block."""
    standardize = standardize.to(device)
    correct = torch.zeros(len(models), dtype=torch.int64)
    for _, x, y in samples.blocks():
        x, y = standardize(x.to(device), in_place=True), y.to(device)  # the block is ours: no second copy
        correct += torch.stack([(m(x).argmax(1) == y).sum() for m in models]).cpu()
    return (correct.double() / max(1, len(samples))).tolist()


@dataclass(frozen=True)
class MinibatchResult:
    model: nn.Linear
    standardize: Standardizer
    lr: float
    sweep: dict[float, float]  # learning rate -> held-out accuracy (empty when only one rate was given)


def fit_minibatch(
    train: Samples,
    num_classes: int,
    *,
    epochs: int = 10,
    lrs: Sequence[float] = DEFAULT_LRS,
    weight_decay: float = 1e-3,
    batch_size: int = 256,
    holdout_fraction: float = 0.1,
    seed: int = 0,
    window: int = 8,
    num_workers: int = 0,
    device: str | torch.device = "cpu",
) -> MinibatchResult:
    """Pick the learning rate on a held-out part of ``train``, then train with it on all of ``train``."""
    device = torch.device(device)
    torch.manual_seed(seed)  # nothing random is drawn from torch, but a DataLoader's workers seed from it
    standardize = streaming_standardizer(train)
    rows = train.rows
    sweep: dict[float, float] = {}
    if len(lrs) > 1:
        order = np.random.default_rng((seed, 2)).permutation(len(rows))
        held = np.sort(order[: max(1, round(holdout_fraction * len(rows)))])
        fit_rows = np.delete(rows, held)
        batches = _Batches(train, fit_rows, batch_size, seed, window, num_workers, device.type == "cuda")
        models = train_sgd(
            batches, standardize, train.dim, num_classes, lrs, epochs=epochs, weight_decay=weight_decay, device=device
        )
        held_out = Samples(train.features, train.layer, train.pool, rows[held])
        sweep = dict(zip(lrs, accuracy(models, held_out, standardize, device), strict=True))
    best = max(sweep, key=lambda lr: (sweep[lr], -lr)) if len(lrs) > 1 else lrs[0]  # ties: the smaller rate
    batches = _Batches(train, rows, batch_size, seed + 1, window, num_workers, device.type == "cuda")
    (model,) = train_sgd(
        batches, standardize, train.dim, num_classes, [best], epochs=epochs, weight_decay=weight_decay, device=device
    )
    return MinibatchResult(model, standardize, best, sweep)
