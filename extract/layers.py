"""Turn ``--layers`` patterns into concrete modules, and pick one element of a tuple/dict output."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from .errors import ExtractError


@dataclass(frozen=True)
class LayerRef:
    """One captured output: ``module`` is a name from ``named_modules()``; ``selector`` picks
    an element of a tuple/list (an index) or dict (a key) output. ``name`` is how the store calls it."""

    module: str
    selector: int | str | None = None

    @property
    def name(self) -> str:
        return self.module if self.selector is None else f"{self.module}:{self.selector}"


def _split_selector(pattern: str) -> tuple[str, int | str | None]:
    module, sep, selector = pattern.partition(":")
    if not sep:
        return module, None
    if not selector:
        raise ExtractError(f"layer '{pattern}' has an empty selector; write NAME:0 or NAME:key")
    return module, int(selector) if selector.lstrip("-").isdigit() else selector


def _matches(pattern: str, name: str) -> bool:
    # '*' stays inside one dotted segment, so 'layer*' gives layer1..layer4, not their children.
    parts, segments = pattern.split("."), name.split(".")
    return len(parts) == len(segments) and all(fnmatchcase(s, p) for p, s in zip(parts, segments, strict=True))


def closest(name: str, candidates: list[str], n: int = 3) -> str:
    close = difflib.get_close_matches(name, candidates, n=n, cutoff=0.5) or candidates[:n]
    return ", ".join(close)


def resolve_layers(model: nn.Module, patterns: list[str]) -> list[LayerRef]:
    """Expand names and globs against ``model.named_modules()``, in the model's order, without duplicates."""
    if not patterns:
        raise ExtractError("no layers given; pass --layers NAME [NAME ...] (see --list-layers)")
    names = [name for name, _ in model.named_modules() if name]
    refs: list[LayerRef] = []
    for pattern in patterns:
        module_pattern, selector = _split_selector(pattern)
        if any(c in module_pattern for c in "*?["):
            found = [n for n in names if _matches(module_pattern, n)]
        else:
            found = [module_pattern] if module_pattern in names else []
        if not found:
            raise ExtractError(
                f"layer '{pattern}' matches no module; closest: {closest(module_pattern, names)} "
                "(run with --list-layers for all names)"
            )
        refs.extend(LayerRef(n, selector) for n in found)
    order = {n: i for i, n in enumerate(names)}
    unique = dict.fromkeys(sorted(refs, key=lambda r: order[r.module]))
    return list(unique)


def select(output: Any, ref: LayerRef) -> torch.Tensor:
    """The tensor ``ref`` names inside a module's output."""
    if ref.selector is None:
        if isinstance(output, torch.Tensor):
            return output
        kind = type(output).__name__
        hint = next(iter(output), "key") if isinstance(output, dict) else 0
        raise ExtractError(
            f"layer '{ref.module}' returns a {kind}, not a tensor; pick one element, e.g. '{ref.module}:{hint}'"
        )
    if isinstance(output, torch.Tensor):
        raise ExtractError(f"layer '{ref.module}' returns a tensor, not a tuple or dict; drop ':{ref.selector}'")
    try:
        value = output[ref.selector]
    except (IndexError, KeyError, TypeError):
        raise ExtractError(
            f"layer '{ref.name}': its output ({describe(output)}) has no element {ref.selector!r}"
        ) from None
    if not isinstance(value, torch.Tensor):
        raise ExtractError(f"layer '{ref.name}' selects a {type(value).__name__}, not a tensor")
    return value


def describe(output: Any) -> str:
    """A short shape description of any module output, for --list-layers and messages."""
    if isinstance(output, torch.Tensor):
        return str(list(output.shape))
    if isinstance(output, (tuple, list)):
        return "(" + ", ".join(describe(o) for o in output) + ")"
    if isinstance(output, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in output.items()) + "}"
    return type(output).__name__


def list_layers(model: nn.Module, example: torch.Tensor) -> list[tuple[str, str, str]]:
    """(name, class, output shape) for every submodule, from one forward of ``example``."""
    seen: dict[str, list[str]] = {}
    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(
                module.register_forward_hook(lambda m, i, o, name=name: seen.setdefault(name, []).append(describe(o)))
            )
    try:
        with torch.inference_mode():
            model(example)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for name, module in model.named_modules():
        if not name:
            continue
        shapes = seen.get(name)
        if shapes is None:
            shape = "(not run)"
        elif len(shapes) > 1:
            shape = f"{shapes[0]} (runs {len(shapes)}x: not capturable)"
        else:
            shape = shapes[0]
        rows.append((name, type(module).__name__, shape))
    return rows
