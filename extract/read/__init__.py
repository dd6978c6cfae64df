"""Reading a store: ``Features`` / ``open_features`` for numpy, zarr and torch, and the map-style torch
dataset and chunk-window sampler for training on stored features."""

from .dataset import ChunkShuffleSampler, FeatureDataset
from .features import Features, open_features

__all__ = ["ChunkShuffleSampler", "FeatureDataset", "Features", "open_features"]
