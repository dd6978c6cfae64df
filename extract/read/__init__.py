"""Reading a store: ``Features`` / ``open_features`` for numpy, zarr and torch (``Features.text``, a
``TextView``, for a text store's tokens), and the map-style torch dataset and chunk-window sampler for
training on stored features, and ``TokenStream``, shuffled batches of a token store's rows (of several
stores of the same tokens side by side, or of an image store's patches: ``sources``);
``decode_bfloat16`` for xarray over a store with bfloat16 layers."""

from .bfloat16 import decode_bfloat16
from .dataset import ChunkShuffleSampler, FeatureDataset
from .features import Features, open_features
from .text_view import TextView
from .tokens import TokenStream

__all__ = [
    "ChunkShuffleSampler",
    "FeatureDataset",
    "Features",
    "TextView",
    "TokenStream",
    "decode_bfloat16",
    "open_features",
]
