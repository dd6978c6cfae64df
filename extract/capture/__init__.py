"""Capture: the one hook manager (``Capture``, hooks.py), layer names (resolve, select, aliases;
layers.py), the ``Layout`` of an output and how it is inferred (layout.py), pooling (pooling.py), the
dummy-batch forwards that list layers and validate them before anything is written (setup.py), and
the host staging that moves captured batches off the device (staging.py), and the check that the cast
to the storage dtype makes no inf (cast.py)."""

from ..names.layers import LayerRef
from ..names.layout import Layout
from .hooks import Capture, Edit, StopForward
from .layers import resolve_layers

__all__ = ["Capture", "Edit", "LayerRef", "Layout", "StopForward", "resolve_layers"]
