"""Capture: the one hook manager (``Capture``, hooks.py), layer names (resolve, select, aliases;
layers.py), the ``Layout`` of an output and how it is inferred (layout.py), pooling (pooling.py), the
dummy-batch forwards that list layers and validate them before anything is written (setup.py), the
host staging that moves captured batches off the device (staging.py), the check that the cast to the
storage dtype makes no inf (cast.py), and a pretrained SAE that turns a layer's rows into sparse codes on
the device (sae.py; sae_lens is imported only when one is loaded)."""

from ..names.layers import LayerRef
from ..names.layout import Layout
from .hooks import Capture, Edit, StopForward
from .layers import resolve_layers

__all__ = ["Capture", "Edit", "LayerRef", "Layout", "StopForward", "resolve_layers"]
