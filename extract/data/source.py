"""What every data source opens (``Source``; its declaration, ``DataSource``, is in ``registry.py``):
random access to samples, their keys, class names, a listing hash and where its images live.

A source lists its samples once (see ``listing.py``), then serves item ``i`` as the raw image and
its label. Decoding and the model's transform happen in ``Source.__getitem__``, the same for every
source, so nothing downstream knows which source it was given: what it needs to know, it asks the
source.
"""

from __future__ import annotations

import hashlib
import re
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import torch
from PIL import Image
from torch.utils.data import Dataset

from .decode import Decoding, RawImage

if TYPE_CHECKING:
    from ..processes import Processes

# What a bad sample raises while being read or decoded: the run stops naming it, or records it invalid.
BAD_SAMPLE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError, tarfile.TarError)


def listing_hash(lines: Iterable[str]) -> str:
    """sha256 of a listing, one line per sample (key and label): the job's identity includes it."""
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode())
        digest.update(b"\n")
    return digest.hexdigest()


LABEL_RANGE = (-(2**63), 2**63 - 1)  # the store's labels are int64
INTEGER_TEXT = re.compile(r"-?[0-9]+")  # ASCII digits: int() would also take '١٢' or '1_0', isdigit() takes '²'


def parse_label(text: str) -> int:
    """A label written as text (a file list's column, a shard's ``cls``): an integer that fits int64;
    anything else raises ``ValueError`` saying what is wrong with it."""
    if not INTEGER_TEXT.fullmatch(text):
        raise ValueError(f"label '{text[:20]}' is not an integer")
    value = int(text)
    if not LABEL_RANGE[0] <= value <= LABEL_RANGE[1]:
        raise ValueError(f"label {text[:20]}{'...' if len(text) > 20 else ''} does not fit in int64")
    return value


def utf8_name(name: str) -> bool:
    """Whether a file name decoded by the OS (undecodable bytes kept as surrogates) is UTF-8: keys and
    the listing hash are UTF-8 text."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


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
    spec: str = ""  # set by build_dataset: the --data it was opened at, its path resolved

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

    @property
    def notice(self) -> str | None:
        """What the run says about this data before it starts (synthetic images), or None."""
        return None

    @property
    def image_root(self) -> Path | None:
        """The folder (absolute) that the keys are paths relative to, where the keys are image files
        (the report's thumbnails); None where they are not."""
        return None

    def keys(self) -> list[str]:
        return [self.key(i) for i in range(len(self))]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int, str]:
        assert self.decoding is not None, "build_dataset sets the decoding"
        try:
            raw, label = self.load(index)
            if not LABEL_RANGE[0] <= label <= LABEL_RANGE[1]:  # a uint64 column: collation would overflow
                raise ValueError(f"label {label} does not fit in int64")
            image = self.decoding(raw)
        except BAD_SAMPLE_ERRORS as e:
            blank = torch.zeros(3, self.image_size, self.image_size)
            return blank, -1, index, f"{self.describe(index)} ({e.__class__.__name__}: {e})"
        return image, int(label), index, ""

    def __getstate__(self) -> dict[str, Any]:
        # open file handles (shards, parquet readers) stay in the process that opened them
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_open")}


@dataclass(frozen=True)
class Document:
    """One document of a text source: its text, or its token ids where it came tokenized."""

    text: str | None = None  # None where it came tokenized
    input_ids: list[int] | None = None  # a field or column ``input_ids`` (a list of ints), as SAELens allows
    label: int = -1  # -1: none
    error: str = ""  # why it could not be read (``DataOptions.skip_bad``; then ``text`` is "")


class KeyList(Sequence[str]):
    """A text source's keys, made as they are read: a store writes them block by block, so a corpus of
    millions of documents never holds them all (a key is a Python string of about 80 bytes)."""

    def __init__(self, source: TextSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self.source.key(i) for i in range(*index.indices(len(self)))]
        return self.source.key(range(len(self))[index])


class TextSource:
    """The documents of a text corpus, listed once; ``documents(start, stop)`` streams them.

    A text source is read in order, not at random: files are streamed (jsonl lines, Parquet row
    groups), so that memory stays bounded whatever the corpus size. It answers the questions the run
    asks every source (keys, classes, a listing hash, a notice, an image root) as ``Source`` does.
    Subclasses implement ``__len__``, ``key``, ``describe``, ``listing_sha256`` and ``documents``.
    """

    classes: list[str] | None = None  # names of a ClassLabel (or a Parquet dictionary column)
    spec: str = ""  # set by build_dataset: the --data it was opened at, its path resolved
    notice: str | None = None
    image_root: Path | None = None  # documents are no image files: the report shows no thumbnails

    def __len__(self) -> int:
        raise NotImplementedError

    def key(self, index: int) -> str:
        """Where document ``index`` came from: ``file.jsonl/LINE`` (0-based), ``file.txt``,
        ``file.parquet/ROW``, ``split/ROW``."""
        raise NotImplementedError

    def keys(self) -> list[str]:
        return [self.key(i) for i in range(len(self))]

    def lazy_keys(self) -> KeyList:
        """``keys()`` made as they are read (``KeyList``)."""
        return KeyList(self)

    def describe(self, index: int) -> str:
        """Document ``index`` for messages (a full path)."""
        return self.key(index)

    def listing_sha256(self) -> str:
        """A hash that changes when the files or their contents change."""
        raise NotImplementedError

    def documents(self, start: int, stop: int) -> Iterator[Document]:
        """Documents ``start`` .. ``stop - 1`` in order, streamed: each file opened once per call."""
        raise NotImplementedError

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"documents({start}, {stop}) of a source of {len(self)} documents")


@dataclass(frozen=True)
class DataOptions:
    image_key: str | None = None
    label_key: str | None = None
    decode: str = "pil"
    exif_transpose: bool = False
    text_key: str | None = None  # text sources: the field or column of the text (None: "text")
    skip_bad: bool = False  # text sources: an unreadable document is recorded invalid instead of stopping the job


@dataclass(frozen=True)
class DataRequest:
    """What opening a source may use besides its location: the whole ``--data`` (for messages), the
    options, the process state (to list once per job) and a shard index kept with the store. Not the
    model: a job lists its data before it builds the model (the model's input size comes later, as
    ``Source.image_size``)."""

    spec: str
    options: DataOptions
    ranks: Processes | None = None
    saved_index: bytes | None = None
