"""The model sources, each declared once in its own module as a ``ModelSource``: what ``--model``
names, its dispatch, its messages (an unknown source's name, a missing extra, an empty name after
the prefix) and the list of kinds in ``--help`` all come from those declarations.

A name with a declared prefix (``timm:NAME``) goes to that source; any other ``a:b`` is a factory,
and a bare name is torchvision's. Declaring imports no optional library: ``resolve`` imports the
source's library when it is asked for, so that a missing one is a one-line error naming its extra.
"""

from __future__ import annotations

import importlib

from ..errors import ExtractError
from . import factory, hf, open_clip, timm, torchvision
from .base import ModelSource

SOURCES: tuple[ModelSource, ...] = (torchvision.SOURCE, timm.SOURCE, hf.SOURCE, open_clip.SOURCE, factory.SOURCE)
_PREFIXED = {source.name: source for source in SOURCES if source.prefixed}
_BY_NAME = {source.name: source for source in SOURCES}


def resolve(model: str) -> tuple[ModelSource, str]:
    """The source ``--model`` names and the name it gets (what follows the prefix); the source's
    library is imported here, so that a missing one is refused before anything is built."""
    prefix, sep, rest = model.partition(":")
    if not sep:
        return torchvision.SOURCE, model
    source = _PREFIXED.get(prefix)
    if source is None:
        return factory.SOURCE, model
    if not rest:
        raise ExtractError(f"--model {model}: name the model after '{prefix}:', e.g. {source.example}")
    _require(source)
    return source, rest


def _require(source: ModelSource) -> None:
    if source.library is None:
        return
    try:
        importlib.import_module(source.library)
    except ImportError:
        raise ExtractError(
            f"--model {source.name}:... needs the '{source.library}' package; "
            f"install it with pip install 'extract[{source.extra}]'"
        ) from None


def library_of(name: str | None) -> str | None:
    """The optional library of the source recorded as ``name`` (None for torchvision and factories)."""
    source = _BY_NAME.get(name or "")
    return source.library if source else None


def model_kinds() -> str:
    """What ``--model`` takes, for ``--help``: every source's usage, in declaration order."""
    *first, last = (source.usage for source in SOURCES)
    return f"{', '.join(first)}, or {last}"
