"""What every data source is: random access to samples, their keys, class names and a listing hash.

A source lists its samples once (see ``listing.py``), then serves item ``i`` as the raw image and
its label. Decoding and the model's transform happen in ``Source.__getitem__``, the same for every
source, so nothing downstream knows which source it was given.
"""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Iterable
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from .decode import Decoding, RawImage

# What a bad sample raises while being read or decoded: the run stops naming it, or records it invalid.
BAD_SAMPLE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError, tarfile.TarError)


def listing_hash(lines: Iterable[str]) -> str:
    """sha256 of a listing, one line per sample (key and label): the job's identity includes it."""
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode())
        digest.update(b"\n")
    return digest.hexdigest()


class Source(Dataset):
    """Random access to a data set's samples. Items are ``(image, label, index, error)``.

    Subclasses implement ``__len__``, ``key(i)`` and ``load(i) -> (raw image, label)``, and set
    ``classes`` where the data names them. An image that cannot be read or decoded does not raise
    here (a DataLoader worker would bury the sample's name in a traceback): the item carries a blank
    image and the error text, and the run loop either stops naming the sample or records it invalid
    (``--skip-bad-images``).
    """

    classes: list[str] | None = None
    decoding: Decoding | None = None  # set by build_dataset
    image_size: int = 224

    def __len__(self) -> int:
        raise NotImplementedError

    def key(self, index: int) -> str:
        """Where sample ``index`` came from (relative path, shard/key, file/row): stored in ``keys``."""
        raise NotImplementedError

    def load(self, index: int) -> tuple[RawImage, int]:
        """The raw image (encoded bytes, a PIL image or a uint8 CHW tensor) and label (-1: none)."""
        raise NotImplementedError

    def listing_sha256(self) -> str | None:
        """A hash of what was listed, so that resuming on data that changed is refused."""
        return None

    def describe(self, index: int) -> str:
        """Sample ``index`` for messages (a full path where there is one)."""
        return self.key(index)

    def keys(self) -> list[str]:
        return [self.key(i) for i in range(len(self))]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int, str]:
        assert self.decoding is not None, "build_dataset sets the decoding"
        try:
            raw, label = self.load(index)
            image = self.decoding(raw)
        except BAD_SAMPLE_ERRORS as e:
            blank = torch.zeros(3, self.image_size, self.image_size)
            return blank, -1, index, f"{self.describe(index)} ({e.__class__.__name__}: {e})"
        return image, int(label), index, ""

    def __getstate__(self) -> dict[str, Any]:
        # open file handles (shards, parquet readers) stay in the process that opened them
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_open")}
