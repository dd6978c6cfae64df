"""Model sources: ``--model`` names a torchvision model, ``timm:NAME``, ``hf:ID_OR_DIR``,
``open_clip:ARCH[:PRETRAINED]`` or a ``pkg.module:factory``. Each source is one module with a
``build(name, request) -> LoadedModel``; this file dispatches on the prefix and applies what is
common to all (seed, checkpoint). Each source brings its library's own preprocessing, exactly:
a generic preset silently changes every feature."""

from __future__ import annotations

import importlib
import platform
from dataclasses import dataclass
from typing import Any

import torch
from torchvision import __version__ as torchvision_version  # the name torchvision is .torchvision here

from ..errors import ExtractError
from .base import LoadedModel, ModelRequest, hub_offline_when_unreachable, load_checkpoint, preprocessing_record

__all__ = ["LoadedModel", "ModelRequest", "build_model", "library_versions", "load_checkpoint", "preprocessing_record"]

# prefix -> (module in this package, the library it needs, the pip extra that installs it)
SOURCES = {
    "timm": ("timm", "timm", "timm"),
    "hf": ("hf", "transformers", "hf"),
    "open_clip": ("open_clip", "open_clip", "clip"),
}


@dataclass(frozen=True)
class _Dispatch:
    source: str
    name: str


def _dispatch(model: str) -> _Dispatch:
    prefix, sep, rest = model.partition(":")
    if sep and prefix in SOURCES:
        if not rest:
            raise ExtractError(f"--model {model}: name the model after '{prefix}:', e.g. {_EXAMPLES[prefix]}")
        return _Dispatch(prefix, rest)
    if sep:
        return _Dispatch("factory", model)
    return _Dispatch("torchvision", model)


_EXAMPLES = {"timm": "timm:vit_small_patch16_224", "hf": "hf:facebook/dinov2-small", "open_clip": "open_clip:ViT-B-32"}


def _source_module(source: str) -> Any:
    if source in SOURCES:
        module, library, extra = SOURCES[source]
        try:
            importlib.import_module(library)
        except ImportError:
            raise ExtractError(
                f"--model {source}:... needs the '{library}' package; install it with pip install 'extract[{extra}]'"
            ) from None
        return importlib.import_module(f".{module}", __name__)
    return importlib.import_module(f".{source}", __name__)


def build_model(
    name: str,
    weights: str,
    checkpoint: str | None,
    seed: int,
    image_size: int | None,
    *,
    load_weights: bool = True,
) -> LoadedModel:
    """The model in eval mode on the CPU, with its source's own preprocessing and a description of
    its weights. ``load_weights=False`` builds the architecture only and never downloads
    (``--list-layers``)."""
    dispatch = _dispatch(name)
    request = ModelRequest(weights, checkpoint, seed, image_size, load_weights and checkpoint is None)
    torch.manual_seed(seed)
    source = _source_module(dispatch.source)
    with hub_offline_when_unreachable():
        loaded = source.build(dispatch.name, request)
    loaded.source = dispatch.source
    if checkpoint is not None and load_weights:
        loaded.checkpoint_sha256 = load_checkpoint(loaded.model, checkpoint)
        loaded.weights = f"checkpoint {checkpoint}"
    loaded.model.eval()
    return loaded


def library_versions(source: str | None = None) -> dict[str, str]:
    import zarr

    from .. import __version__

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision_version,
        "zarr": zarr.__version__,
        "extract": __version__,
    }
    if source in SOURCES:
        library = SOURCES[source][1]
        versions[library] = getattr(importlib.import_module(library), "__version__", "unknown")
    return versions
