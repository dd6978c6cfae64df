"""Model sources: ``--model`` names a torchvision model, ``timm:NAME``, ``hf:ID_OR_DIR``,
``open_clip:ARCH[:PRETRAINED]`` or a ``pkg.module:factory``. Each source is one module that declares
is declared once in ``registry.py`` (a ``ModelSource`` naming its ``build(name, request) -> LoadedModel``,
imported when a model is built), which dispatches on the declarations; this file applies what is common to all (seed, checkpoint,
reading the hub's cache offline). Each source brings its library's own preprocessing, exactly: a
generic preset silently changes every feature.

Importing this package loads neither torch nor any source: the names below are imported on first
use, so that ``extract run --help`` reads the declarations alone."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequestError
from . import registry
from .registry import ModelSource

if TYPE_CHECKING:
    from ..processes import TensorMeshes
    from .base import LoadedModel, ModelRequest, load_checkpoint, preprocessing_record
    from .hf_text import Encoded, TextModel

# name -> the module of this package that defines it, imported on first use (PEP 562)
_LAZY = {
    "LoadedModel": "base",
    "ModelRequest": "base",
    "load_checkpoint": "base",
    "preprocessing_record": "base",
    "Encoded": "hf_text",
    "TextModel": "hf_text",
}

__all__ = [
    "Encoded",
    "LoadedModel",
    "ModelRequest",
    "ModelSource",
    "TextModel",
    "build_model",
    "check_tensor_parallel",
    "library_versions",
    "load_checkpoint",
    "preprocessing_record",
]


def build_model(
    name: str,
    weights: str,
    checkpoint: str | None,
    seed: int,
    image_size: int | None,
    *,
    load_weights: bool = True,
    precision: str | None = None,
    device_map: str | None = None,
    tensor_parallel: TensorMeshes | None = None,
) -> LoadedModel:
    """The model in eval mode on the CPU, with its source's own preprocessing and a description of
    its weights. ``load_weights=False`` builds the architecture only and never downloads
    (``--list-layers``). ``precision`` (fp32 | bf16 | fp16) is the dtype text models load their
    weights in (None: fp32); image models stay in fp32 and ignore it. ``device_map`` ("auto") spreads a
    text model over the GPUs this process sees (everything on the CPU without one); other sources
    refuse it. ``tensor_parallel`` (``extract.processes.TensorMeshes``) splits a text model over this rank's group with
    transformers' own plan."""
    import torch

    from .base import ModelRequest, hub_offline, load_checkpoint

    source, source_name = registry.resolve(name)
    load = load_weights and checkpoint is None
    request = ModelRequest(
        weights,
        checkpoint,
        seed,
        image_size,
        load,
        hub_offline=hub_offline(),
        precision=precision,
        device_map=device_map,
        tensor_parallel=tensor_parallel,
    )
    torch.manual_seed(seed)
    loaded = source.build(source_name, request)
    loaded.source = source.name
    if checkpoint is not None and load_weights:
        loaded.checkpoint_sha256 = load_checkpoint(loaded.model, checkpoint)
        loaded.weights = f"checkpoint {checkpoint}"
    loaded.model.eval()
    return loaded


def check_tensor_parallel(name: str, weights: str, checkpoint: str | None, size: int) -> None:
    """Refuse ``--tensor-parallel size`` for ``--model name`` where its files alone say it cannot apply:
    another source than an ``hf:`` text model, a model type without transformers' plan, a random init.
    Only names and the model's config are read (no weight, no tokenizer, no process group), so that every
    rank of a launch says it within seconds of its start, before anything else is printed or prepared."""
    source, source_name = registry.resolve(name)
    if source.name == "hf":
        from . import hf

        if hf.check_tensor_parallel(source_name, weights, checkpoint, size):
            return
    raise InvalidRequestError(
        f"--tensor-parallel applies to hf: text models (transformers' own plans); --model {name} is not "
        "one (drop --tensor-parallel: each process holds the whole model)"
    )


def library_versions(source: str | None = None) -> dict[str, str]:
    """The versions of what made a store: Python, torch, torchvision, zarr, extract and the source's library."""
    import torch
    import zarr
    from torchvision import __version__ as torchvision_version  # the name torchvision is .torchvision here

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision_version,
        "zarr": zarr.__version__,
        "extract": _own_version(),
    }
    if library := registry.library_of(source):
        versions[library] = getattr(importlib.import_module(library), "__version__", "unknown")
    return versions


def _own_version() -> str:
    try:
        return importlib.metadata.version("extract")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
