"""Reductions of a text layer's (B, T, ...) output that depend on the batch: the rows of the tokens a
rank stores, or one row per document pooled over its real tokens (never the padding).

The loop sets ``TextSelection`` before each forward; every layer's ``TextReduce`` reads it. Pooling is
the attention-mask-aware pooling sentence-transformers uses: ``mean`` sums the real tokens and divides
by their count, ``max`` ignores padded positions, ``first`` takes position 0 (a CLS token) and
``last`` the last real token (how embedding models built on causal LMs pool).

``--pool model`` is a model's own pooling (``ModelPooling``): one of those, then an L2 normalization
where the model's pipeline has one (sentence-transformers' ``Normalize``); the model source reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ExtractError, TextShapeError
from ..names.pooling import MODEL_POOL, TEXT_POOLS


@dataclass
class TextSelection:
    """The batch's attention mask (B, T) and either ``flat`` (the stored tokens' positions ``b * T + t``,
    in store order) or ``order`` (the batch's documents in store order)."""

    mask: torch.Tensor | None = None
    flat: torch.Tensor | None = None
    order: torch.Tensor | None = None


class TextReduce:
    """``pool`` ``none``: the stored token rows (R, ...); else one pooled row per document (B, ...),
    L2-normalized where ``normalize`` (``--pool model`` of a model whose pipeline normalizes)."""

    def __init__(self, pool: str, selection: TextSelection, normalize: bool = False) -> None:
        if pool != "none" and pool not in TEXT_POOLS:
            raise ExtractError(
                f"--pool {pool} does not apply to a text layer; use none (per token), {', '.join(TEXT_POOLS)} "
                f"or {MODEL_POOL}"
            )
        if normalize and pool == "none":
            raise ValueError("normalize applies to a pooled row, not to --pool none")
        self.pool, self.selection, self.normalize = pool, selection, normalize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.selection.mask
        assert mask is not None, "the loop sets the batch's selection before the forward"
        if x.dim() < 3 or tuple(x.shape[:2]) != tuple(mask.shape):
            raise TextShapeError(tuple(x.shape), tuple(mask.shape))
        # a model dispatched over several GPUs (--device-map) has layers on other devices than its inputs
        if self.pool == "none":
            assert self.selection.flat is not None
            return x.flatten(0, 1)[self.selection.flat.to(x.device)]
        pooled = pool_tokens(x, mask.to(x.device), self.pool)
        if self.normalize:  # in float32, as sentence-transformers normalizes its float32 embedding
            pooled = F.normalize(pooled.float().flatten(1), dim=1).view(pooled.shape)
        return pooled if self.selection.order is None else pooled[self.selection.order.to(x.device)]


def pool_tokens(x: torch.Tensor, mask: torch.Tensor, pool: str) -> torch.Tensor:
    """(B, T, ...) -> (B, ...) over each row's real tokens (``mask`` 1), in float32 where summed."""
    real = mask.bool().view(*mask.shape, *([1] * (x.dim() - 2)))
    if pool == "mean":
        total = (x.float() * real).sum(1)
        return total / real.sum(1).clamp(min=1)
    if pool == "max":
        return x.masked_fill(~real, float("-inf")).amax(1)
    if pool == "first":
        return x[:, 0]
    if pool == "last":
        last = mask.long().sum(1).clamp(min=1) - 1
        return x[torch.arange(x.shape[0], device=x.device), last]
    raise ValueError(f"pool {pool!r}: choose one of {', '.join(TEXT_POOLS)}")
