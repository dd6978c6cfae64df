"""Reading a store: ``Features`` / ``open_features`` for numpy, zarr and torch (``Features.text``, a
``TextView``, for a text store's tokens), and the map-style torch dataset and chunk-window sampler for
training on stored features, and ``TokenStream``, shuffled batches of a token store's rows (of several
stores of the same tokens side by side, or of an image store's patches: ``sources``);
``decode_bfloat16`` for xarray over a store with bfloat16 layers.

The numpy readers import no torch (a reader in a numpy or JAX program does not pay its ~1.5 CPU-s
import); the torch ones (``FeatureDataset``, ``ChunkShuffleSampler``, ``TokenStream``) are imported
when first named, as ``extract``'s own public names are."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .bfloat16 import decode_bfloat16
from .features import Features, open_features
from .text_view import TextView

if TYPE_CHECKING:
    from .dataset import ChunkShuffleSampler, FeatureDataset
    from .tokens import TokenStream

_TORCH = {"ChunkShuffleSampler": "dataset", "FeatureDataset": "dataset", "TokenStream": "tokens"}

__all__ = [
    "ChunkShuffleSampler",
    "FeatureDataset",
    "Features",
    "TextView",
    "TokenStream",
    "decode_bfloat16",
    "open_features",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH:
        value = getattr(importlib.import_module(f".{_TORCH[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
