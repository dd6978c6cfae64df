"""Which axis of a captured output holds the channels: ``infer_layout`` finds an output's ``Layout``
(``NCHW`` or ``NHWC`` for 4-D outputs, ``NLC`` or ``NCL`` for 3-D ones; the type is
``extract.names.layout``). Pooling over the wrong axes would store wrong features silently.

The rule, in order:
1. The shapes say: the model runs once at its input size and once at twice that; the axes that grow
   are the spatial (or token) ones. This decides every model that takes other input sizes (CNNs,
   ConvNeXt with its channels-last block internals, DINOv2).
2. The module says: ``*2d`` modules (Conv2d, BatchNorm2d, LayerNorm2d, pooling) work on NCHW and
   ``*1d`` ones on NCL; ``Linear`` and ``LayerNorm`` act on the last axis (NHWC / NLC).
3. The source says: timm models whose ``output_fmt`` is NHWC (Swin) compute their feature stages in
   (B, H, W, C).
4. A 3-D output is NLC (PyTorch transformers are batch-first); a 4-D output stays unknown, and
   pooling it is refused until ``--layout LAYER=NCHW|NHWC`` says which.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..names.layout import Layout

CHANNELS_LAST_MODULES = (nn.Linear, nn.LayerNorm)


def shape_tree(output: Any) -> Any:
    """The shapes inside a module's output: a ``torch.Size`` per tensor, in the output's structure."""
    if isinstance(output, torch.Tensor):
        return output.shape
    if isinstance(output, (tuple, list)):
        return tuple(shape_tree(o) for o in output)
    if isinstance(output, dict):
        return {k: shape_tree(v) for k, v in output.items()}
    return type(output).__name__


def selected_shape(tree: Any, selector: int | str | None) -> torch.Size | None:
    """The shape of the tensor a layer's selector picks in a ``shape_tree``, if it is one."""
    if selector is not None:
        try:
            tree = tree[selector]
        except (IndexError, KeyError, TypeError):
            return None
    return tree if isinstance(tree, torch.Size) else None


def _from_shapes(small: torch.Size, large: torch.Size | None) -> Layout | None:
    if large is None or len(large) != len(small):
        return None
    grew = frozenset(axis for axis in range(1, len(small)) if large[axis] != small[axis])
    for layout in Layout:
        if layout.ndim == len(small) and grew == frozenset(layout.spatial_axes or (layout.token_axis,)):
            return layout
    return None


def _from_module(module: nn.Module, ndim: int) -> Layout | None:
    kind = type(module).__name__.lower()
    if ndim == 4 and kind.endswith("2d"):
        return Layout.NCHW
    if ndim == 3 and kind.endswith("1d"):
        return Layout.NCL
    if isinstance(module, CHANNELS_LAST_MODULES):
        return Layout.NHWC if ndim == 4 else Layout.NLC
    return None


def _from_hints(name: str, hints: Mapping[str, str]) -> Layout | None:
    for prefix, layout in hints.items():
        if name == prefix or name.startswith(prefix + "."):
            return Layout(layout)
    return None


def infer_layout(
    name: str,
    module: nn.Module,
    small: torch.Size | None,
    large: torch.Size | None,
    hints: Mapping[str, str] | None = None,
) -> Layout | None:
    """The layout of one output (see the module docstring for the rule); ``None`` when unknown or
    when the output is not 3-D or 4-D."""
    if small is None or len(small) not in (3, 4):
        return None
    hinted = _from_hints(name, hints or {})
    layout = (
        _from_shapes(small, large)
        or _from_module(module, len(small))
        or (hinted if hinted and hinted.ndim == len(small) else None)
    )
    if layout is None and len(small) == 3:
        layout = Layout.NLC
    return layout
