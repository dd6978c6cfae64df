"""``imagefolder:ROOT``: torchvision's ImageFolder layout (ROOT/CLASS/.../IMAGE), listed once.

The listing is the same samples in the same order as ``torchvision.datasets.ImageFolder`` (classes
sorted, then directories sorted, then files sorted; symlinks followed), except that a directory
reached twice (a symlink loop, or two links to one directory) is walked only the first time.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from ..errors import ExtractError
from .decode import RawImage
from .listing import on_one_rank
from .source import DataRequest, Source, listing_hash, utf8_name

# torchvision.datasets.folder.IMG_EXTENSIONS, written out: importing it loads all of torchvision
# (torchvision.ops, torch._dynamo: seconds), which a job whose model is not torchvision's never needs;
# tests/test_data_sources.py checks that the two agree
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class FolderListing:
    classes: list[str]
    paths: list[str]  # relative to the root, with "/" separators
    labels: list[int]


def _walk(top: str, seen: set[tuple[int, int]]) -> list[tuple[str, list[str]]]:
    """(directory, file names) for ``top`` and below, following symlinks, each directory once: breadth
    first in sorted order, so a directory reached twice is kept under its shallowest, first name."""
    found = []
    pending = deque([top])
    while pending:
        directory = pending.popleft()
        try:
            info = os.stat(directory)
        except OSError:
            continue
        if (info.st_dev, info.st_ino) in seen:
            continue
        seen.add((info.st_dev, info.st_ino))
        files, subdirectories = [], []
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    try:
                        is_dir = entry.is_dir()  # follows symlinks, as os.walk(followlinks=True) does
                    except OSError:
                        is_dir = False
                    (subdirectories if is_dir else files).append(entry.name)
        except OSError:
            continue
        pending.extend(os.path.join(directory, name) for name in sorted(subdirectories))
        found.append((directory, files))
    return found


def _utf8(root: str, relative: str) -> str:
    if not utf8_name(relative):
        shown = os.fsencode(relative).decode("utf-8", "backslashreplace")
        raise ExtractError(f"--data imagefolder:{root}: the name {shown} is not UTF-8; rename it (keys are UTF-8 text)")
    return relative


def list_folder(root: str) -> FolderListing:
    try:
        classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    except OSError as e:
        raise ExtractError(f"--data imagefolder:{root}: cannot read it ({e.strerror})") from None
    if not classes:
        raise ExtractError(f"--data imagefolder:{root} has no class folders (ImageFolder layout: ROOT/CLASS/IMAGE)")
    for name in classes:
        _utf8(root, name)
    paths: list[str] = []
    labels: list[int] = []
    empty = []
    for label, name in enumerate(classes):
        before = len(paths)
        for directory, files in sorted(_walk(os.path.join(root, name), set())):
            relative = os.path.relpath(directory, root).replace(os.sep, "/")
            for file in sorted(files):
                if file.lower().endswith(IMG_EXTENSIONS):
                    paths.append(_utf8(root, f"{relative}/{file}"))
                    labels.append(label)
        if len(paths) == before:
            empty.append(name)
    if empty and len(empty) == len(classes):
        raise ExtractError(
            f"--data imagefolder:{root} is empty: no images ({', '.join(IMG_EXTENSIONS)}) in its class folders"
        )
    if empty:
        raise ExtractError(
            f"--data imagefolder:{root}: class folder(s) {', '.join(empty[:5])} hold no images; "
            "remove them or add images (ImageFolder refuses empty classes)"
        )
    return FolderListing(classes, paths, labels)


class FolderSource(Source):
    def __init__(self, root: str, listing: FolderListing) -> None:
        self.root, self.listing = root, listing
        self.classes = listing.classes

    def __len__(self) -> int:
        return len(self.listing.paths)

    def key(self, index: int) -> str:
        return self.listing.paths[index]

    def keys(self) -> list[str]:
        return list(self.listing.paths)

    def describe(self, index: int) -> str:
        return os.path.join(self.root, self.listing.paths[index])

    @property
    def image_root(self) -> Path:
        return Path(self.root).resolve()

    def load(self, index: int) -> tuple[RawImage, int]:
        return Path(self.root, self.listing.paths[index]).read_bytes(), self.listing.labels[index]

    def listing_sha256(self) -> str:
        lines = (f"{p}\t{label}" for p, label in zip(self.listing.paths, self.listing.labels, strict=True))
        return listing_hash([*(f"class\t{c}" for c in self.classes or []), *lines])


def open_folder(root: str, request: DataRequest) -> FolderSource:
    if not Path(root).is_dir():
        raise ExtractError(
            f"--data imagefolder:{root}: {root} is not a directory (ImageFolder layout: ROOT/CLASS/IMAGE)"
        )
    return FolderSource(root, on_one_rank(request.ranks, lambda: list_folder(root)))
