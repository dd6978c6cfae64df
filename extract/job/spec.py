"""The job: every option of a run, validated in one place (the identity that ties a store to it is the
store's schema: ``extract.store.schema``)."""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from ..data.decode import DECODES
from ..errors import ExtractError
from ..store.location import is_url, parse
from ..store.schema import COMPRESSORS, codecs

DTYPES = ("float16", "float32")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICE_MAPS = ("auto",)
MAX_TIMEOUT = 7 * 24 * 3600  # a barrier waited on for longer than a week is a hang, not a slow peer
SEEDS = range(-(2**63), 2**64)  # what torch.manual_seed takes
# --compressor when it is not given, by the kind of store (benchmarks/codecs.py; RESULTS.md, "Codecs"): a
# text model's activations (per token or pooled per document) compress 1.08x with zstd-1, which costs 2.7x
# the CPU to write and 2-3x to read; image maps after a ReLU compress 1.95x. A resumed store keeps its own.
DEFAULT_COMPRESSORS = {"images": "zstd", "documents": "none", "tokens": "none"}


@dataclass
class JobSpec:
    model: str = "resnet50"
    weights: str = "DEFAULT"
    checkpoint: str | None = None
    layers: list[str] = field(default_factory=list)
    data: str = "synthetic:512"
    out: str = "features.zarr"
    batch_size: int = 64
    num_workers: int | None = None
    image_size: int | None = None
    pool: str | list[str] = "none"
    layout: list[str] | None = None
    dtype: str = "float16"
    precision: str | None = None
    chunk_size: int | None = None
    compressor: str | None = None  # None: DEFAULT_COMPRESSORS for the kind of store (``store_compressor``)
    truncate: bool = True
    overwrite: bool = False
    seed: int = 0
    channels_last: bool = False
    writer_threads: int | None = None
    skip_bad_images: bool = False
    image_key: str | None = None
    label_key: str | None = None
    text_key: str | None = None
    context_length: int | None = None
    pack: int | None = None
    device_map: str | None = None
    tokens_per_batch: int | None = None
    decode: str = "pil"
    exif_transpose: bool = False
    timeout: float = 1800.0

    def validate(self) -> None:
        """Reject bad values before anything is built or written."""
        check_types(self.to_dict(), "job option")
        for name in ("batch_size", "writer_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ExtractError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("chunk_size", "image_size", "context_length", "tokens_per_batch", "pack"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ExtractError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
        if self.pack is not None and self.context_length is not None and self.pack != self.context_length:
            raise ExtractError(
                f"--pack {self.pack} makes contexts of {self.pack} tokens, but --context-length is "
                f"{self.context_length}; give one of them (--pack alone sets the context length)"
            )
        if not (math.isfinite(self.timeout) and 0 < self.timeout <= MAX_TIMEOUT):
            raise ExtractError(
                f"--timeout must be positive seconds, at most {MAX_TIMEOUT} (a week), got {self.timeout}"
            )
        if self.seed not in SEEDS:
            raise ExtractError(f"--seed must be between -2**63 and 2**64 - 1 (torch's range), got {self.seed}")
        _check_out(self.out)
        if self.num_workers is not None and self.num_workers < 0:
            raise ExtractError(f"--num-workers must be 0 or more, got {self.num_workers}")
        if self.compressor is not None:
            codecs(self.compressor)  # an unknown one is refused by name
        if self.dtype not in DTYPES:
            raise ExtractError(f"unknown --dtype '{self.dtype}'; choose one of {', '.join(DTYPES)}")
        if self.decode not in DECODES:
            raise ExtractError(f"unknown --decode '{self.decode}'; choose one of {', '.join(DECODES)}")
        if self.device_map is not None and self.device_map not in DEVICE_MAPS:
            raise ExtractError(
                f"unknown --device-map '{self.device_map}'; choose {', '.join(DEVICE_MAPS)} (accelerate's big-model dispatch)"
            )
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ExtractError(f"unknown --precision '{self.precision}'; choose one of {', '.join(PRECISIONS)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def store_compressor(self, kind: str, existing: Mapping[str, Any] | None) -> str:
        """The compressor a store of ``kind`` gets: ``--compressor`` if given; else, when the store at
        ``--out`` is resumed (``existing``, its attributes, and no ``--overwrite``), the one its identity
        records, so that a store made under another default (zstd, before text stores' became none) is
        the same job; else ``DEFAULT_COMPRESSORS[kind]``. The identity records the answer, never None."""
        if self.compressor is not None:
            return self.compressor
        recorded = (existing or {}).get("identity", {}).get("compressor") if not self.overwrite else None
        return recorded if recorded in COMPRESSORS else DEFAULT_COMPRESSORS[kind]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _check_out(out: str) -> None:
    """``--out`` names a store of its own: the current directory, or one above it, would be taken over
    (and ``--overwrite`` would delete it)."""
    if not out.strip():
        raise ExtractError("--out is empty; name the store to write, e.g. features.zarr")
    if is_url(out):
        parse(out)  # a malformed store URL is one line now, before any compute
        return
    here, path = Path.cwd().resolve(), Path(out).resolve()
    if path == here or path in here.parents:
        where = "the current directory" if path == here else f"a directory above the current one ({here})"
        raise ExtractError(f"--out {out} is {where}; name a store inside it, e.g. --out features.zarr")


def _fits(value: Any, expected: Any) -> bool:
    if get_origin(expected) is types.UnionType:
        return any(_fits(value, option) for option in get_args(expected))
    if expected is type(None):
        return value is None
    if get_origin(expected) is list:
        (item,) = get_args(expected)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if expected is float:  # an integer number of seconds is fine; a boolean is not a number
        return type(value) in (int, float)
    return type(value) is expected  # exact: True is not an int, "no" is not a bool


def _describe(expected: Any) -> str:
    if get_origin(expected) is types.UnionType:
        return " or ".join(_describe(option) for option in get_args(expected))
    if get_origin(expected) is list:
        return f"a list of {_describe(get_args(expected)[0]).split(' ', 1)[1]}s"
    names = {bool: "a boolean (true or false)", int: "an integer", float: "a number", str: "a string"}
    return names.get(expected, "null" if expected is type(None) else str(expected))


def check_types(options: Mapping[str, Any], source: str) -> None:
    """Every option must have its ``JobSpec`` type exactly: booleans are booleans, integers integers.
    A TOML ``overwrite = "no"`` is truthy and would replace a store; ``chunk_size = true`` would be 1."""
    hints = get_type_hints(JobSpec)
    for key, value in options.items():
        expected = hints.get(key)
        if expected is not None and not _fits(value, expected):
            raise ExtractError(
                f"{source} '{key}' = {value!r} must be {_describe(expected)}, not {type(value).__name__}"
            )
