"""Capture layer activations of PyTorch models into chunked zarr stores, on one or many GPUs."""

__version__ = "0.1.0"

from .capture import Capture, StopForward, capture
from .errors import ExtractError
from .feature_dataset import ChunkShuffleSampler, FeatureDataset
from .layers import LayerRef, resolve_layers
from .reader import Features, open_features
from .spec import JobSpec

__all__ = [
    "Capture",
    "ChunkShuffleSampler",
    "ExtractError",
    "FeatureDataset",
    "Features",
    "JobSpec",
    "LayerRef",
    "StopForward",
    "__version__",
    "capture",
    "open_features",
    "resolve_layers",
]
