"""``wds:PATTERN_OR_DIR``: tar shards in the webdataset layout, read in place.

A sample is the group of members sharing a key (the member's path up to the first dot of its base
name); its image is the first jpg/jpeg/png/webp member (or ``--image-key EXT``), its label the
integer text of the ``cls`` member (or ``--label-key EXT``). The index of every shard (tar headers
only: the data is skipped by seeking) is built once, split across ranks, and kept with the store so
a resume does not rescan. Items are then read with one positioned read each, so a rank reading its
contiguous range reads each shard sequentially.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ExtractError
from .decode import RawImage
from .listing import split_across_ranks
from .source import DataRequest, Source, listing_hash, parse_label, utf8_name

if TYPE_CHECKING:
    from ..processes import Processes

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
INDEX_FORMAT = "extract-wds-index/1"
BRACE = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` -> a-000.tar a-001.tar a-002.tar (zero padding kept); ``{x,y}`` lists."""
    match = BRACE.search(pattern)
    if match is None:
        return [pattern]
    body, head, tail = match.group(1), pattern[: match.start()], pattern[match.end() :]
    if ".." in body:
        low, _, high = body.partition("..")
        if not (low.isdigit() and high.isdigit()):
            raise ExtractError(f"--data wds:{pattern}: a range is written {{000..099}} with whole numbers")
        width = len(low) if low.startswith("0") else 0
        choices = [f"{n:0{width}d}" for n in range(int(low), int(high) + 1)]
    else:
        choices = body.split(",")
    return [name for choice in choices for name in expand_braces(head + choice + tail)]


def shard_paths(location: str) -> list[Path]:
    if Path(location).is_dir():
        paths = sorted(Path(location).glob("*.tar"))
        if not paths:
            raise ExtractError(f"--data wds:{location}: the directory holds no *.tar shards")
        for path in paths:  # a shard's name begins its samples' keys
            _utf8(path.parent, path.name)
        return paths
    paths = [Path(p) for p in expand_braces(location)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ExtractError(
            f"--data wds:{location}: {len(missing)} of {len(paths)} shards do not exist: {', '.join(missing[:3])}{more}"
        )
    return paths


def split_name(member: str) -> tuple[str, str]:
    """webdataset's rule: the key is the path up to the first dot of the base name, the rest is the
    extension (lower-cased)."""
    directory, _, base = member.rpartition("/")
    stem, _, extension = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), extension.lower()


def _utf8(where: Path, name: str) -> str:
    """``name`` (a member of the shard ``where``, or a shard in the directory ``where``), refused unless UTF-8."""
    if not utf8_name(name):
        shown = os.fsencode(name).decode("utf-8", "backslashreplace")
        raise ExtractError(
            f"--data wds: {where} holds the name {shown}, which is not UTF-8; rename it (keys are UTF-8)"
        )
    return name


def index_shard(path: Path) -> list[dict[str, list[int]]]:
    """Per sample of one shard, in order of first appearance: {extension: [data offset, size]}, plus
    the key under "__key__". Reads tar headers only; a truncated shard or a file that is no tar
    raises ``ExtractError`` naming it."""
    samples: dict[str, dict[str, Any]] = {}
    size = path.stat().st_size
    try:
        with tarfile.open(path, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                if member.offset_data + member.size > size:
                    raise tarfile.ReadError("unexpected end of data")
                key, extension = split_name(_utf8(path, member.name))
                sample = samples.setdefault(key, {"__key__": key})
                if extension in sample:
                    raise ExtractError(
                        f"--data wds: shard {path} holds '{member.name}' twice: keys in a shard must be unique "
                        "(each sample's members share one key); rename or drop the duplicate"
                    )
                sample[extension] = [member.offset_data, member.size]
            # tarfile takes a header cut short for the end of the archive: a whole tar ends with
            # zero blocks after its last member, so fewer than one block left means it was cut
            if size - tar.offset < tarfile.BLOCKSIZE:
                raise tarfile.ReadError(f"it ends at byte {size} without the end-of-archive blocks")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ExtractError(
            f"--data wds: shard {path} is truncated or not a tar file ({e}); re-create or remove it"
        ) from None
    return list(samples.values())


@dataclass
class ShardIndex:
    shards: list[str]  # paths as listed
    samples: list[list[int]] = field(default_factory=list)  # [shard, image offset, size, label offset, label size]
    keys: list[str] = field(default_factory=list)  # shard base name / sample key

    def dumps(self) -> bytes:
        data = {"format": INDEX_FORMAT, "shards": self.shards, "samples": self.samples, "keys": self.keys}
        return gzip.compress(json.dumps(data).encode(), compresslevel=1)

    @classmethod
    def loads(cls, blob: bytes) -> ShardIndex | None:
        try:
            data = json.loads(gzip.decompress(blob))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
            return None
        return cls(data["shards"], data["samples"], data["keys"])


def build_index(paths: list[Path], image_key: str | None, label_key: str | None, ranks: Processes | None) -> ShardIndex:
    per_shard = split_across_ranks(ranks, paths, index_shard)
    index = ShardIndex([str(p) for p in paths])
    label_extension = (label_key or "cls").lower()
    for number, (path, samples) in enumerate(zip(paths, per_shard, strict=True)):
        for sample in samples:
            if image_key is not None:
                image = sample.get(image_key.lower())
            else:
                image = next((sample[e] for e in IMAGE_EXTENSIONS if e in sample), None)
            if image is None:
                if image_key is not None or any(e in sample for e in ("cls", "txt", "json")):
                    wanted = image_key or "/".join(IMAGE_EXTENSIONS)
                    raise ExtractError(
                        f"--data wds: sample '{sample['__key__']}' in {path} has no {wanted} member "
                        f"(it has {', '.join(e for e in sample if e != '__key__')}); name the image with --image-key EXT"
                    )
                continue  # a stray file with no image and no metadata (e.g. a README): not a sample
            label = sample.get(label_extension, [-1, 0])
            if label_key is not None and label_extension not in sample:
                raise ExtractError(
                    f"--data wds: sample '{sample['__key__']}' in {path} has no '{label_key}' member (--label-key)"
                )
            index.samples.append([number, *image, *label])
            index.keys.append(f"{path.name}/{sample['__key__']}")
    return index


class ShardSource(Source):
    def __init__(self, index: ShardIndex) -> None:
        self.index = index
        self._open_files: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.index.samples)

    def key(self, index: int) -> str:
        return self.index.keys[index]

    def keys(self) -> list[str]:
        return list(self.index.keys)

    def _read(self, shard: int, offset: int, size: int) -> bytes:
        handles = self.__dict__.setdefault("_open_files", {})
        if shard not in handles:
            handles[shard] = os.open(self.index.shards[shard], os.O_RDONLY)
        data = os.pread(handles[shard], size, offset)
        if len(data) != size:
            raise OSError(f"shard {self.index.shards[shard]} is shorter than its index says; it changed")
        return data

    def load(self, index: int) -> tuple[RawImage, int]:
        shard, offset, size, label_offset, label_size = self.index.samples[index]
        label = -1
        if label_offset >= 0:
            label = parse_label(self._read(shard, label_offset, label_size).decode().strip())
        return self._read(shard, offset, size), label

    def listing_sha256(self) -> str:
        lines = [f"shard\t{s}" for s in self.index.shards]
        lines += [f"{k}\t{s}" for k, s in zip(self.index.keys, self.index.samples, strict=True)]
        return listing_hash(lines)

    def saved_index(self) -> bytes:
        return self.index.dumps()

    def __del__(self) -> None:
        for fd in self.__dict__.get("_open_files", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


def open_shards(location: str, request: DataRequest) -> ShardSource:
    saved, options = request.saved_index, request.options
    index = ShardIndex.loads(saved) if saved is not None else None
    if index is None:
        index = build_index(shard_paths(location), options.image_key, options.label_key, request.ranks)
    if not index.samples:
        raise ExtractError(f"--data wds:{location} is empty: its shards hold no samples with an image")
    return ShardSource(index)
