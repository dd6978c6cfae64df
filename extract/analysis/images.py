"""Where the report finds a stored sample's image, by its key: a file under the folder the keys are
relative to (``imagefolder:``, ``filelist:``), or the data source the store was extracted from,
opened again (``wds:`` shards, Parquet files, ``hf:`` data sets), which knows how to read a sample by
key. The data sources are imported only for those stores, and only when the report asks.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..errors import ExtractError
from ..read.features import Features
from ..store.indexes import saved_index

# Data sources whose keys name a sample inside shards or files (not an image file of its own).
SOURCE_KINDS = ("wds", "parquet", "hf")
BAD_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


@dataclass
class SampleImages:
    """The images of some rows of a store, by position in ``keys``: ``has(i)`` is a cheap check that
    the i-th is there, ``image(i)`` opens it (None when it cannot be read); ``where`` says where
    they come from."""

    keys: list[str]
    where: str
    has_key: Callable[[str], bool]
    open_key: Callable[[str], Image.Image | None]

    def has(self, position: int) -> bool:
        return self.has_key(self.keys[position])

    def image(self, position: int) -> Image.Image | None:
        return self.open_key(self.keys[position])


def image_root(attrs: Mapping[str, Any]) -> Path | None:
    """The folder the store's keys are relative to, for data sources whose keys are file paths: as
    the source said at extraction (``attrs["image_root"]``), or for a store written before it was
    recorded, as its ``--data`` says."""
    if "image_root" in attrs:
        return Path(attrs["image_root"])
    return legacy_image_root(attrs.get("dataset"))


def legacy_image_root(dataset: str | None) -> Path | None:
    """For stores without ``image_root`` (written before the sources recorded it): the folder of an
    ``imagefolder:`` or ``filelist:`` spec, relative to the current directory. The one place that
    reads a ``--data`` string after extraction for files; newer stores never come here."""
    kind, _, rest = (dataset or "").partition(":")
    if kind == "imagefolder":
        return Path(rest)
    if kind == "filelist":
        return Path(rest).parent
    return None


def sample_images(features: Features, keys: Sequence[str]) -> SampleImages | str:
    """How to open the images of ``keys`` (samples of ``features``), or why they cannot be shown."""
    dataset = str(features.attrs.get("dataset"))
    root = image_root(features.attrs)
    if root is not None:
        if sum((root / key).is_file() for key in keys) < 2:
            return f"the image files are not under {root} any more"
        return SampleImages(
            list(keys), f"under {root}", lambda key: (root / key).is_file(), lambda key: _open_file(root / key)
        )
    if dataset.partition(":")[0] not in SOURCE_KINDS:
        return f"the keys of '{dataset}' are not file paths"
    try:
        return _from_source(features, dataset, keys)
    except (ExtractError, OSError, ImportError) as e:
        return f"cannot open --data {dataset} from here to read its images ({e})"


def _open_file(path: Path) -> Image.Image | None:
    try:
        with Image.open(path) as image:
            image.load()
            return image
    except BAD_IMAGE_ERRORS:
        return None


def _from_source(features: Features, dataset: str, keys: Sequence[str]) -> SampleImages:
    """The source reopened with the options it was extracted with (and the shard index kept in the
    store, so shards are not rescanned); each image is read by the source itself."""
    from ..data import LEGACY_SAVED_INDEX, SAVED_INDEX, reuses_index
    from ..data.registry import open_source
    from ..data.source import DataOptions, DataRequest

    job = features.attrs.get("job") or {}
    options = DataOptions(job.get("image_key"), job.get("label_key"))
    same = reuses_index(features.attrs.get("identity"), dataset, options)
    saved = saved_index(features.path, SAVED_INDEX, legacy=LEGACY_SAVED_INDEX) if same else None
    source = open_source(DataRequest(dataset, options, None, saved))
    source.image_size = int(job.get("image_size") or 224)  # synthetic images are drawn at the job's size
    position = {key: i for i, key in enumerate(source.keys())}
    if sum(key in position for key in keys) < 2:
        raise ExtractError("it no longer holds the stored keys")

    def open_key(key: str) -> Image.Image | None:
        if key not in position:
            return None
        try:
            raw, _ = source.load(position[key])
            return to_pil(raw)
        except BAD_IMAGE_ERRORS:
            return None

    return SampleImages(list(keys), f"read from {dataset}", position.__contains__, open_key)


def to_pil(raw: bytes | Image.Image | torch.Tensor) -> Image.Image:
    """A source's raw image (encoded bytes, a PIL image, or a uint8 (C, H, W) tensor) as a PIL image."""
    if isinstance(raw, Image.Image):
        return raw
    if isinstance(raw, torch.Tensor):
        return Image.fromarray(np.ascontiguousarray(raw.permute(1, 2, 0).numpy()))
    with Image.open(io.BytesIO(raw)) as image:
        image.load()
        return image
