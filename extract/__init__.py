"""Capture layer activations of PyTorch models into chunked zarr stores, on one or many GPUs.

The public API is imported lazily, so that ``python -m extract.probe`` (or a reader in a training
script) does not load the extraction pipeline it does not use, and a numpy reader (``open_features``,
``Features.load``) imports no torch: only the names that hand out tensors (``FeatureDataset``,
``ChunkShuffleSampler``, ``TokenStream``) and the pipeline's import it, when first named
(tests/test_reading_without_torch.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "Capture": "capture.hooks",
    "StopForward": "errors",
    "LayerRef": "names.layers",
    "resolve_layers": "capture.layers",
    "ChunkShuffleSampler": "read.dataset",
    "FeatureDataset": "read.dataset",
    "Features": "read.features",
    "open_features": "read.features",
    "TokenStream": "read.tokens",
    "JobSpec": "job.spec",
    "run": "job.runner",
}

from .errors import ExtractError  # noqa: E402 - light, and what every caller catches

if TYPE_CHECKING:
    from .capture.hooks import Capture
    from .capture.layers import resolve_layers
    from .errors import StopForward
    from .job.runner import run
    from .job.spec import JobSpec
    from .names.layers import LayerRef
    from .read.dataset import ChunkShuffleSampler, FeatureDataset
    from .read.features import Features, open_features
    from .read.tokens import TokenStream

__all__ = [
    "Capture",
    "ChunkShuffleSampler",
    "ExtractError",
    "FeatureDataset",
    "Features",
    "JobSpec",
    "LayerRef",
    "StopForward",
    "TokenStream",
    "__version__",
    "open_features",
    "resolve_layers",
    "run",
]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'extract' has no attribute {name!r}")
