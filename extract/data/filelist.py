"""``filelist:FILE``: one image path per line (relative to the list's directory, or absolute),
optionally followed by a tab and an integer label. Listed once; missing files are all reported then,
before anything is computed or created."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ExtractError
from .decode import RawImage
from .listing import on_one_rank
from .source import DataRequest, Source, listing_hash, parse_label

NAMED_MISSING = 3


@dataclass
class FileListing:
    names: list[str]  # as written in the list
    labels: list[int]


def _text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")  # whatever the locale: keys are UTF-8
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ExtractError(f"--data filelist:{path}: line {line} is not UTF-8 text; write the list in UTF-8") from None


def read_list(path: Path) -> FileListing:
    names, labels = [], []
    for number, line in enumerate(_text(path).splitlines(), 1):
        if not line.strip():
            continue
        name, _, label = line.partition("\t")
        try:
            labels.append(parse_label(label.strip()) if label.strip() else -1)
        except ValueError as e:
            raise ExtractError(f"--data filelist:{path}: line {number}: {e}") from None
        names.append(name.strip())
    base = path.parent
    missing = [name for name in names if not os.path.isfile(base / name)]
    if missing:
        more = f" and {len(missing) - NAMED_MISSING} more" if len(missing) > NAMED_MISSING else ""
        raise ExtractError(
            f"--data filelist:{path}: {len(missing)} of {len(names)} listed files do not exist: "
            f"{', '.join(missing[:NAMED_MISSING])}{more}; fix the list (paths are relative to {base})"
        )
    return FileListing(names, labels)


class FileListSource(Source):
    def __init__(self, path: Path, listing: FileListing) -> None:
        self.base, self.listing = path.parent, listing

    def __len__(self) -> int:
        return len(self.listing.names)

    def key(self, index: int) -> str:
        return self.listing.names[index]

    def keys(self) -> list[str]:
        return list(self.listing.names)

    def describe(self, index: int) -> str:
        return str(self.base / self.listing.names[index])

    @property
    def image_root(self) -> Path:
        return self.base.resolve()

    def load(self, index: int) -> tuple[RawImage, int]:
        return (self.base / self.listing.names[index]).read_bytes(), self.listing.labels[index]

    def listing_sha256(self) -> str:
        return listing_hash(f"{n}\t{label}" for n, label in zip(self.listing.names, self.listing.labels, strict=True))


def open_filelist(location: str, request: DataRequest) -> FileListSource:
    path = Path(location)
    if not path.is_file():
        raise ExtractError(f"--data filelist:{location}: file {location} does not exist (one image path per line)")
    return FileListSource(path, on_one_rank(request.ranks, lambda: read_list(path)))
