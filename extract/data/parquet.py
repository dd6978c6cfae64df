"""``parquet:GLOB``: Parquet files read in place with pyarrow, one row group at a time.

The image column holds encoded bytes, or Hugging Face's ``{bytes, path}`` struct; it is found by its
type, or named with ``--image-key``. The label column is ``label``, or ``--label-key``; class names
come from Hugging Face's ``ClassLabel`` metadata when the files carry it. Keys are ``file/row``.

pyarrow is imported only when a source is opened (see ``DataSource``).
"""

from __future__ import annotations

import bisect
import glob
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ExtractError
from .decode import RawImage, stored_image
from .listing import on_one_rank
from .source import DataRequest, Source, listing_hash

if TYPE_CHECKING:
    import pyarrow as pa

ROW_GROUPS_CACHED = 2  # per worker: the one being read and the previous one


def _is_bytes(kind: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def _is_image_struct(kind: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_struct(kind) and any(kind.field(i).name == "bytes" for i in range(kind.num_fields))


def _class_names(schema: pa.Schema, column: str) -> list[str] | None:
    """ClassLabel names from the ``huggingface`` schema metadata that ``datasets`` writes."""
    try:
        feature = json.loads(schema.metadata[b"huggingface"])["info"]["features"][column]
        return [str(n) for n in feature["names"]] if feature.get("_type") == "ClassLabel" else None
    except (KeyError, TypeError, ValueError):
        return None


@dataclass
class ParquetListing:
    files: list[str]
    row_groups: list[list[int]]  # rows per row group, per file
    image_column: str
    label_column: str | None
    classes: list[str] | None
    labels_are_names: bool = False  # a string label column: each label is its class name


def _label_kind(file: str, schema: pa.Schema, column: str) -> bool:
    """Whether the label column holds class names (strings) rather than class ids (integers); any
    other type is refused, since a float or a boolean is no class."""
    import pyarrow as pa

    kind = schema.field(column).type
    if pa.types.is_integer(kind):
        return False
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return True
    raise ExtractError(
        f"--data parquet: {file} label column '{column}' holds {kind}; labels are integers (class ids) or "
        "strings (class names); name another column with --label-key"
    )


def _names_in(files: list[str], column: str) -> list[str]:
    """The class names of a string label column, as ``datasets``' ``class_encode_column`` makes them:
    its distinct values, sorted (nulls are no class)."""
    import pyarrow.parquet as pq

    names: set[str] = set()
    for file in files:
        names.update(
            v for v in pq.read_table(file, columns=[column]).column(column).unique().to_pylist() if v is not None
        )
    return sorted(names)


def _image_column(file: str, schema: pa.Schema, image_key: str | None) -> str:
    if image_key is not None:
        if image_key not in schema.names:
            raise ExtractError(
                f"--data parquet: {file} has no column '{image_key}' (--image-key); it has {', '.join(schema.names)}"
            )
        kind = schema.field(image_key).type
        if not (_is_bytes(kind) or _is_image_struct(kind)):
            raise ExtractError(
                f"--data parquet: {file} column '{image_key}' (--image-key) holds {kind}, not images "
                "(encoded bytes, or a {bytes, path} struct)"
            )
        return image_key
    candidates = [f.name for f in schema if _is_bytes(f.type) or _is_image_struct(f.type)]
    if not candidates:
        raise ExtractError(
            f"--data parquet: {file} has no image column (bytes, or a {{bytes, path}} struct) among "
            f"{', '.join(schema.names)}; name it with --image-key"
        )
    return candidates[0]


def _label_column(file: str, schema: pa.Schema, label_key: str | None) -> str | None:
    if label_key is not None and label_key not in schema.names:
        raise ExtractError(
            f"--data parquet: {file} has no column '{label_key}' (--label-key); it has {', '.join(schema.names)}"
        )
    return label_key or ("label" if "label" in schema.names else None)


def list_parquet(pattern: str, image_key: str | None, label_key: str | None) -> ParquetListing:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted(glob.glob(pattern, recursive=True))
    if not files:
        raise ExtractError(f"--data parquet:{pattern}: no file matches it")
    row_groups: list[list[int]] = []
    image_column = label_column = None
    classes = None
    names = False
    for number, file in enumerate(files):
        try:
            metadata = pq.read_metadata(file)
            schema = pq.read_schema(file)
        except (pa.ArrowException, OSError) as e:
            raise ExtractError(f"--data parquet: {file} is not a readable Parquet file ({e})") from None
        column = _image_column(file, schema, image_key)
        if number and column != image_column:
            raise ExtractError(f"--data parquet: {file} has its images in '{column}', other files in '{image_column}'")
        label = _label_column(file, schema, label_key)
        if number and label != label_column:
            raise ExtractError(f"--data parquet: {file} has label column {label!r}, other files {label_column!r}")
        kind = label is not None and _label_kind(file, schema, label)
        if number and kind != names:
            raise ExtractError(f"--data parquet: {file} has {'string' if kind else 'integer'} labels, other files not")
        image_column, label_column, names = column, label, kind
        if label is not None and classes is None:
            classes = _class_names(schema, label)
        row_groups.append([metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)])
    assert image_column is not None
    if names:
        classes = _names_in(files, label_column)
    return ParquetListing(files, row_groups, image_column, label_column, classes, labels_are_names=names)


class ParquetSource(Source):
    def __init__(self, listing: ParquetListing) -> None:
        self.listing = listing
        self.classes = listing.classes
        self.class_ids = {name: i for i, name in enumerate(listing.classes or [])} if listing.labels_are_names else {}
        unique = len({Path(f).name for f in listing.files}) == len(listing.files)
        self.names = [Path(f).name if unique else f for f in listing.files]
        # global row -> (file, row group): the first global row of every file and row group
        self.groups: list[tuple[int, int]] = []
        self.group_starts: list[int] = []
        self.file_starts: list[int] = []
        total = 0
        for number, sizes in enumerate(listing.row_groups):
            self.file_starts.append(total)
            for group, rows in enumerate(sizes):
                self.groups.append((number, group))
                self.group_starts.append(total)
                total += rows
        self.total = total

    def __len__(self) -> int:
        return self.total

    def _file_and_row(self, index: int) -> tuple[int, int]:
        number = bisect.bisect_right(self.file_starts, index) - 1
        return number, index - self.file_starts[number]

    def key(self, index: int) -> str:
        number, row = self._file_and_row(index)
        return f"{self.names[number]}/{row}"

    def describe(self, index: int) -> str:
        number, row = self._file_and_row(index)
        return f"{self.listing.files[number]} row {row}"

    def _row_group(self, position: int) -> dict[str, list[Any]]:
        cache: OrderedDict[int, dict[str, list[Any]]] = self.__dict__.setdefault("_open_cache", OrderedDict())
        if position not in cache:
            import pyarrow.parquet as pq

            number, group = self.groups[position]
            columns = [c for c in (self.listing.image_column, self.listing.label_column) if c is not None]
            table = pq.ParquetFile(self.listing.files[number]).read_row_group(group, columns=columns)
            cache[position] = {name: table.column(name).to_pylist() for name in columns}
            while len(cache) > ROW_GROUPS_CACHED:
                cache.popitem(last=False)
        return cache[position]

    def load(self, index: int) -> tuple[RawImage, int]:
        position = bisect.bisect_right(self.group_starts, index) - 1
        rows = self._row_group(position)
        at = index - self.group_starts[position]
        value = stored_image(
            rows[self.listing.image_column][at], beside=Path(self.listing.files[self.groups[position][0]]).parent
        )
        label = rows[self.listing.label_column][at] if self.listing.label_column else None
        if self.listing.labels_are_names:
            label = self.class_ids.get(label, -1)
        return value, int(label) if isinstance(label, int) else -1

    @property
    def notice(self) -> str | None:
        if not self.listing.labels_are_names:
            return None
        return (
            f"label column '{self.listing.label_column}' holds class names: mapped to class ids "
            f"0..{len(self.classes or []) - 1} "
            "in sorted order, as datasets' class_encode_column does (classes are stored)"
        )

    def listing_sha256(self) -> str:
        # the names decide the labels; a listing with integer labels hashes as it always did
        names = [f"classes\t{json.dumps(self.classes)}"] if self.listing.labels_are_names else []
        return listing_hash(
            [f"{self.listing.image_column}\t{self.listing.label_column}", *names]
            + [f"{f}\t{groups}" for f, groups in zip(self.listing.files, self.listing.row_groups, strict=True)]
        )


def open_parquet(pattern: str, request: DataRequest) -> ParquetSource:
    image_key, label_key = request.options.image_key, request.options.label_key
    return ParquetSource(on_one_rank(request.ranks, lambda: list_parquet(pattern, image_key, label_key)))
