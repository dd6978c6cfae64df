"""Before anything is written: run the requested layers on a dummy batch to validate them (each runs
once, its batch axis comes first, its pooling fits) and learn each one's layout, pooling and stored
shape."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ExtractError
from ..models import LoadedModel
from .hooks import Capture
from .layers import LayerRef, model_failed, shape_text
from .layout import LAYOUTS, infer_layout, selected_shape, trace
from .pooling import Pool, PoolShapeError, make_pool, per_layer


@dataclass
class LayerSetup:
    """Per stored layer (by ``LayerRef.name``): its pooling, the layout of the captured output, and
    the shape stored per sample."""

    pools: dict[str, str]
    reduce: dict[str, Pool | None]
    layouts: dict[str, str | None]
    shapes: dict[str, tuple[int, ...]]

    def stored_layouts(self) -> dict[str, str | None]:
        """The layout of each stored array: the captured one when kept whole, NCHW after ``avg:K``
        (it pools a channels-last map as NCHW too), none for the vectors the other pools leave."""
        return {name: _stored_layout(self.pools[name], self.layouts[name]) for name in self.shapes}


def _stored_layout(pool: str, captured: str | None) -> str | None:
    if pool == "none":
        return captured
    return "NCHW" if pool.startswith("avg:") else None


def setup_layers(
    loaded: LoadedModel,
    model: torch.nn.Module,
    refs: Sequence[LayerRef],
    pool: str | Sequence[str],
    layout: Sequence[str] | None,
    example: torch.Tensor,
    autocast: Any,
) -> LayerSetup:
    """``example`` is a batch of 2 at the model's input size, on the model's device. One forward
    captures the layers whole (validating them), a second at twice the size tells their layouts;
    the pooling is then tried on what the first captured."""
    outputs = _capture(loaded, model, refs, example, autocast)
    larger = torch.nn.functional.interpolate(example, scale_factor=2.0) if example.dim() == 4 else example

    def run(x: torch.Tensor) -> Any:
        with autocast:
            return loaded.call(model, x)

    try:
        large = trace(model, run, larger.contiguous(memory_format=_memory_format(example)), {r.module for r in refs})
    except Exception:  # noqa: BLE001 - a model with a fixed input size: other rules decide the layouts
        large = {}
    given = per_layer(layout or [], refs, "layout", None)
    for name, value in given.items():
        if value is not None and value not in LAYOUTS:
            raise ExtractError(f"--layout {name}={value}: choose one of {', '.join(LAYOUTS)}")
    modules = dict(model.named_modules())
    layouts: dict[str, str | None] = {}
    for ref in refs:
        large_shape = selected_shape(large[ref.module][0], ref.selector) if ref.module in large else None
        inferred = infer_layout(
            ref.module, modules[ref.module], outputs[ref.name].shape, large_shape, loaded.layout_hints
        )
        layouts[ref.name] = given[ref.name] or inferred
    pools = {name: value or "none" for name, value in per_layer(pool, refs, "pool", "none").items()}
    reduce = {ref.name: make_pool(pools[ref.name], layouts[ref.name]) for ref in refs}
    shapes = {}
    for ref in refs:
        value, fn = outputs[ref.name], reduce[ref.name]
        if fn is not None:
            try:
                with torch.inference_mode():
                    value = fn(value)
            except PoolShapeError as e:
                raise e.for_layer(ref.name) from None
        if value.dim() == 0 or value.shape[0] != len(example):
            raise ExtractError(
                f"layer '{ref.name}' gives shape {shape_text(value.shape)} for a batch of {len(example)}: "
                "its first axis is not the batch; pick another layer"
            )
        shapes[ref.name] = tuple(value.shape[1:])
    return LayerSetup(pools, reduce, layouts, shapes)


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    return (
        torch.channels_last
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
        else (torch.contiguous_format)
    )


def _capture(
    loaded: LoadedModel, model: torch.nn.Module, refs: Sequence[LayerRef], example: torch.Tensor, autocast: Any
) -> dict[str, torch.Tensor]:
    """One batch through the capture, kept whole: each layer runs exactly once and its selector fits."""
    try:
        with Capture(model, list(refs)) as cap, torch.inference_mode(), autocast:
            loaded.call(model, example)
    except ExtractError:
        raise
    except Exception as e:  # noqa: BLE001 - the model's own complaint, on one line
        raise model_failed(example, e) from None
    if missing := cap.missing():
        raise ExtractError(f"layer {', '.join(map(repr, missing))} never ran in the forward; pick layers that run")
    return cap.outputs
