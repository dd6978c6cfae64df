"""Layer names every stage shares: ``LayerRef`` (one captured output or input, and the name a store calls it),
``matches_glob`` (the one-segment globs of ``--layers`` and of a store's layers), ``closest`` (the
suggestions an unknown name gets) and ``shape_text`` (the shape every message shows). Resolving
patterns against a model is capture's machinery (``extract.capture.layers``)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

# ``NAME@input``: what module NAME receives rather than what it returns. Not ``NAME:input``: ``:``
# already selects an element of an output (``NAME:0``, ``NAME:key``), and a dict output may well
# have a key "input"; no module name of PyTorch, timm or transformers holds an ``@``.
INPUT_SUFFIX = "@input"
# ``BLOCK@router``: each token's routing in mixture-of-experts block BLOCK, as its router gives it (the
# logits over the experts, and the top-k experts with their weights); ``extract.capture.moe``.
ROUTER_SUFFIX = "@router"


@dataclass(frozen=True)
class LayerRef:
    """One captured tensor: ``module`` is a name from ``named_modules()``; ``input`` says it is what
    the module receives (its first positional argument, else its ``hidden_states`` keyword), not
    what it returns; ``router`` says it is the routing of mixture-of-experts block ``module`` (its
    router's logits, top-k experts and weights, ``extract.capture.moe``); ``selector`` picks an element of a tuple/list (an index) or dict (a key)
    output; ``alias`` is the source's name for it (``hidden_states.3``, ``blocks.3.hook_resid_pre``),
    when it was asked for by that. ``name`` is how the store calls it, ``target`` what it resolved to."""

    module: str
    selector: int | str | None = None
    alias: str | None = None
    input: bool = False
    router: bool = False

    @property
    def target(self) -> str:
        """``module``, ``module:selector``, ``module@input`` or ``module@router``: the tensor itself, whatever
        it is called."""
        if self.input or self.router:
            return self.site
        return self.module if self.selector is None else f"{self.module}:{self.selector}"

    @property
    def site(self) -> str:
        """Where a hook sees it: the module's output (``module``), its input (``module@input``) or its
        router's output (``module@router``)."""
        if self.router:
            return f"{self.module}{ROUTER_SUFFIX}"
        return f"{self.module}{INPUT_SUFFIX}" if self.input else self.module

    @property
    def name(self) -> str:
        return self.alias if self.alias is not None else self.target


def matches_glob(pattern: str, name: str) -> bool:
    # '*' stays inside one dotted segment, so 'layer*' gives layer1..layer4, not their children.
    parts, segments = pattern.split("."), name.split(".")
    return len(parts) == len(segments) and all(fnmatchcase(s, p) for p, s in zip(parts, segments, strict=True))


def closest(name: str, candidates: list[str], n: int = 3) -> str:
    close = difflib.get_close_matches(name, candidates, n=n, cutoff=0.5) or candidates[:n]
    return ", ".join(close)


def shape_text(shape: Sequence[int], batch: int | None = None) -> str:
    """``(B, 256, 4, 4)``: the batch axis as B, as --list-layers and every message show shapes."""
    dims = [str(d) for d in shape]
    if dims and batch is not None and shape[0] == batch:
        dims[0] = "B"
    return f"({', '.join(dims)})"
