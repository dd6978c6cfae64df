"""``synthetic:N``: deterministic images for tests and smoke runs (not a real data set)."""

from __future__ import annotations

import math
import os

import torch
from PIL import Image
from torch.utils.data import Dataset

from ..errors import ExtractError
from .decode import RawImage, Transform
from .registry import declared
from .source import DataRequest, Source


def synthetic_image(index: int, side: int, classes: int = 10) -> Image.Image:
    """An RGB image whose class (index mod ``classes``) sets its colour and stripe period, so features
    of different classes differ visibly and a linear probe can learn them. A PIL image, as from any
    real source: timm's, OpenCLIP's and transformers' transforms expect one (timm's refuses uint8
    tensors)."""
    label = index % classes
    noise = torch.rand((3, side, side), generator=torch.Generator().manual_seed(index))
    rows = torch.arange(side, dtype=torch.float32)
    stripes = 0.5 + 0.5 * torch.sin(2 * math.pi * rows / (3 + 2 * label)).view(1, side, 1)
    color = torch.tensor([(label * 37) % 256, (label * 91) % 256, (label * 151) % 256]).view(3, 1, 1) / 255
    image = 0.45 * color + 0.3 * stripes + 0.25 * noise
    return Image.fromarray((image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())


class SyntheticImages(Dataset):
    """``(transform(image), label)`` pairs of the synthetic images (tests' independent reference)."""

    def __init__(self, size: int, image_size: int, transform: Transform, classes: int = 10) -> None:
        self.size, self.image_size, self.transform, self.classes = size, image_size, transform, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(synthetic_image(index, self.image_size, self.classes)), index % self.classes


class SyntheticSource(Source):
    """Synthetic images drawn at ``image_size`` (the model's input size: ``attach_decoding`` sets it
    once the model is built, after the listing)."""

    def __init__(self, size: int, classes: int = 10) -> None:
        self.size, self.num_classes = size, classes

    def __len__(self) -> int:
        return self.size

    def key(self, index: int) -> str:
        return f"synthetic/{index}"

    def load(self, index: int) -> tuple[RawImage, int]:
        return synthetic_image(index, self.image_size, self.num_classes), index % self.num_classes

    @property
    def notice(self) -> str:
        return "SYNTHETIC images, not a real dataset"


# What a job holds in memory per sample before its loop, whatever the layers: the key as a Python
# string in the listing and again in the store's keys array, the label and the valid flag. An
# estimate from below: a synthetic N is a number typed, not files listed, and one beyond the machine
# would be found by the OOM killer instead of by a message.
BYTES_PER_SAMPLE = 200


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not POSIX: no check
        return None


def open_synthetic(count: str, request: DataRequest) -> SyntheticSource:
    if not count.isdigit():
        example = declared("synthetic").example
        raise ExtractError(f"--data {request.spec}: write synthetic:N with N a whole number, e.g. {example}")
    size, memory = int(count), _memory_bytes()
    if memory is not None and size * BYTES_PER_SAMPLE > memory:
        raise ExtractError(
            f"--data {request.spec}: {size} samples need about {size * BYTES_PER_SAMPLE / 2**30:.0f} GiB of memory "
            f"for their keys and labels alone, more than this machine's {memory / 2**30:.0f} GiB; use fewer"
        )
    return SyntheticSource(size)
