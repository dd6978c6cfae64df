"""Capture layer activations of PyTorch models into chunked zarr stores, on one or many GPUs."""

__version__ = "0.1.0"

from .capture import Capture, StopForward, capture
from .errors import ExtractError
from .layers import LayerRef, resolve_layers
from .spec import JobSpec

__all__ = ["Capture", "ExtractError", "JobSpec", "LayerRef", "StopForward", "__version__", "capture", "resolve_layers"]
