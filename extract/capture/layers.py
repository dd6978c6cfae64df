"""Layer resolution: ``--layers`` patterns (names, one-segment globs, ``NAME:0`` / ``NAME:key`` selectors,
``NAME@input`` and the source's aliases such as ``hidden_states.N`` and TransformerLens's hook names)
resolved to ``LayerRef``s against a model, the tensor a selector picks in a module's output, the
tensor a module's input is, and the shape of any output in messages. The names themselves
(``LayerRef``, ``matches_glob``, ``closest``, ``shape_text``) are ``extract.names.layers``."""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from ..errors import ExtractError, InvalidRequestError, LayerNotFoundError
from ..names.layers import INPUT_SUFFIX, ROUTER_SUFFIX, LayerRef, closest, matches_glob, shape_text
from .lens import LENS_HINT
from .moe import moe_blocks, router_name

INPUT_KEYWORD = "hidden_states"  # the keyword transformers passes a block's or an attention's input by


def _split_site(pattern: str) -> tuple[str, str]:
    """``NAME@input`` -> (NAME, "@input"), ``NAME@router`` -> (NAME, "@router"); a pattern without ``@``
    -> (pattern, "")."""
    module, at, site = pattern.partition("@")
    if not at:
        return pattern, ""
    if f"@{site}" not in (INPUT_SUFFIX, ROUTER_SUFFIX) or ":" in module:
        raise InvalidRequestError(
            f"layer '{pattern}': '@' spells a module's input, NAME{INPUT_SUFFIX}, or a mixture-of-experts block's "
            f"routing, BLOCK{ROUTER_SUFFIX} (one tensor: no ':' selector)"
        )
    return module, f"@{site}"


def _split_selector(pattern: str) -> tuple[str, int | str | None]:
    module, sep, selector = pattern.partition(":")
    if not sep:
        return module, None
    if not selector:
        raise InvalidRequestError(f"layer '{pattern}' has an empty selector; write NAME:0 or NAME:key")
    return module, int(selector) if selector.lstrip("-").isdigit() else selector


def _normalize_alias(pattern: str, aliases: Mapping[str, LayerRef]) -> str:
    """``hidden_states.-1`` -> ``hidden_states.12``: negative indices count from the end, as in Python."""
    prefix, _, number = pattern.rpartition(".")
    if not (number.startswith("-") and number[1:].isdigit() and f"{prefix}.0" in aliases):
        return pattern
    count = sum(1 for name in aliases if name.rpartition(".")[0] == prefix)
    index = count + int(number)
    if index < 0:
        raise InvalidRequestError(
            f"layer '{pattern}': there are only {count} {prefix} (0 to {count - 1}, or -1 to -{count})"
        )
    return f"{prefix}.{index}"


def resolve_layers(
    model: nn.Module,
    patterns: list[str],
    aliases: Mapping[str, LayerRef] | None = None,
    absent: Mapping[str, str] | None = None,
    alias_failure: str | None = None,
) -> list[LayerRef]:
    """Expand names and globs against ``model.named_modules()`` and the source's ``aliases``
    (``hidden_states.N``, TransformerLens names), in the model's order (a module's input before its
    output), without duplicates. ``absent`` maps an alias this model has no tensor for to why
    (``blocks.0.hook_resid_mid`` of a parallel-residual block): asked for, it is that one line.
    ``alias_failure`` is the model's error where the forward that finds the aliases failed: a name of
    theirs is refused with it, the real cause, not as a module the model lacks."""
    if not patterns:
        raise InvalidRequestError("no layers given; pass --layers NAME [NAME ...] (see --list-layers)")
    aliases, absent = aliases or {}, absent or {}
    names = [name for name, _ in model.named_modules() if name]
    refs: list[LayerRef] = []
    for pattern in patterns:
        pattern = _normalize_alias(pattern, aliases)
        if any(c in pattern for c in "*?[") and (found_aliases := [a for a in aliases if matches_glob(pattern, a)]):
            refs.extend(aliases[a] for a in found_aliases)
            continue
        if pattern in aliases:
            refs.append(aliases[pattern])
            continue
        if pattern in absent:
            raise LayerNotFoundError(
                f"layer '{pattern}': {absent[pattern]}; closest: {closest(pattern, list(aliases))}"
            )
        module_pattern, suffix = _split_site(pattern)
        module_pattern, selector = _split_selector(module_pattern)
        if any(c in module_pattern for c in "*?["):
            found = [n for n in names if matches_glob(module_pattern, n)]
        else:
            found = [module_pattern] if module_pattern in names else []
        if not found and alias_failure is not None and _alias_shaped(pattern):
            raise ExtractError(
                f"layer '{pattern}' is found by running the model once, and {alias_failure}; "
                "the model must run before any layer can be extracted from it"
            )
        if not found:
            raise LayerNotFoundError(_no_match(pattern, module_pattern, names, list(aliases), suffix))
        if suffix == ROUTER_SUFFIX:  # only an MoE block has a routing: said now, before any forward
            blocks = set(moe_blocks(model))
            if not any(n in blocks for n in found):
                router_name(model, found[0])  # raises: names the module and the model's MoE blocks
            found = [n for n in found if n in blocks]
        refs.extend(LayerRef(n, selector, input=suffix == INPUT_SUFFIX, router=suffix == ROUTER_SUFFIX) for n in found)
    order = {n: i for i, n in enumerate(names)}
    unique = dict.fromkeys(sorted(refs, key=lambda r: (order[r.module], not r.input, r.alias is not None)))
    return list(unique)


def _alias_shaped(pattern: str) -> bool:
    """Whether ``pattern`` is spelt as the aliases a source finds by a forward are (``hidden_states.N``,
    TransformerLens's ``blocks.N.hook_*``)."""
    return pattern.startswith("hidden_states") or "hook_" in pattern


def _no_match(pattern: str, module_pattern: str, names: list[str], aliases: list[str], suffix: str = "") -> str:
    """Why ``pattern`` matched nothing: the closest names (with ``suffix``: ``@input`` for an input),
    and, where a glob would have matched had its ``*`` crossed a dot, how to write it."""
    candidates = [*(name + suffix for name in names), *aliases]
    message = f"layer '{pattern}' matches no module; closest: {closest(module_pattern + suffix, candidates)}"
    if "hook_" in pattern and not any("hook_" in alias for alias in aliases):
        message += f"; {LENS_HINT}"
    if any(c in module_pattern for c in "*?[") and (across := [n for n in names if fnmatchcase(n, module_pattern)]):
        depth = across[0].count(".") + 1
        hint = module_pattern.replace("*", "*" + ".*" * (depth - module_pattern.count(".") - 1), 1)
        message += (
            f"; '*' stays within one dotted segment, so it does not match {across[0]}: write {hint}{suffix} "
            f"({len(across)} module{'s' if len(across) != 1 else ''} match it across segments)"
        )
    return message + " (run with --list-layers for all names)"


def select(output: Any, ref: LayerRef) -> torch.Tensor:
    """The tensor ``ref`` names inside a module's output."""
    if ref.selector is None:
        if isinstance(output, torch.Tensor):
            return output
        kind = type(output).__name__
        hint = next(iter(output), "key") if isinstance(output, dict) else 0
        raise InvalidRequestError(
            f"layer '{ref.module}' returns a {kind}, not a tensor; pick one element, e.g. '{ref.module}:{hint}'"
        )
    if isinstance(output, torch.Tensor):
        raise InvalidRequestError(f"layer '{ref.module}' returns a tensor, not a tuple or dict; drop ':{ref.selector}'")
    try:
        value = output[ref.selector]
    except (IndexError, KeyError, TypeError):
        raise InvalidRequestError(
            f"layer '{ref.name}': its output {describe(output)} has no element {ref.selector!r}"
        ) from None
    if not isinstance(value, torch.Tensor):
        raise InvalidRequestError(f"layer '{ref.name}' selects a {type(value).__name__}, not a tensor")
    return value


def module_input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """What ``NAME@input`` is, from the arguments a forward pre-hook sees: the first positional
    argument, else the ``hidden_states`` keyword argument (None when neither was given)."""
    if args:
        return args[0]
    return kwargs.get(INPUT_KEYWORD)


def select_input(value: Any, ref: LayerRef, kwargs: Mapping[str, Any]) -> torch.Tensor:
    """``value`` (``module_input``), refused in one line unless it is a tensor."""
    if isinstance(value, torch.Tensor):
        return value
    took = f"keywords {', '.join(kwargs)}" if kwargs else "no keywords"
    given = f"its first argument is {describe(value)}" if value is not None else f"no argument and no {INPUT_KEYWORD}="
    raise InvalidRequestError(
        f"layer '{ref.name}': {ref.module} is called with {given} ({took}), so its input is not a tensor; "
        "capture another module's input or output (see --list-layers)"
    )


def describe(output: Any, batch: int | None = None) -> str:
    """A short shape description of any module output (or of its ``shape_tree``)."""
    if isinstance(output, (torch.Tensor, torch.Size)):
        return shape_text(output.shape if isinstance(output, torch.Tensor) else output, batch)
    if isinstance(output, (tuple, list)):
        return "[" + ", ".join(describe(o, batch) for o in output) + "]"
    if isinstance(output, dict):
        return "{" + ", ".join(f"{k}: {describe(v, batch)}" for k, v in output.items()) + "}"
    return output if isinstance(output, str) else type(output).__name__
