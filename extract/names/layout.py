"""Which axis of an output holds the channels: the ``Layout`` type (``NCHW`` or ``NHWC`` for 4-D outputs,
``NLC`` or ``NCL`` for 3-D ones), as capture infers it, pooling reads it and a store records it (its
``layouts`` attribute). How it is inferred from a model is ``extract.capture.layout``."""

from __future__ import annotations

from enum import StrEnum


class Layout(StrEnum):
    """Where the batch, channel and spatial (or token) axes of a 4-D or 3-D output are.

    A ``StrEnum`` (timm's ``Format`` is a ``str, Enum``): members equal, print and store as their
    names, so the store's ``layouts`` attribute and ``--layout`` values stay plain strings."""

    NCHW = "NCHW"
    NHWC = "NHWC"
    NLC = "NLC"
    NCL = "NCL"

    @property
    def ndim(self) -> int:
        """The rank of an output in this layout, batch axis included."""
        return len(self.value)

    @property
    def channel_axis(self) -> int:
        return self.value.index("C")

    @property
    def spatial_axes(self) -> tuple[int, int] | None:
        """The (height, width) axes of a feature map; ``None`` for token layouts."""
        if self.ndim != 4:
            return None
        return self.value.index("H"), self.value.index("W")

    @property
    def token_axis(self) -> int | None:
        """The token (sequence) axis; ``None`` for feature maps."""
        return self.value.index("L") if self.ndim == 3 else None

    @property
    def dimension_names(self) -> tuple[str, ...]:
        """The store's names for the axes after the batch one (NLC calls its channels ``dim``)."""
        words = {"C": "dim" if self.ndim == 3 else "channel", "H": "height", "W": "width", "L": "token"}
        return tuple(words[axis] for axis in self.value[1:])
