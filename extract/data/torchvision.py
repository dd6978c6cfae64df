"""``torchvision:NAME:ROOT[:split]``: a dataset class from ``torchvision.datasets`` already on disk
(nothing is downloaded). Keys are ``split/index``; class names come from the dataset's ``classes``."""

from __future__ import annotations

import inspect
from typing import Any

import torchvision.datasets
from torch.utils.data import Dataset

from ..errors import ExtractError
from .decode import RawImage
from .registry import declared
from .source import DataRequest, Source


def _dataset(name: str, root: str, split: str | None) -> Dataset:
    cls = getattr(torchvision.datasets, name, None)
    if not isinstance(cls, type) or not issubclass(cls, Dataset):
        raise ExtractError(f"--data torchvision:{name}: torchvision.datasets has no dataset '{name}' (e.g. CIFAR10)")
    params = inspect.signature(cls).parameters
    args: list[Any] = [root] if "root" in params else []  # FakeData takes no root
    kwargs: dict[str, Any] = {"download": False} if "download" in params else {}
    if "split" in params:
        if split is not None:
            kwargs["split"] = split
    elif "train" in params:
        kwargs["train"] = split in (None, "train")
    elif split is not None:
        raise ExtractError(f"--data torchvision:{name}: this dataset takes no split; drop ':{split}'")
    try:
        return cls(*args, **kwargs)
    except (RuntimeError, OSError, ValueError, TypeError) as e:
        raise ExtractError(
            f"--data torchvision:{name}:{root}: cannot open it ({str(e).splitlines()[0]}); "
            "it must already be on disk (nothing is downloaded)"
        ) from None


class TorchvisionSource(Source):
    def __init__(self, name: str, root: str, split: str | None) -> None:
        self.dataset = _dataset(name, root, split)
        self.prefix = split or ("train" if "train" in inspect.signature(type(self.dataset)).parameters else name)
        classes = getattr(self.dataset, "classes", None)
        self.classes = [str(c) for c in classes] if isinstance(classes, list | tuple) and classes else None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def key(self, index: int) -> str:
        return f"{self.prefix}/{index}"

    def load(self, index: int) -> tuple[RawImage, int]:
        image, label = self.dataset[index]
        if hasattr(label, "item") and getattr(label, "ndim", 1) == 0:  # numpy / torch scalars (SVHN, FakeData)
            label = label.item()
        return image, label if isinstance(label, int) else -1


def open_torchvision(rest: str, request: DataRequest) -> TorchvisionSource:
    name, _, location = rest.partition(":")
    root, _, split = location.partition(":")
    if not name or not root:
        source = declared("torchvision")
        raise ExtractError(f"--data torchvision:{rest}: write {source.usage}, e.g. {source.example}")
    return TorchvisionSource(name, root, split or None)
