"""``Capture``, the one hook manager: every place that needs a module's output or input (extraction,
the interventions, --list-layers and layout probing, the ``hidden_states`` and TransformerLens
aliases) goes through it.

Style after baukit's ``Trace``: one context manager, behaviour chosen by keyword arguments,
hooks removed on any exit, and stopping the forward early is an exception the context swallows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from ..errors import ExtractError, PoolShapeError, StopForward, TextShapeError
from ..names.layers import LayerRef, closest
from ..names.pooling import Pool
from .layers import module_input, resolve_layers, select, select_input
from .layout import shape_tree
from .moe import pack_routing, router_name

Sink = Callable[[str, torch.Tensor], None]
Gather = Callable[[str, torch.Tensor], torch.Tensor]  # a layer's captured slice -> the whole tensor (``sharded``)
Edit = Callable[[torch.Tensor], Any]
Retain = Literal["output", "shape", "reference"]
RETAIN_CHOICES = ("output", "shape", "reference")


class Capture:
    """Capture the outputs (and inputs) of ``layers`` of ``model`` in its forward passes.

    Example::

        with Capture(model, ["layer3", "layer4"]) as cap:
            model(x)
        cap.outputs["layer3"]

        with Capture(model, retain="shape") as cap:  # every submodule, every call
            model(x)
        cap.by_module()["layer1.0.relu"]  # [torch.Size(...), torch.Size(...)]: it runs twice

        with Capture(model, ["transformer.h.1.mlp@input"], stop=True) as cap:
            model(ids)  # stops before the MLP runs: its input is all that was asked for

    Args:
        layers: names, globs (``layer*``), ``name:0`` / ``name:key`` selectors or ``name@input``, or
            resolved ``LayerRef``s; ``None``: every submodule of ``model`` (its output).
            ``name@input`` is what the module receives, seen by a forward pre-hook (with its keyword
            arguments) before it runs: its first positional argument, else its ``hidden_states``
            keyword argument (transformers calls attention modules, and some decoder layers, that
            way); anything else is refused naming the keywords it took.
        retain: what a forward leaves behind.
            ``"output"``: each layer's selected tensor, detached and cloned, in ``outputs`` (or handed
            to ``sink``); a layer whose module runs twice in one forward is refused.
            ``"shape"``: the ``shape_tree`` of every call of each layer's module, in ``seen`` (an input
            under ``name@input``); a module may run any number of times, and selectors are not applied
            (``selected_shape`` does that).
            ``"reference"``: every call's output object itself (not detached, not copied), in ``seen``:
            for finding by identity which module returned a given tensor.
        reduce: applied to each detached output before it is kept (a ``--pool`` reduction), or a
            mapping from stored layer name to the reduction of that layer (``None``: keep it whole).
            ``retain="output"`` only.
        stop: raise ``StopForward`` once every layer has fired, skipping the rest of the forward
            (an input fires before its module runs, so the module itself is skipped too when it was
            the last); the ``with`` block and ``forward()`` swallow it.
        edit: module name -> function of the module's output. A returned value replaces the output,
            ``None`` keeps the (possibly in-place modified) output; downstream modules and captures
            of that module see the edit.
        sink: called as ``sink(layer, tensor)`` instead of keeping a clone in ``outputs``; the tensor
            may be changed in place later in the forward, so the sink must copy it before returning
            or order its copy before any later work (as ``HostStaging.stage`` does). ``retain="output"`` only.
        gather: called as ``gather(layer, tensor)`` before ``reduce``, giving the whole tensor where a
            tensor-parallel model holds a slice of it on each rank (``extract.capture.sharded``); every rank
            of the group must run the same forwards, as the gather is a collective. ``retain="output"`` only.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[str | LayerRef] | None = None,
        *,
        retain: Retain = "output",
        reduce: Pool | Mapping[str, Pool | None] | None = None,
        stop: bool = False,
        edit: Mapping[str, Edit] | None = None,
        sink: Sink | None = None,
        gather: Gather | None = None,
    ) -> None:
        if retain not in RETAIN_CHOICES:
            raise ValueError(f"retain={retain!r}: choose one of {', '.join(RETAIN_CHOICES)}")
        if retain != "output" and (reduce is not None or sink is not None):
            raise ValueError(f"reduce and sink apply to retain='output', not retain={retain!r}")
        self.model = model
        self.refs = _refs(model, layers)
        self.retain = retain
        self.reduce = reduce
        self.stop = stop
        self.edit = dict(edit or {})
        self.sink = sink
        self.gather = gather
        self.outputs: dict[str, torch.Tensor] = {}
        self.seen: list[tuple[str, Any]] = []  # (site, shape tree or output) per call, in the order they fired
        self.calls: Counter[str] = Counter()  # per site: a module's name (its output) or name@input
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> Capture:
        modules = dict(self.model.named_modules())
        for name in self.edit:
            if name not in modules:
                raise ExtractError(
                    f"edit names module '{name}', which does not exist; closest: {closest(name, list(modules))}"
                )
        outputs: dict[str, list[LayerRef]] = {}
        inputs: dict[str, list[LayerRef]] = {}
        routers: dict[str, list[LayerRef]] = {}
        for ref in self.refs:
            if ref.module not in modules:
                raise ExtractError(f"layer '{ref.name}' names module '{ref.module}', which does not exist; "
                                   f"closest: {closest(ref.module, list(modules))}")  # fmt: skip
            kind = routers if ref.router else inputs if ref.input else outputs
            kind.setdefault(ref.module, []).append(ref)
        try:
            self._handles.append(self.model.register_forward_pre_hook(self._new_forward))
            for name, refs in inputs.items():
                hook = self._make_input_hook(name, refs)
                self._handles.append(modules[name].register_forward_pre_hook(hook, with_kwargs=True))
            for block, refs in routers.items():
                self._hook_router(modules, block, refs)
            for name in dict.fromkeys([*outputs, *self.edit]):
                hook = self._make_hook(name, outputs.get(name, []), self.edit.get(name))
                self._handles.append(modules[name].register_forward_hook(hook))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> bool:
        self.remove()
        return exc_type is not None and issubclass(exc_type, StopForward)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __getitem__(self, layer: str) -> torch.Tensor:
        return self.outputs[layer]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model; returns its output, or ``None`` when the capture stopped it early."""
        try:
            return self.model(*args, **kwargs)
        except StopForward:
            return None

    def by_module(self) -> dict[str, list[Any]]:
        """What ``retain="shape"`` or ``"reference"`` kept in the last forward, per module (an input
        under ``name@input``, see ``LayerRef.site``), one entry a call."""
        kept: dict[str, list[Any]] = {}
        for name, value in self.seen:
            kept.setdefault(name, []).append(value)
        return kept

    def missing(self) -> list[str]:
        """Layers that did not fire in the last forward."""
        return [ref.name for ref in self.refs if self.calls[ref.site] == 0]

    def _new_forward(self, module: nn.Module, args: Any) -> None:
        self.calls.clear()
        self.seen.clear()

    def _count(self, site: str, module: str, refs: list[LayerRef]) -> None:
        self.calls[site] += 1
        if refs and self.retain == "output" and self.calls[site] > 1:
            parent = module.rpartition(".")[0] or "a module that runs once"
            raise ExtractError(
                f"layer '{site}' ran {self.calls[site]} times in one forward (a shared module); "
                f"capture a module that runs once, e.g. '{parent}'"
            )

    def _make_input_hook(self, name: str, refs: list[LayerRef]) -> Callable[..., Any]:
        site = refs[0].site

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._count(site, name, refs)
            value = module_input(args, kwargs)
            if self.retain == "output":
                value = select_input(value, refs[0], kwargs)
            self._retain(site, refs, value)
            if self.stop and not self.missing():
                raise StopForward

        return hook

    def _hook_router(self, modules: Mapping[str, nn.Module], block: str, refs: list[LayerRef]) -> None:
        """``BLOCK@router``: the block's input tells its tokens' shape (B, T), which the router sees
        flattened; the router's output is packed per token (``extract.capture.moe``)."""
        site = refs[0].site
        lead: list[torch.Size] = []

        def shape(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            lead[:] = [select_input(module_input(args, kwargs), refs[0], kwargs).shape[:-1]]

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            self._count(site, block, refs)
            packed = pack_routing(output, lead[0], refs[0].name)
            if self.retain != "output":  # what is stored of it: the logits, a row per token
                self._retain(site, refs, output if self.retain == "reference" else packed[..., : output[0].shape[-1]])
                return
            for ref in refs:
                self._keep(ref, packed)
            if self.stop and not self.missing():
                raise StopForward

        router = modules[router_name(self.model, block)]
        self._handles.append(modules[block].register_forward_pre_hook(shape, with_kwargs=True))
        self._handles.append(router.register_forward_hook(hook))

    def _make_hook(self, name: str, refs: list[LayerRef], edit: Edit | None) -> Callable[..., Any]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> Any:
            self._count(name, name, refs)
            replaced = None
            if edit is not None:
                replaced = edit(output)
                if replaced is not None:
                    output = replaced
            if refs:
                self._retain(name, refs, output)
            if self.stop and refs and not self.missing():
                raise StopForward
            return replaced

        return hook

    def _retain(self, site: str, refs: list[LayerRef], output: Any) -> None:
        if self.retain == "shape":
            self.seen.append((site, shape_tree(output)))
        elif self.retain == "reference":
            self.seen.append((site, output))
        else:
            for ref in refs:
                self._keep(ref, output if ref.input else select(output, ref))

    def _keep(self, ref: LayerRef, value: torch.Tensor) -> None:
        value = value.detach()
        if self.gather is not None:
            value = self.gather(ref.name, value)
        reduce = self.reduce.get(ref.name) if isinstance(self.reduce, Mapping) else self.reduce
        if reduce is not None:
            try:
                value = reduce(value)
            except (PoolShapeError, TextShapeError) as e:  # the message names the layer
                raise e.for_layer(ref.name) from None
        if self.sink is not None:
            self.sink(ref.name, value)
        else:
            self.outputs[ref.name] = value.clone()


def _refs(model: nn.Module, layers: Sequence[str | LayerRef] | None) -> list[LayerRef]:
    """The given ``LayerRef``s, then what the patterns resolve to; every submodule when ``layers`` is None."""
    if layers is None:
        return [LayerRef(name) for name, _ in model.named_modules() if name]
    patterns = [layer for layer in layers if isinstance(layer, str)]
    refs = [layer for layer in layers if isinstance(layer, LayerRef)]
    if patterns:
        refs += resolve_layers(model, patterns)
    return refs
