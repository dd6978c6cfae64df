"""Datasets from ``--data`` specs; every item is ``(image, label, index)`` with label -1 when unknown."""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision.datasets
from PIL import Image
from torch.utils.data import Dataset

from .errors import ExtractError

DATA_KINDS = ("synthetic:N", "imagefolder:PATH", "filelist:FILE", "torchvision:NAME:ROOT[:split]")
Transform = Callable[[Any], torch.Tensor]


def _rgb(path: str | Path) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


class SyntheticImages(Dataset):
    """Deterministic images whose class (index mod ``classes``) sets their colour and stripe period,
    so features of different classes differ visibly and a linear probe can learn them."""

    def __init__(self, size: int, image_size: int, transform: Transform, classes: int = 10) -> None:
        self.size, self.image_size, self.transform, self.classes = size, image_size, transform, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = index % self.classes
        side = self.image_size
        noise = torch.rand((3, side, side), generator=torch.Generator().manual_seed(index))
        rows = torch.arange(side, dtype=torch.float32)
        stripes = 0.5 + 0.5 * torch.sin(2 * math.pi * rows / (3 + 2 * label)).view(1, side, 1)
        color = torch.tensor([(label * 37) % 256, (label * 91) % 256, (label * 151) % 256]).view(3, 1, 1) / 255
        image = 0.45 * color + 0.3 * stripes + 0.25 * noise
        # a PIL image, as from any real source: timm's, OpenCLIP's and HF's transforms expect one
        pixels = (image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        return self.transform(Image.fromarray(pixels)), label


class FileList(Dataset):
    """One image path per line, optionally followed by a tab and an integer label."""

    def __init__(self, path: Path, transform: Transform) -> None:
        self.transform = transform
        self.samples: list[tuple[Path, int]] = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            name, _, label = line.partition("\t")
            if label.strip() and not label.strip().lstrip("-").isdigit():
                raise ExtractError(f"{path}:{number}: label '{label.strip()}' is not an integer")
            file = Path(name.strip())
            self.samples.append(
                (file if file.is_absolute() else path.parent / file, int(label) if label.strip() else -1)
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        file, label = self.samples[index]
        return self.transform(_rgb(file)), label


class Indexed(Dataset):
    """Adds the sample index (the store's row) to each item and makes labels plain ints.

    An image that cannot be decoded does not raise here (a DataLoader worker would bury the file
    name in a traceback): the item carries a blank image and the error text, and the run loop
    either stops naming the file or records the sample as invalid (``--skip-bad-images``).
    """

    def __init__(self, dataset: Dataset, image_size: int) -> None:
        self.dataset = dataset
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int, str]:
        try:
            image, label = self.dataset[index]
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            blank = torch.zeros(3, self.image_size, self.image_size)
            return blank, -1, index, f"{self.source(index)} ({e.__class__.__name__}: {e})"
        return image, label if isinstance(label, int) else -1, index, ""

    def listing_sha256(self) -> str | None:
        """A hash of the file list and labels (ImageFolder, file lists), so that resuming on a folder
        whose files changed is refused rather than mixing two datasets in one store."""
        samples = getattr(self.dataset, "samples", None)
        if samples is None:
            return None
        digest = hashlib.sha256()
        for path, label in samples:
            digest.update(f"{path}\t{label}\n".encode())
        return digest.hexdigest()

    def source(self, index: int) -> str:
        """The file behind sample ``index`` (ImageFolder and file lists), for messages."""
        samples = getattr(self.dataset, "samples", None)
        return str(samples[index][0]) if samples is not None else f"sample {index}"


class _RGBThen:
    """Grayscale datasets (MNIST) become 3-channel images before the model's transform."""

    def __init__(self, transform: Transform) -> None:
        self.transform = transform

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.transform(image.convert("RGB"))


def _torchvision_dataset(name: str, root: str, split: str | None, transform: Transform) -> Dataset:
    cls = getattr(torchvision.datasets, name, None)
    if not isinstance(cls, type) or not issubclass(cls, Dataset):
        raise ExtractError(f"--data torchvision:{name}: torchvision.datasets has no dataset '{name}' (e.g. CIFAR10)")
    params = inspect.signature(cls).parameters
    kwargs: dict[str, Any] = {"transform": _RGBThen(transform), "download": False}
    if "split" in params:
        if split is not None:
            kwargs["split"] = split
    elif "train" in params:
        kwargs["train"] = split in (None, "train")
    elif split is not None:
        raise ExtractError(f"--data torchvision:{name}: this dataset takes no split; drop ':{split}'")
    try:
        return cls(root, **kwargs)
    except (RuntimeError, OSError, ValueError) as e:
        raise ExtractError(
            f"--data torchvision:{name}:{root}: cannot open it ({str(e).splitlines()[0]}); "
            "it must already be on disk (nothing is downloaded)"
        ) from None


def build_dataset(spec: str, transform: Transform, image_size: int) -> Indexed:
    """Parse ``--data`` and build the dataset; refuses empty datasets."""
    kind, _, rest = spec.partition(":")
    if kind == "synthetic":
        if not rest.isdigit():
            raise ExtractError(f"--data {spec}: write synthetic:N with N a whole number, e.g. synthetic:512")
        dataset: Dataset = SyntheticImages(int(rest), image_size, transform)
    elif kind == "imagefolder":
        if not Path(rest).is_dir():
            raise ExtractError(f"--data {spec}: {rest} is not a directory (ImageFolder layout: ROOT/CLASS/IMAGE)")
        try:
            dataset = torchvision.datasets.ImageFolder(rest, transform=transform, loader=_rgb)
        except (FileNotFoundError, OSError) as e:
            raise ExtractError(f"--data {spec}: {e}") from None
    elif kind == "filelist":
        if not Path(rest).is_file():
            raise ExtractError(f"--data {spec}: file {rest} does not exist (one image path per line)")
        dataset = FileList(Path(rest), transform)
    elif kind == "torchvision":
        name, _, location = rest.partition(":")
        root, _, split = location.partition(":")
        if not name or not root:
            raise ExtractError(
                f"--data {spec}: write torchvision:NAME:ROOT[:split], e.g. torchvision:CIFAR10:/data:test"
            )
        dataset = _torchvision_dataset(name, root, split or None, transform)
    else:
        raise ExtractError(f"unknown --data '{spec}'; use one of {', '.join(DATA_KINDS)}")
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise ExtractError(f"--data {spec} is empty; point it at a folder or list with images")
    return Indexed(dataset, image_size)
