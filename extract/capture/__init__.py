"""Capture: the one hook manager (``Capture``), layer names (resolve, select, aliases), the layout of an
output, pooling, the set-up forward that validates layers before anything is written, and the host
staging that moves captured batches off the device."""

from .hooks import Capture, Edit, StopForward
from .layers import LayerRef, resolve_layers

__all__ = ["Capture", "Edit", "LayerRef", "StopForward", "resolve_layers"]
