"""Forwards on a dummy batch, before anything is written.

``setup_layers`` runs the requested layers to validate them (each runs once, its batch axis comes
first, its pooling fits) and learns each one's layout, pooling and stored shape. ``list_layers``
runs every submodule (its output and its input) and alias for --list-layers: its class, shape and layout."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import ExtractError, PoolShapeError, TextShapeError
from ..names.layers import LayerRef, shape_text
from ..names.layout import Layout
from ..names.pooling import MODEL_POOL, TEXT_POOLS, ModelPooling, Pool, make_pool, per_layer
from .cast import check_batch
from .hooks import Capture
from .layers import describe
from .layout import infer_layout, selected_shape
from .moe import moe_blocks
from .sharded import GroupGather
from .tokens import TextReduce, TextSelection

Run = Callable[[Any], Any]
Example = torch.Tensor | Mapping[str, torch.Tensor]  # a batch of pixels, or of tokenized text (input_ids...)


class ModelRunner(Protocol):
    """What the set-up forward needs of a loaded model (``extract.models.LoadedModel`` is one): how
    to call a module on a batch, and the layouts its source knows (module name -> ``NHWC``...)."""

    @property
    def layout_hints(self) -> Mapping[str, str]: ...

    def call(self, module: Callable[..., Any], pixels: torch.Tensor) -> Any: ...


@dataclass
class LayerSetup:
    """Per stored layer (by ``LayerRef.name``): its pooling, the layout of the captured output, and
    the shape stored per sample."""

    pools: dict[str, str]
    reduce: dict[str, Pool | None]
    layouts: dict[str, Layout | None]
    shapes: dict[str, tuple[int, ...]]

    def stored_layouts(self) -> dict[str, str | None]:
        """The layout of each stored array (plain strings, as the store's attributes keep them): the
        captured one when kept whole, NCHW after ``avg:K`` (it pools a channels-last map as NCHW too),
        none for the vectors the other pools leave."""
        return {name: _stored_layout(self.pools[name], self.layouts[name]) for name in self.shapes}


def _stored_layout(pool: str, captured: Layout | None) -> str | None:
    if pool == "none":
        return None if captured is None else str(captured)
    return "NCHW" if pool.startswith("avg:") else None


def output_shapes(
    model: nn.Module, run: Run, example: torch.Tensor, layers: Sequence[LayerRef] | None = None
) -> dict[str, list[Any]]:
    """Each module's (or each of ``layers``' sites') output ``shape_tree`` in one forward of
    ``example``: a list per module (an input under ``NAME@input``), one entry a call, since a shared
    module runs more than once."""
    with Capture(model, layers, retain="shape") as cap, torch.inference_mode():
        run(example)
    return cap.by_module()


def setup_layers(
    loaded: ModelRunner,
    model: nn.Module,
    refs: Sequence[LayerRef],
    pool: str | Sequence[str],
    layout: Sequence[str] | None,
    example: torch.Tensor,
    autocast: Any,
    dtype: torch.dtype | None = None,
) -> LayerSetup:
    """``example`` is a batch of 2 at the model's input size, on the model's device. One forward
    captures the layers whole (validating them), a second at twice the size tells their layouts;
    the pooling is then tried on what the first captured, and what it leaves must fit the storage
    ``dtype`` (``CastOverflowError`` where a value would be stored as inf, before anything is written)."""
    outputs = _capture(loaded, model, refs, example, autocast)

    def run(x: torch.Tensor) -> Any:
        with autocast:
            return loaded.call(model, x)

    larger = torch.nn.functional.interpolate(example, scale_factor=2.0) if example.dim() == 4 else example
    try:
        large = output_shapes(model, run, larger.contiguous(memory_format=_memory_format(example)), refs)
    except Exception:  # noqa: BLE001 - a model with a fixed input size: other rules decide the layouts
        large = {}
    layouts = _layouts(model, refs, outputs, large, layout, loaded.layout_hints)
    pools = {name: value or "none" for name, value in per_layer(pool, refs, "pool", "none").items()}
    reduce = {ref.name: make_pool(pools[ref.name], layouts[ref.name]) for ref in refs}
    stored = {ref.name: _reduced(ref, outputs[ref.name], reduce[ref.name]) for ref in refs}
    shapes = {ref.name: _stored_shape(ref, stored[ref.name], len(example)) for ref in refs}
    for name, value in stored.items():
        check_batch(name, value, dtype, "in the set-up forward")
    return LayerSetup(pools, reduce, layouts, shapes)


def _layouts(
    model: nn.Module,
    refs: Sequence[LayerRef],
    outputs: Mapping[str, torch.Tensor],
    large: Mapping[str, list[Any]],
    given: Sequence[str] | None,
    hints: Mapping[str, str],
) -> dict[str, Layout | None]:
    """Each layer's layout: the one ``--layout`` gives, else the one ``infer_layout`` finds."""
    chosen: dict[str, Layout | None] = {}
    for name, value in per_layer(given or [], refs, "layout", None).items():
        try:
            chosen[name] = Layout(value) if value is not None else None
        except ValueError:
            raise ExtractError(f"--layout {name}={value}: choose one of {', '.join(Layout)}") from None
    modules = dict(model.named_modules())
    layouts: dict[str, Layout | None] = {}
    for ref in refs:
        large_shape = selected_shape(large[ref.site][0], ref.selector) if ref.site in large else None
        inferred = infer_layout(ref.module, modules[ref.module], outputs[ref.name].shape, large_shape, hints)
        layouts[ref.name] = chosen[ref.name] or inferred
    return layouts


def _reduced(ref: LayerRef, value: torch.Tensor, reduce: Pool | None) -> torch.Tensor:
    """The pooling tried on the captured batch: what would be stored."""
    if reduce is None:
        return value
    try:
        with torch.inference_mode():
            return reduce(value)
    except PoolShapeError as e:
        raise e.for_layer(ref.name) from None


def _stored_shape(ref: LayerRef, value: torch.Tensor, batch: int) -> tuple[int, ...]:
    """The shape stored per sample of the (pooled) captured batch, whose first axis must be the batch."""
    if value.dim() == 0 or value.shape[0] != batch:
        raise ExtractError(
            f"layer '{ref.name}' gives shape {shape_text(value.shape)} for a batch of {batch}: "
            "its first axis is not the batch; pick another layer"
        )
    return tuple(value.shape[1:])


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _capture(
    loaded: ModelRunner,
    model: nn.Module,
    refs: Sequence[LayerRef],
    example: torch.Tensor,
    autocast: Any,
    gather: GroupGather | None = None,
) -> dict[str, torch.Tensor]:
    """One batch through the capture, kept whole: each layer runs exactly once and its selector fits."""
    try:
        with Capture(model, list(refs), gather=gather) as cap, torch.inference_mode(), autocast:
            loaded.call(model, example)
    except ExtractError:
        raise
    except Exception as e:  # noqa: BLE001 - the model's own complaint, on one line
        raise model_failed(example, e) from None
    if missing := cap.missing():
        raise ExtractError(f"layer {', '.join(map(repr, missing))} never ran in the forward; pick layers that run")
    return cap.outputs


def list_layers(
    model: nn.Module,
    run: Run,
    example: Example,
    larger: Example,
    aliases: Mapping[str, LayerRef] | None = None,
    hints: Mapping[str, str] | None = None,
) -> list[tuple[str, str, str, str]]:
    """(name, class, shape, layout) for every submodule, its input (``NAME@input``, the row after
    it) and every alias, from a forward of ``example`` (and one of ``larger``, which tells the
    layouts; see ``extract.capture.layout``): images, or a mapping of text inputs (a larger one has
    more tokens)."""
    modules = dict(model.named_modules())
    blocks = set(moe_blocks(model))
    listed: list[tuple[str, LayerRef, str]] = []
    for name, module in modules.items():
        if name:
            listed += [(name, LayerRef(name), type(module).__name__)]
            listed += [(LayerRef(name, input=True).name, LayerRef(name, input=True), type(module).__name__)]
            if name in blocks:  # its routing: the logits stored per token, beside the experts and weights
                listed += [(LayerRef(name, router=True).name, LayerRef(name, router=True), "routing")]
    sites = [ref for _, ref, _ in listed]
    try:
        small = output_shapes(model, run, example, sites)
    except Exception as e:  # noqa: BLE001 - the model's own complaint, on one line
        raise model_failed(example, e) from None
    try:
        large = output_shapes(model, run, larger, sites)
    except Exception:  # noqa: BLE001 - a fixed input size: the layouts fall back to the other rules
        large = {}
    listed += [(alias, ref, f"-> {ref.target}") for alias, ref in (aliases or {}).items()]
    return [
        (name, kind, *_shape_and_layout(ref, modules[ref.module], small, large, batch_size(example), hints))
        for name, ref, kind in listed
    ]


def _shape_and_layout(
    ref: LayerRef,
    module: nn.Module,
    small: Mapping[str, list[Any]],
    large: Mapping[str, list[Any]],
    batch: int,
    hints: Mapping[str, str] | None,
) -> tuple[str, str]:
    """One --list-layers row's shape and layout (blank where there is none)."""
    shapes = small.get(ref.site)
    if shapes is None:
        return "(not run)", ""
    if len(shapes) > 1:
        return f"{describe(shapes[0], batch)} (runs {len(shapes)}x: not capturable)", ""
    tree = shapes[0]
    if ref.input and not isinstance(tree, torch.Size):  # see extract.capture.layers.module_input
        given = "no positional argument nor hidden_states=" if tree == "NoneType" else describe(tree, batch)
        return f"{given} (not a tensor: not capturable)", ""
    own = selected_shape(tree, ref.selector)
    shown = own if ref.selector is not None else tree
    layout = None
    if own is not None and own and own[0] == batch:
        big = large.get(ref.site, [None])[0]
        big_shape = selected_shape(big, ref.selector) if big is not None else None
        layout = infer_layout(ref.module, module, own, big_shape, hints)
    return describe(shown, batch), str(layout or "")


def batch_size(example: Example) -> int:
    """The number of samples in a batch of pixels or of text inputs."""
    if isinstance(example, Mapping):
        return len(next(iter(example.values())))
    return len(example)


def model_failed(example: Example, error: BaseException) -> ExtractError:
    """The model's own exception on a dummy batch, as one line that names the input it failed on."""
    first = (str(error).strip().splitlines() or [""])[0]
    if isinstance(example, Mapping):
        ids = example.get("input_ids", next(iter(example.values())))
        return ExtractError(
            f"the model fails on input_ids {shape_text(ids.shape, len(ids))} ({error.__class__.__name__}: {first})"
        )
    return ExtractError(
        f"the model fails on a {shape_text(example.shape, len(example))} input ({error.__class__.__name__}: {first}); "
        "it may need another --image-size (or none)"
    )


@dataclass
class TextLayerSetup(LayerSetup):
    """``LayerSetup`` of a text job: ``selection`` is what the loop sets before each forward, and every
    layer's reduction reads it; ``per_token`` says whether rows are tokens or documents."""

    selection: TextSelection = field(default_factory=TextSelection)
    per_token: bool = True
    model_pooling: ModelPooling | None = None  # what --pool model applies, where a layer asks for it
    gather: GroupGather | None = None  # tensor parallel: the sharded layers made whole over the group

    def stored_layouts(self) -> dict[str, str | None]:
        """A text row is one vector (a token's, or a document's pooled): no layout to record."""
        return dict.fromkeys(self.shapes)


def setup_text_layers(
    loaded: ModelRunner,
    model: nn.Module,
    refs: Sequence[LayerRef],
    pool: str | Sequence[str],
    example: Mapping[str, torch.Tensor],
    autocast: Any,
    model_pooling: Callable[[], ModelPooling] | None = None,
    dtype: torch.dtype | None = None,
    gather: GroupGather | None = None,
) -> TextLayerSetup:
    """One forward of ``example`` (input_ids and attention_mask, (B, T)) validates the layers: each must
    give (B, T, ...). Every layer is either stored per token (``--pool none``) or pooled per document
    (mean, max, first, last, or ``model``: what ``model_pooling()`` says, which raises where the model
    names no pooling of its own): a job is one or the other. A layer stored per token must fit the
    storage ``dtype`` on the example (``CastOverflowError`` otherwise); a pooled one is checked batch by
    batch, as every layer is (``HostStaging``)."""
    pools = {name: value or "none" for name, value in per_layer(pool, refs, "pool", "none").items()}
    if len({value == "none" for value in pools.values()}) > 1:
        given = ", ".join(f"{name}={value}" for name, value in pools.items())
        raise ExtractError(
            f"--pool gives {given}: a text job stores every layer per token (none) or every layer per document "
            f"({', '.join(TEXT_POOLS)}, {MODEL_POOL}); use one kind for all layers, or run two jobs"
        )
    applied = None
    if MODEL_POOL in pools.values():  # before the forward: a model without a pooling of its own is one line
        if model_pooling is None:
            raise ExtractError(
                f"--pool {MODEL_POOL}: this model names no pooling of its own; use {', '.join(TEXT_POOLS)}"
            )
        applied = model_pooling()
    outputs = _capture(loaded, model, refs, example, autocast, gather)  # type: ignore[arg-type]
    if gather is not None:
        gather.check(outputs)
    selection = TextSelection()
    batch = tuple(example["input_ids"].shape)
    reduce: dict[str, Pool | None] = {}
    shapes, layouts = {}, {}
    for ref in refs:
        chosen = pools[ref.name]
        if chosen == MODEL_POOL:
            assert applied is not None
            reduce[ref.name] = TextReduce(applied.pool, selection, normalize=applied.normalize)
        else:
            reduce[ref.name] = TextReduce(chosen, selection)
        shape = tuple(outputs[ref.name].shape)
        if len(shape) < 3 or shape[:2] != batch:
            raise TextShapeError(shape, batch).for_layer(ref.name)  # type: ignore[arg-type]
        shapes[ref.name] = shape[2:]
        layouts[ref.name] = Layout.NLC if len(shape) == 3 else None
        if chosen == "none":  # its rows are the example's tokens (all real: no padding)
            check_batch(ref.name, outputs[ref.name], dtype, "in the set-up forward")
    return TextLayerSetup(
        pools, reduce, layouts, shapes, selection=selection, per_token=all(value == "none" for value in pools.values()),
        model_pooling=applied, gather=gather,
    )  # fmt: skip
