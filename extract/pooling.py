"""Reductions applied to a captured activation before it leaves the device (``--pool``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .errors import ExtractError

Pool = Callable[[torch.Tensor], torch.Tensor]

POOL_CHOICES = ("none", "avg", "max", "avg:K", "cls", "mean")


def _spatial(name: str, fn: Pool) -> Pool:
    def pool(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise PoolShapeError(name, tuple(x.shape), "(B, C, H, W)", "cls or mean" if x.dim() == 3 else "none")
        return fn(x)

    return pool


def _tokens(name: str, fn: Pool) -> Pool:
    def pool(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise PoolShapeError(name, tuple(x.shape), "(B, T, D)", "avg or max" if x.dim() == 4 else "none")
        return fn(x)

    return pool


class PoolShapeError(ExtractError):
    def __init__(self, pool: str, shape: tuple[int, ...], wanted: str, instead: str) -> None:
        self.pool, self.shape, self.wanted, self.instead = pool, shape, wanted, instead
        super().__init__(f"--pool {pool} needs a {wanted} output but got shape {list(shape)}; use --pool {instead}")

    def for_layer(self, layer: str) -> ExtractError:
        return ExtractError(
            f"--pool {self.pool} does not fit layer '{layer}': it needs a {self.wanted} output, "
            f"the layer gives {list(self.shape)}; use --pool {self.instead} for this layer"
        )


def make_pool(spec: str) -> Pool | None:
    """Parse a ``--pool`` value; ``None`` means keep the full output."""
    if spec == "none":
        return None
    if spec == "avg":
        return _spatial(spec, lambda x: x.mean(dim=(2, 3)))
    if spec == "max":
        return _spatial(spec, lambda x: x.amax(dim=(2, 3)))
    if spec.startswith("avg:"):
        size = spec[4:]
        if not size.isdigit() or int(size) < 1:
            raise ExtractError(f"--pool {spec}: K must be a positive integer, e.g. avg:2")
        k = int(size)
        return _spatial(spec, lambda x: F.adaptive_avg_pool2d(x, k))
    if spec == "cls":
        return _tokens(spec, lambda x: x[:, 0])
    if spec == "mean":
        return _tokens(spec, lambda x: x.mean(dim=1))
    raise ExtractError(f"unknown --pool '{spec}'; choose one of {', '.join(POOL_CHOICES)}")
