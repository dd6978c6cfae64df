"""The model sources, each declared once here as a ``ModelSource``: what ``--model`` names, its
dispatch, its messages (an unknown source's name, a missing extra, an empty name after the prefix)
and the list of kinds in ``--help`` all come from these declarations.

A declaration names its builder by module and function (``extract.models.timm:build``), imported
when a model is built: reading the declarations (``--help``, a bad flag) imports neither torch nor
any source's library. A name with a declared prefix (``timm:NAME``) goes to that source; any other
``a:b`` is a factory, and a bare name is torchvision's. ``resolve`` imports the source's library when
it is asked for, so that a missing one is a one-line error naming its extra.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ExtractError, InvalidRequestError

if TYPE_CHECKING:
    from .base import LoadedModel, ModelRequest


@dataclass(frozen=True)
class ModelSource:
    """A ``--model`` source (as timm declares a model with ``@register_model``).

    ``name`` is what the store records as the source, and the prefix that selects it
    (``timm:NAME``) when ``prefixed``; the two sources that are not prefixed take the other names
    (a torchvision name, or ``pkg.module:factory``). ``builder`` is ``module:function``, a
    ``(the name after the prefix, the request) -> LoadedModel`` imported on use. ``library`` is the
    import name of the optional library it needs and ``extra`` the pip extra that installs it.
    """

    name: str
    usage: str  # how --model names it, for --help: "timm:NAME[.TAG]"
    example: str  # a --model value that works, for messages
    builder: str  # "extract.models.timm:build"
    prefixed: bool = True
    library: str | None = None
    extra: str | None = None

    def build(self, name: str, request: ModelRequest) -> LoadedModel:
        """The model ``name`` (what follows the prefix) in eval mode, by the source's own builder."""
        module, _, function = self.builder.partition(":")
        return getattr(importlib.import_module(module), function)(name, request)


TORCHVISION = ModelSource(
    "torchvision", usage="torchvision name", example="resnet50", builder="extract.models.torchvision:build",
    prefixed=False,
)  # fmt: skip
TIMM = ModelSource(
    "timm", usage="timm:NAME[.TAG]", example="timm:vit_small_patch16_224", builder="extract.models.timm:build",
    library="timm", extra="timm",
)  # fmt: skip
HF = ModelSource(
    "hf", usage="hf:ID_OR_DIR", example="hf:facebook/dinov2-small", builder="extract.models.hf:build",
    library="transformers", extra="hf",
)  # fmt: skip
OPEN_CLIP = ModelSource(
    "open_clip", usage="open_clip:ARCH[:TAG_OR_FILE]", example="open_clip:ViT-B-32",
    builder="extract.models.open_clip:build", library="open_clip", extra="clip",
)  # fmt: skip
FACTORY = ModelSource(
    "factory", usage="pkg.module:factory / file.py:factory", example="pkg.module:factory",
    builder="extract.models.factory:build", prefixed=False,
)  # fmt: skip

SOURCES: tuple[ModelSource, ...] = (TORCHVISION, TIMM, HF, OPEN_CLIP, FACTORY)
_PREFIXED = {source.name: source for source in SOURCES if source.prefixed}
_BY_NAME = {source.name: source for source in SOURCES}


def resolve(model: str) -> tuple[ModelSource, str]:
    """The source ``--model`` names and the name it gets (what follows the prefix); the source's
    library is imported here, so that a missing one is refused before anything is built."""
    prefix, sep, rest = model.partition(":")
    if not sep:
        return TORCHVISION, model
    source = _PREFIXED.get(prefix)
    if source is None:
        return FACTORY, model
    if not rest:
        raise InvalidRequestError(f"--model {model}: name the model after '{prefix}:', e.g. {source.example}")
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
