"""``text:GLOB``: the documents of text files, listed once and streamed in order.

- ``.jsonl`` and ``.jsonl.gz``: one document per line (a JSON object), its text in field
  ``--text-key`` (default ``text``); a blank line is a bad line, since it is not JSON;
- ``.txt``: one document per file (UTF-8);
- ``.parquet``: one document per row of a string column ``--text-key``, read by row group.

A field or column ``input_ids`` (a list of integers) is taken as already tokenized where the text
field is absent (or with ``--text-key input_ids``). Labels come from ``--label-key`` (none without
it): in jsonl an integer field, or a string field whose distinct values, sorted, are the class names
(a label is its name's index); in Parquet an integer column (class names from Hugging Face's
``ClassLabel`` metadata) or a dictionary column (its values are the class names). A corpus's labels
are all class ids or all class names. jsonl labels are read when the files are listed (a second,
cheap pass of each file), so that a bad one is refused before the model loads.

Keys are ``file.jsonl/LINE`` (0-based), ``file.txt`` and ``file.parquet/ROW``, the file relative to
the glob's literal folder. Files are sorted by name, and a glob may mix the extensions.

The shared checks of one value (is it text, token ids, a label) serve ``hf.py`` too.
"""

from __future__ import annotations

import bisect
import glob
import gzip
import hashlib
import itertools
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..errors import ExtractError
from .listing import on_one_rank, split_across_ranks
from .source import (
    LABEL_RANGE,
    DataOptions,
    DataRequest,
    Document,
    TextSource,
    listing_hash,
    utf8_name,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from ..processes import Processes

EXTENSIONS = {".jsonl.gz": "jsonl.gz", ".jsonl": "jsonl", ".txt": "txt", ".parquet": "parquet"}
KNOWN = ".jsonl (or .jsonl.gz), .txt or .parquet"
TOKENS = "input_ids"  # the field or column of documents that came tokenized (as SAELens names it)
BLOCK = 1 << 20  # bytes read at a time while listing
LINES_PER_MARK = 4096  # a plain .jsonl keeps the byte offset of every 4096th line: a rank's share starts by a seek
PARQUET_BATCH = 1024  # rows converted to Python at a time: memory stays bounded within a large row group
SKIP_HINT = "or pass --skip-bad-images to record bad documents as invalid"


# ---- one value: text, token ids, a label (shared with hf.py) ------------------------------------


def json_kind(value: Any) -> str:
    """What a JSON value is, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object" if isinstance(value, dict) else type(value).__name__


def token_ids(value: Any) -> list[int] | None:
    """``value`` as token ids where it is a list of integers (booleans are no token ids), else None."""
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def text_document(value: Any, name: str, tokenized: bool, label: int, where: Callable[[], str]) -> Document:
    """The document whose field or column ``name`` holds ``value``: text, or token ids where
    ``tokenized``; anything else is refused naming the field."""
    if value is None:
        raise ExtractError(f"{where()}: '{name}' is null, no document; fill it in or drop the document")
    if tokenized:
        ids = token_ids(value)
        if ids is None:
            held = json_kind(value)
            if isinstance(value, list):
                bad = next(v for v in value if not isinstance(v, int) or isinstance(v, bool))
                held = f"a list holding {json_kind(bad)}"
            raise ExtractError(f"{where()}: '{name}' is {held}, not a list of integer token ids; fix the data")
        return Document(input_ids=ids, label=label)
    if not isinstance(value, str):
        raise ExtractError(
            f"{where()}: '{name}' is {json_kind(value)}, not text; name the field or column of the text with --text-key"
        )
    return Document(text=value, label=label)


def checked_label(value: Any, name: str, where: Callable[[], str]) -> int:
    """A label as the store keeps it: an integer that fits int64; null is no label (-1)."""
    if value is None:
        return -1
    if not isinstance(value, int) or isinstance(value, bool):
        raise ExtractError(
            f"{where()}: label '{name}' (--label-key) is {json_kind(value)}, not an integer; name another with --label-key"
        )
    if not LABEL_RANGE[0] <= value <= LABEL_RANGE[1]:
        raise ExtractError(f"{where()}: label '{name}' (--label-key) is {value}, which does not fit in int64")
    return value


def bad_document(culprit: str, skip_bad: bool) -> Document:
    """A document that cannot be read: recorded invalid with ``skip_bad``, else the job stops naming it."""
    if not skip_bad:
        raise ExtractError(f"{culprit}; fix it, {SKIP_HINT}")
    return Document(text="", error=culprit)


# ---- listing -------------------------------------------------------------------------------------


@dataclass
class TextFile:
    """One file of the corpus, as listed."""

    path: str  # as globbed (absolute where the pattern is)
    name: str  # relative to the glob's literal folder, "/" separators: the keys' prefix
    kind: str  # jsonl | jsonl.gz | txt | parquet
    count: int = 0  # documents
    digest: str = ""  # what the listing hash takes of the file
    marks: list[int] = field(default_factory=list)  # jsonl: byte offset of lines 0, 4096, 8192, ...
    row_groups: list[int] = field(default_factory=list)  # parquet: rows per row group
    column: str | None = None  # parquet: the text (or input_ids) column
    label_names: bool = False  # its labels are class names (parquet: a dictionary column; jsonl: strings)
    names: list[str] | None = None  # the class names its data gives (jsonl: sorted)
    label_ids: bool = False  # its labels are integers (class ids)
    label_at: str = ""  # where its first label is, for messages: "a.jsonl line 3", "b.parquet column 'y'"


@dataclass
class TextListing:
    root: str
    files: list[TextFile]
    classes: list[str] | None


def literal_root(pattern: str) -> str:
    """The folder of a glob's literal part: ``data/**/*.jsonl`` -> ``data``; a plain file: its folder."""
    literal = []
    for part in Path(pattern).parts[:-1]:
        if glob.has_magic(part):
            break
        literal.append(part)
    return str(Path(*literal)) if literal else "."


def _kind(name: str) -> str | None:
    lower = name.lower()
    return next((kind for ext, kind in EXTENSIONS.items() if lower.endswith(ext)), None)


def _matched(pattern: str) -> tuple[str, list[TextFile]]:
    """The files ``pattern`` matches, sorted, each with its kind; refuses no match and other files."""
    spec = f"--data text:{pattern}"
    if os.path.isdir(pattern):
        raise ExtractError(f"{spec} is a folder; give a pattern of files, such as text:{Path(pattern) / '*.jsonl'}")
    root = literal_root(pattern)
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not paths:
        raise ExtractError(f"{spec}: no file matches it; text files are {KNOWN}")
    files = []
    for path in paths:
        name = os.path.relpath(path, root).replace(os.sep, "/")
        if not utf8_name(name):
            shown = os.fsencode(name).decode("utf-8", "backslashreplace")
            raise ExtractError(f"{spec}: the name {shown} is not UTF-8; rename it (keys are UTF-8 text)")
        kind = _kind(name)
        if kind is None:
            suffix = f"'{Path(name).suffix}'" if Path(name).suffix else "no extension"
            raise ExtractError(f"{spec}: {path} has {suffix}; text files are {KNOWN}; narrow the pattern to those")
        files.append(TextFile(path, name, kind))
    return root, files


def _count_lines(file: TextFile, stream: IO[bytes], marks: bool) -> None:
    """Lines (one document each) and a hash of the bytes, in one pass; with ``marks`` the byte offset
    of every LINES_PER_MARK-th line."""
    import numpy as np

    digest = hashlib.sha256()
    newlines, position, last = 0, 0, b"\n"
    file.marks = [0] if marks else []
    while block := stream.read(BLOCK):
        digest.update(block)
        ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 0x0A)
        if marks:
            # line L starts after newline L (1-based): the marks among lines newlines+1 .. newlines+len(ends)
            first = -(-(newlines + 1) // LINES_PER_MARK) * LINES_PER_MARK
            for line in range(first, newlines + len(ends) + 1, LINES_PER_MARK):
                file.marks.append(position + int(ends[line - newlines - 1]) + 1)
        newlines += len(ends)
        position += len(block)
        last = block[-1:]
    file.count = newlines + (last != b"\n")  # a last line without its newline is a line
    file.digest = digest.hexdigest()


def _parquet_footer(path: str) -> str:
    """A Parquet file's size and footer (row groups, column chunk sizes and offsets, statistics): what
    changes when its contents do, without reading a whole corpus again on every resume."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size - 8)
        (length,) = struct.unpack("<i", f.read(4))
        f.seek(size - 8 - length)
        return hashlib.sha256(f"{size}\n".encode() + f.read(length)).hexdigest()


def _is_string(kind: pa.DataType) -> bool:
    import pyarrow as pa

    view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or view(kind)


def _is_token_ids(kind: pa.DataType) -> bool:
    import pyarrow as pa

    lists = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    return lists and pa.types.is_integer(kind.value_type)


def _parquet_text_column(path: str, schema: pa.Schema, text_key: str | None) -> str:
    names = ", ".join(schema.names)
    strings = [f.name for f in schema if _is_string(f.type)]
    use = strings[0] if len(strings) == 1 else "NAME"
    column = text_key or ("text" if "text" in schema.names or TOKENS not in schema.names else TOKENS)
    if column not in schema.names:
        which = "(--text-key)" if text_key else f"(nor '{TOKENS}')"
        raise ExtractError(
            f"--data text: {path} has no column '{column}' {which}; it has {names}; use --text-key {use}"
        )
    kind = schema.field(column).type
    if column == TOKENS and not _is_token_ids(kind):
        raise ExtractError(f"--data text: {path} column '{column}' holds {kind}, not a list of integer token ids")
    if column != TOKENS and not _is_string(kind):
        hint = f"; the text may be in {', '.join(strings)} (--text-key)" if strings else ""
        raise ExtractError(f"--data text: {path} column '{column}' holds {kind}, not text (a string column){hint}")
    return column


def _parquet_labels(file: TextFile, parquet: Any, label_key: str) -> None:
    """The label column's kind: integers (class names from Hugging Face's metadata) or a dictionary
    column, whose values (gathered over every row group, in order) are the class names."""
    import pyarrow as pa

    from .parquet import _class_names

    schema = parquet.schema_arrow
    if label_key not in schema.names:
        raise ExtractError(
            f"--data text: {file.path} has no column '{label_key}' (--label-key); it has {', '.join(schema.names)}"
        )
    kind = schema.field(label_key).type
    file.label_at = f"{file.path} column '{label_key}'"
    if pa.types.is_integer(kind):
        file.names = _class_names(schema, label_key)
        file.label_ids = True
        return
    if not (pa.types.is_dictionary(kind) and _is_string(kind.value_type)):
        raise ExtractError(
            f"--data text: {file.path} label column '{label_key}' holds {kind}; labels are integers or a dictionary "
            "(categorical) column of class names; name another column with --label-key"
        )
    file.label_names = True
    names: dict[str, None] = {}
    for batch in parquet.iter_batches(batch_size=1 << 16, columns=[label_key]):
        names.update(dict.fromkeys(batch.column(0).dictionary.to_pylist()))
    file.names = list(names)


def _jsonl_labels(file: TextFile, stream: IO[bytes], label_key: str) -> None:
    """A jsonl file's labels, read while listing: integers (class ids) or strings (class names, their
    distinct values kept sorted: memory grows with the classes, not the lines), not both. A label that
    is neither, or a line without the field, is refused now, naming the line; a line that is not a JSON
    object is left to the reading, which names it or records it invalid (``--skip-bad-images``)."""
    names: set[str] = set()
    first: dict[type, tuple[int, Any]] = {}  # int | str -> (line, value) of its first label
    for number, raw in enumerate(stream, 1):
        try:  # decoded as the reading decodes it (a BOM may open the file)
            record = json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not isinstance(record, dict):
            continue
        where = f"{file.path} line {number}"
        if label_key not in record:
            fields = ", ".join(record) or "none"
            raise ExtractError(f"{where} has no field '{label_key}' (--label-key) (it has: {fields})")
        value = record[label_key]
        if isinstance(value, str):
            names.add(value)
        else:
            checked_label(value, label_key, lambda where=where: where)  # an integer that fits int64, or null
        if value is not None and type(value) not in first:
            first[type(value)] = (number, value)
    if len(first) > 1:
        (line, value), (other_line, other) = sorted(first.values(), key=lambda seen: seen[0])
        raise _mixed_labels(f"{file.path} line {other_line}", other, f"{file.path} line {line}", value, label_key)
    if str in first:
        file.label_names, file.names = True, sorted(names)
    file.label_ids = int in first
    if first:
        file.label_at = f"{file.path} line {next(iter(first.values()))[0]}"


def _mixed_labels(where: str, value: Any, first: str, first_value: Any, label_key: str) -> ExtractError:
    """Class ids and class names in one corpus: named at the first label of the other kind."""
    return ExtractError(
        f"{where}: label '{label_key}' (--label-key) is {_label_kind(value)}, but {first} holds "
        f"{_label_kind(first_value)}; labels are all class ids or all class names: make them one kind"
    )


def _label_kind(value: Any) -> str:
    return f"a string ({json.dumps(value)[:40]})" if isinstance(value, str) else f"an integer ({value})"


def _scan(file: TextFile, text_key: str | None, label_key: str | None) -> TextFile:
    """One file's documents counted and its contents hashed (one rank's share of the listing); a
    jsonl file's labels read (``_jsonl_labels``) where ``label_key`` names them."""
    try:
        if file.kind in ("jsonl", "jsonl.gz"):
            with open(file.path, "rb") if file.kind == "jsonl" else gzip.open(file.path, "rb") as f:
                _count_lines(file, f, marks=file.kind == "jsonl")  # no seeking in a gzip stream
            if label_key is not None:  # a second pass: a line's JSON is parsed only when labels are asked for
                with open(file.path, "rb") if file.kind == "jsonl" else gzip.open(file.path, "rb") as f:
                    _jsonl_labels(file, f, label_key)
        elif file.kind == "txt":
            if label_key is not None:
                raise ExtractError(
                    f"--data text: {file.path} is a .txt file, which has no fields; --label-key {label_key} "
                    "needs .jsonl or .parquet files"
                )
            with open(file.path, "rb") as f:
                _count_lines(file, f, marks=False)  # for the hash: a .txt is one document
            file.count = 1
        else:
            _scan_parquet(file, text_key, label_key)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ExtractError(f"--data text: {file.path} is not a readable gzip file ({e}); recompress it") from None
    except OSError as e:
        raise ExtractError(f"--data text: cannot read {file.path} ({e.strerror or e})") from None
    return file


def _scan_parquet(file: TextFile, text_key: str | None, label_key: str | None) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ExtractError(
            f"--data text: {file.path} is Parquet, which needs the 'pyarrow' package; install it with "
            "pip install 'extract[parquet]'"
        ) from None

    try:
        parquet = pq.ParquetFile(file.path)
    except (pa.ArrowException, OSError) as e:
        raise ExtractError(f"--data text: {file.path} is not a readable Parquet file ({e})") from None
    file.column = _parquet_text_column(file.path, parquet.schema_arrow, text_key)
    if label_key is not None:
        _parquet_labels(file, parquet, label_key)
    metadata = parquet.metadata
    file.row_groups = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
    file.count = sum(file.row_groups)
    file.digest = _parquet_footer(file.path)


def _classes(files: list[TextFile], label_key: str | None) -> list[str] | None:
    """The corpus's class names: those its files give, which must agree. Files hold labels one way,
    class ids or class names (refused naming the first label of the other kind). Names from jsonl
    strings are sorted (with a dictionary column's, where both are); a dictionary column's alone
    are merged in order, since each file lists the values it holds."""
    labelled = [f for f in files if f.label_ids or f.label_names]
    if not labelled:
        return None
    head = labelled[0]
    other = next((f for f in labelled if (f.label_names, f.label_ids) != (head.label_names, head.label_ids)), None)
    if other is not None:
        kinds = ("class names (strings)", "class ids (integers)")
        theirs, ours = kinds if other.label_names else kinds[::-1]
        raise ExtractError(
            f"{other.label_at}: labels '{label_key}' (--label-key) are {theirs}, but {head.label_at} holds {ours}; "
            "labels are all class ids or all class names: make them one kind"
        )
    named = [f for f in labelled if f.names is not None]
    if not named:
        return None
    if head.label_names:
        merged: dict[str, None] = {}
        for f in named:
            merged.update(dict.fromkeys(f.names or []))
        strings = any(f.kind != "parquet" for f in named)  # jsonl names: in sorted order
        return sorted(merged) if strings else list(merged)
    for f in named[1:]:
        if f.names != named[0].names:
            raise ExtractError(f"--data text: {f.path} names its classes differently from {named[0].path}")
    return named[0].names


def list_text(pattern: str, options: DataOptions, ranks: Processes | None = None) -> TextListing:
    """The corpus ``pattern`` matches: globbed on one rank, each file counted and hashed by one rank."""
    root, files = on_one_rank(ranks, lambda: _matched(pattern))
    text_key, label_key = options.text_key, options.label_key
    scanned = split_across_ranks(ranks, files, lambda f: _scan(f, text_key, label_key))
    return TextListing(root, scanned, _classes(scanned, label_key))


# ---- reading -------------------------------------------------------------------------------------


class TextFiles(TextSource):
    """The documents of ``text:GLOB``."""

    def __init__(self, listing: TextListing, text_key: str | None, label_key: str | None, skip_bad: bool) -> None:
        self.listing, self.files = listing, listing.files
        self.text_key, self.label_key, self.skip_bad = text_key, label_key, skip_bad
        self.classes = listing.classes
        self.class_ids = {name: i for i, name in enumerate(self.classes or [])}
        self.starts = list(itertools.accumulate((f.count for f in self.files), initial=0))

    def __len__(self) -> int:
        return self.starts[-1]

    def _locate(self, index: int) -> tuple[TextFile, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        number = bisect.bisect_right(self.starts, index) - 1
        return self.files[number], index - self.starts[number]

    @staticmethod
    def _key(file: TextFile, at: int) -> str:
        return file.name if file.kind == "txt" else f"{file.name}/{at}"

    def key(self, index: int) -> str:
        return self._key(*self._locate(index))

    def keys(self) -> list[str]:
        return [self._key(f, at) for f in self.files for at in range(f.count)]

    @staticmethod
    def _where(file: TextFile, at: int) -> str:
        if file.kind == "txt":
            return file.path
        return f"{file.path} row {at}" if file.kind == "parquet" else f"{file.path} line {at + 1}"

    def describe(self, index: int) -> str:
        return self._where(*self._locate(index))

    def listing_sha256(self) -> str:
        header = [f"text\t{self.text_key}\t{self.label_key}", f"classes\t{json.dumps(self.classes)}"]
        files = (f"{f.name}\t{f.kind}\t{f.count}\t{f.column}\t{f.digest}" for f in self.files)
        return listing_hash([*header, *files])

    def documents(self, start: int, stop: int) -> Iterator[Document]:
        self._check_range(start, stop)
        number = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            file, first = self.files[number], self.starts[number]
            last = min(stop, self.starts[number + 1])
            if last > start:
                yield from self._read(file, start - first, last - first)
            start, number = last, number + 1

    def _read(self, file: TextFile, lo: int, hi: int) -> Iterator[Document]:
        try:
            if file.kind == "parquet":
                yield from self._parquet(file, lo, hi)
            elif file.kind == "txt":
                yield self._txt(file)
            else:
                yield from self._jsonl(file, lo, hi)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise ExtractError(
                f"{file.path} is not a readable gzip file ({e}); it changed since it was listed"
            ) from None
        except OSError as e:
            raise ExtractError(f"cannot read {file.path} ({e.strerror or e}); it changed since it was listed") from None

    def _txt(self, file: TextFile) -> Document:
        data = Path(file.path).read_bytes()
        try:
            return Document(text=data.decode("utf-8-sig"))
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            return bad_document(f"{file.path} line {line} is not UTF-8 text", self.skip_bad)

    def _jsonl(self, file: TextFile, lo: int, hi: int) -> Iterator[Document]:
        opened = gzip.open(file.path, "rb") if file.kind == "jsonl.gz" else open(file.path, "rb")
        with opened as stream:
            line = 0
            if file.marks:
                mark = min(lo // LINES_PER_MARK, len(file.marks) - 1)
                stream.seek(file.marks[mark])
                line = mark * LINES_PER_MARK
            read = 0
            for at, raw in enumerate(itertools.islice(stream, lo - line, hi - line), lo):
                read += 1
                yield self._line(file, at, raw)
        if read < hi - lo:
            raise ExtractError(f"{file.path} has {lo + read} lines, {file.count} when it was listed; it changed")

    def _line(self, file: TextFile, at: int, raw: bytes) -> Document:
        where = f"{file.path} line {at + 1}"
        try:
            line = raw.decode("utf-8-sig" if at == 0 else "utf-8")
        except UnicodeDecodeError as e:
            return bad_document(f"{where} is not UTF-8 text (byte {e.start + 1})", self.skip_bad)
        if not line.strip():
            return bad_document(f"{where} is blank, not JSON (one object per line)", self.skip_bad)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            return bad_document(f"{where} is not JSON ({e.msg} at column {e.colno})", self.skip_bad)
        if not isinstance(record, dict):
            return bad_document(f"{where} is {json_kind(record)}, not a JSON object", self.skip_bad)
        label = -1
        if self.label_key is not None:
            if self.label_key not in record:
                fields = ", ".join(record) or "none"
                raise ExtractError(f"{where} has no field '{self.label_key}' (--label-key) (it has: {fields})")
            label = self._label(record[self.label_key], where)
        name = self.text_key or ("text" if "text" in record or TOKENS not in record else TOKENS)
        if name not in record:
            strings = [k for k, v in record.items() if isinstance(v, str)]
            use = strings[0] if len(strings) == 1 else "NAME"
            fields = ", ".join(record) or "none"
            raise ExtractError(f"{where} has no field '{name}' (it has: {fields}); use --text-key {use}")
        return text_document(record[name], name, name == TOKENS, label, lambda: where)

    def _label(self, value: Any, where: str) -> int:
        """A jsonl label: a class name's index among the corpus's classes, or an integer as given."""
        if not isinstance(value, str):
            return checked_label(value, self.label_key or "", lambda: where)
        if value not in self.class_ids:
            raise ExtractError(f"{where}: label '{value[:40]}' was not in the file when it was listed; it changed")
        return self.class_ids[value]

    def _parquet(self, file: TextFile, lo: int, hi: int) -> Iterator[Document]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        assert file.column is not None
        group_starts = list(itertools.accumulate(file.row_groups, initial=0))
        first = bisect.bisect_right(group_starts, lo) - 1
        last = bisect.bisect_left(group_starts, hi)  # groups first .. last-1 hold rows lo .. hi-1
        columns = [file.column, *([self.label_key] if self.label_key is not None else [])]
        row = group_starts[first]
        try:
            batches = pq.ParquetFile(file.path).iter_batches(
                PARQUET_BATCH, row_groups=list(range(first, last)), columns=columns
            )
            for batch in batches:
                skip = max(lo - row, 0)
                take = min(batch.num_rows, hi - row) - skip
                if take > 0:
                    part = batch.slice(skip, take)
                    labels = self._column_labels(file, part, row + skip)
                    for offset, value in enumerate(part.column(0).to_pylist()):
                        at = row + skip + offset
                        where = lambda at=at: f"{file.path} row {at}"  # noqa: E731 - built only for a message
                        yield text_document(value, file.column, file.column == TOKENS, labels[offset], where)
                row += batch.num_rows
                if row >= hi:
                    break
        except pa.ArrowException as e:
            raise ExtractError(f"cannot read {file.path} ({e}); it changed since it was listed") from None
        if row < hi:
            raise ExtractError(f"{file.path} has {row} rows, {file.count} when it was listed; it changed")

    def _column_labels(self, file: TextFile, batch: pa.RecordBatch, first: int) -> list[int]:
        if self.label_key is None:
            return [-1] * batch.num_rows
        column = batch.column(1)
        if file.label_names:  # each batch carries its own dictionary: map its names to the corpus's classes
            ids = [self.class_ids[name] for name in column.dictionary.to_pylist()]
            return [-1 if i is None else ids[i] for i in column.indices.to_pylist()]
        return [
            checked_label(value, self.label_key, lambda at=at: f"{file.path} row {at}")
            for at, value in enumerate(column.to_pylist(), first)
        ]


def open_text(pattern: str, request: DataRequest) -> TextFiles:
    options = request.options
    listing = list_text(pattern, options, request.ranks)
    return TextFiles(listing, options.text_key, options.label_key, options.skip_bad)
