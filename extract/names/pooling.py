"""Pool names and the reductions they make: ``make_pool`` parses one ``--pool`` (or a reader's ``pool=``)
into the reduction of an output along the axes its ``Layout`` says, which capture applies before a
captured activation leaves the device and a reader applies to stored rows; ``per_layer`` spreads
``--pool`` and ``--layout`` values over the layers. The names of a text layer's pools (``TEXT_POOLS``,
``MODEL_POOL``) and what a model's own files name (``ModelPooling``) are here too; the reductions of
a text batch are capture's (``extract.capture.tokens``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ExtractError, PoolShapeError
from . import MODEL_POOL, POOL_CHOICES, TEXT_POOLS  # noqa: F401 - declared where the parser reads them
from .layers import LayerRef, matches_glob
from .layout import Layout

Pool = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelPooling:
    """``--pool model``: the pooling a model's own pipeline applies to its token rows, as the model
    source read it from the model's files: ``pool`` (one of ``TEXT_POOLS``), then an L2
    normalization where ``normalize``. ``source`` says which files said so, for the store's record."""

    pool: str
    normalize: bool
    source: str

    def __post_init__(self) -> None:
        if self.pool not in TEXT_POOLS:
            raise ValueError(f"pool {self.pool!r}: choose one of {', '.join(TEXT_POOLS)}")

    def record(self) -> dict[str, Any]:
        """What the store records as applied (``model_pooling``)."""
        return {"pool": self.pool, "normalize": self.normalize, "source": self.source}


def _spatial(name: str, layout: Layout | None, fn: Callable[[torch.Tensor], torch.Tensor]) -> Pool:
    """``fn`` works on NCHW; a channels-last map is permuted to it first (a view, no copy)."""

    def pool(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise PoolShapeError(name, tuple(x.shape), "(B, C, H, W)", "cls or mean" if x.dim() == 3 else "none")
        if layout is None or layout.spatial_axes is None:
            raise PoolShapeError(name, tuple(x.shape), "known layout", "none")
        return fn(x.movedim(layout.channel_axis, 1))

    return pool


def _tokens(name: str, token_axis: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> Pool:
    """``fn`` works on (B, T, D); a (B, D, T) output (``token_axis`` 2) is transposed to it first."""

    def pool(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise PoolShapeError(name, tuple(x.shape), "(B, T, D)", "avg or max" if x.dim() == 4 else "none")
        return fn(x.movedim(token_axis, 1))

    return pool


def make_pool(spec: str, layout: Layout | str | None = Layout.NCHW) -> Pool | None:
    """Parse one ``--pool`` value for an output of ``layout`` (a ``Layout`` or its name, as a store's
    ``layouts`` attribute keeps it); ``None`` means keep the full output."""
    known = Layout(layout) if layout else None
    if spec == "none":
        return None
    if spec == "avg":
        return _spatial(spec, known, lambda x: x.mean(dim=(2, 3)))
    if spec == "max":
        return _spatial(spec, known, lambda x: x.amax(dim=(2, 3)))
    if spec.startswith("avg:"):
        size = spec[4:]
        if not size.isdigit() or int(size) < 1:
            raise ExtractError(f"--pool {spec}: K must be a positive integer, e.g. avg:2")
        k = int(size)
        return _spatial(spec, known, lambda x: F.adaptive_avg_pool2d(x, k))
    # a layout that is not a token one (or none) reads as NLC: PyTorch transformers are batch-first
    token_axis = 2 if known is Layout.NCL else 1
    if spec == "cls":
        return _tokens(spec, token_axis, lambda x: x[:, 0])
    if spec == "mean":
        return _tokens(spec, token_axis, lambda x: x.mean(dim=1))
    if spec == MODEL_POOL:  # a text model's own pipeline: its files name it (``ModelPooling``)
        raise ExtractError(
            f"--pool {MODEL_POOL} is the pooling a text model's sentence-transformers files name; "
            f"an image layer takes one of {', '.join(POOL_CHOICES)}"
        )
    raise ExtractError(f"unknown --pool '{spec}'; choose one of {', '.join(POOL_CHOICES)}")


def per_layer(
    values: str | Sequence[str], refs: Sequence[LayerRef], flag: str, default: str | None
) -> dict[str, str | None]:
    """``--pool avg`` / ``--pool layer3=avg layer4=none`` (likewise ``--layout``) -> the value for
    each layer. A bare value applies to every layer; ``PATTERN=VALUE`` to the layers whose stored
    name or module matches PATTERN (globs as in --layers); later entries override earlier ones."""
    chosen: dict[str, str | None] = {ref.name: default for ref in refs}
    for item in [values] if isinstance(values, str) else values:
        pattern, sep, value = item.rpartition("=")
        if not sep:
            chosen = dict.fromkeys(chosen, value)
            continue
        hits = [ref.name for ref in refs if _pattern_hits(pattern, ref)]
        if not hits:
            raise ExtractError(
                f"--{flag} {item}: '{pattern}' names none of the layers ({', '.join(r.name for r in refs)})"
            )
        chosen.update(dict.fromkeys(hits, value))
    return chosen


def _pattern_hits(pattern: str, ref: LayerRef) -> bool:
    # an alias answers to its module's name too (--pool transformer.h.2=mean for hidden_states.3), but a
    # module's input only to NAME@input: the module's name is its output's
    names = {ref.name, ref.target} | (set() if ref.input else {ref.module})
    return any(pattern == name or matches_glob(pattern, name) for name in names)
