"""Export a packed token store (or an image store's patches) to the activation cache SAELens trains from.

    export_saelens("packed.zarr", "cache", "transformer.h.6", hook_name="blocks.6.hook_resid_post")

(``python -m extract.export STORE --to saelens DIR --layer L``, in ``extract.cli.export``, is the
command over it.) The cache is the Hugging Face ``datasets`` dataset that SAELens's
``CacheActivationsRunner`` writes and its ``ActivationsStore`` loads when a config has
``use_cached_activations=True`` and ``cached_activations_path=DIR`` (sae-lens 6.x):

- a directory as ``Dataset.save_to_disk`` leaves it: ``data-00000-of-0000S.arrow`` shards, ``state.json``
  (the shards, a fingerprint computed as ``CacheActivationsRunner._consolidate_shards`` computes it) and
  ``dataset_info.json`` (the features);
- one row per context, columns ``{hook_name: Array2D(shape=(context_size, d_in), dtype)}`` and
  ``token_ids: Sequence(Value("int32"), length=context_size)``, the features
  ``CacheActivationsRunner.__init__`` builds (``sae_lens/cache_activations_runner.py``);
- ``ActivationsStore.load_cached_activation_dataset`` (``sae_lens/training/activations_store.py``)
  checks only that the column ``hook_name`` exists and that its feature's ``shape`` is
  ``(context_size, d_in)``; it converts to its own ``dtype`` on reading, so float16 stays float16 here.

Beside them ``extract_export.json`` records where the rows came from (store, layer, packing) and the
settings a SAELens config needs (``hook_name``, ``context_size``, ``d_in``, ``training_tokens``), with
the store's ``scaling_factor`` (``Features.stats``); ``load_from_disk`` ignores it.

Only a packed store (``--pack T``) holds SAELens's contexts: T tokens each, starting with BOS, the
documents concatenated with a separator, so context i is rows ``i*T:(i+1)*T``. An image store's
per-position layer (a ViT block or a conv map kept whole, ``--pool none``) exports too: a context is
one image's T patches (``TokenStream``'s rows of it: a ViT's CLS and register tokens included, since
SAELens's cached path reads whole contexts; a map's ``h * W + w``), there are no ``token_ids``
(SAELens's ``ActivationsStore`` reads a cache without them), and images that could not be decoded
(``valid`` False, stored as NaN) are left out. A ragged token store, a document store, a pooled image
layer and an unfinished store are refused.

The export streams: a block of whole contexts (about ``BLOCK_BYTES``) is read, written to the current
shard and dropped, so memory holds one block whatever the layer's size. It is written into a hidden
directory beside DIR that is renamed to DIR once complete, so an error or an interrupt leaves DIR as it
was (absent, or the dataset ``overwrite`` would have replaced).

It lives in ``analysis``: like every analysis it consumes a store through ``extract.read`` alone
(``open_features``, ``Features.load``, ``load_token_ids``, ``stats``), and writes something that is not
a store; ``read`` is the reader itself, and neither imports ``job`` or ``cli``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..errors import ExportError, ExtractError, StoreDamagedError
from ..names import Kind
from ..read.features import Features, open_features
from ..read.sources import Rows, layer_rows

BLOCK_BYTES = 64 * 2**20  # contexts read and written at a time
SHARD_BYTES = 500 * 10**6  # rows per arrow file: datasets' own default max_shard_size ("500MB")
DTYPES = ("float16", "float32")  # what a store exports to (arrow has no bfloat16: a bfloat16 store gives float32)
METADATA = "extract_export.json"


@dataclass(frozen=True)
class SAELensCache:
    """What ``export_saelens`` wrote: the dataset at ``path``, ``contexts`` rows of ``context_size``
    tokens, column ``hook_name`` of (``context_size``, ``d_in``) ``dtype`` values, in ``shards`` files;
    ``scaling_factor`` is the store's (None for a store written before statistics)."""

    path: Path
    hook_name: str
    contexts: int
    context_size: int
    d_in: int
    dtype: str
    shards: int
    scaling_factor: float | None

    @property
    def training_tokens(self) -> int:
        return self.contexts * self.context_size

    def line(self, layer: str) -> str:
        factor = "" if self.scaling_factor is None else f"; scaling_factor {self.scaling_factor:.6g}"
        shards = f"{self.shards} shard{'s' if self.shards != 1 else ''}"
        return (
            f"exported {self.contexts} contexts x {self.context_size} tokens of {layer} (d_in {self.d_in}, "
            f"{self.dtype}) as column '{self.hook_name}' to {self.path} ({shards}){factor}"
        )


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ExtractError(
            "--to saelens writes a Hugging Face dataset and needs the 'datasets' package, which is not installed: "
            "pip install 'extract[datasets]'"
        ) from None
    return datasets


def saelens_features(hook_name: str, context_size: int, d_in: int, dtype: str, token_ids: bool = True) -> Any:
    """The ``datasets.Features`` of a SAELens activation cache, as ``CacheActivationsRunner.__init__``
    (sae_lens/cache_activations_runner.py) builds them for one hook; without ``token_ids`` for images."""
    datasets = _datasets()
    columns = {hook_name: datasets.Array2D(shape=(context_size, d_in), dtype=dtype)}
    if token_ids:
        columns["token_ids"] = datasets.Sequence(datasets.Value(dtype="int32"), length=context_size)
    return datasets.Features(columns)


def _open(store: str | Path | Features) -> Features:
    features = store if isinstance(store, Features) else open_features(store, allow_partial=True)
    if not features.complete:
        raise ExportError(
            f"{features.path} is not complete (status '{features.attrs.get('status')}'): rerun the same extract "
            "command to finish it, then export"
        )
    if features.kind is Kind.DOCUMENTS:
        raise ExportError(
            f"{features.path} is a document (pooled per document) store; SAELens trains on per-token "
            "activations: extract the text model with --pack T (contexts of T tokens) and export that store"
        )
    if features.kind is Kind.IMAGES:
        return features
    if features.pack is None:
        raise ExportError(
            f"{features.path} holds ragged documents, not contexts of equal length: re-extract with --pack T "
            "(e.g. --pack 128) for SAELens's contexts"
        )
    return features


def _check_destination(out: Path, store: Path, overwrite: bool) -> None:
    resolved, source = out.resolve(), store.resolve()
    if resolved == source or source in resolved.parents or resolved in source.parents:
        raise ExportError(f"{out} is the store {store}, inside it or holds it: export to another directory")
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise ExportError(f"{out} exists: pass --overwrite to replace it, or export to a new directory")
    if out.is_symlink() or not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory; --overwrite replaces only a dataset directory")
    if any(out.iterdir()) and not (out / "state.json").is_file():
        raise ExportError(
            f"{out} exists and is not a dataset saved by datasets (no state.json); --overwrite replaces only "
            "such a dataset: remove it yourself or export to a new directory"
        )


def export_saelens(
    store: str | Path | Features,
    out_dir: str | Path,
    layer: str,
    *,
    hook_name: str | None = None,
    dtype: str | None = None,
    shard_contexts: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> SAELensCache:
    """Write ``layer`` of the packed token store ``store`` to ``out_dir`` as SAELens's activation cache
    (or of an image store: a per-position layer, a context per valid image, no ``token_ids``).

    ``hook_name`` names the column (default: the layer's name; SAELens's config must give the same
    ``hook_name``, e.g. ``blocks.6.hook_resid_post``). ``dtype`` is the column's (``float16`` or
    ``float32``; default: the store's, float32 for a bfloat16 store; float16 is refused for a layer whose
    statistics say it holds a value float16 would make inf). ``shard_contexts`` rows per arrow file (default: about 500 MB
    each). An existing ``out_dir`` is refused unless ``overwrite``, which replaces only a saved dataset
    (or an empty directory), and only once the new one is complete. ``progress`` shows a bar of the
    contexts written on stderr (when it is a terminal).
    """
    datasets = _datasets()
    features = _open(store)
    array = features.array(layer)  # a LayerNotFoundError names the layers there are
    dtype, hook_name, patches = _checked_options(features, layer, array, dtype, hook_name, shard_contexts)
    out = Path(out_dir)
    _check_destination(out, features.path, overwrite)
    export = _plan(features, layer, hook_name, dtype, shard_contexts, patches)
    staging = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as e:
        raise ExportError(f"{out}: cannot write beside it in {out.parent} ({e.strerror})") from None
    bar = tqdm(
        total=export.contexts, unit="ctx", desc="extract.export", disable=None if progress else True, file=sys.stderr
    )
    try:
        _write_cache(datasets, staging, export, bar)
        _replace(staging, out)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, ExtractError):
            raise ExportError(f"{out}: writing the dataset failed ({e.strerror or e}); nothing was changed") from e
        raise
    finally:
        bar.close()
    return SAELensCache(
        out, hook_name, export.contexts, export.context_size, export.d_in, dtype, export.shards, export.scaling_factor
    )


def _checked_options(
    features: Features, layer: str, array: Any, dtype: str | None, hook_name: str | None, shard_contexts: int | None
) -> tuple[str, str, Rows | None]:
    """The column's dtype and hook name (their defaults: the store's dtype, the layer's name) and, in an
    image store, the layer's patch rows; refusing a token layer not stored as (D,) per token, a dtype arrow
    cannot hold and a column name that is taken."""
    patches = _patches(features, layer) if features.kind is Kind.IMAGES else None
    if patches is None and len(array.shape) != 2:
        raise ExportError(
            f"layer '{layer}' of {features.path} is stored as {list(array.shape[1:])} per token, not (D,)"
        )
    dtype = str(features.dtypes[layer]) if dtype is None else dtype  # bfloat16: float32
    if dtype not in DTYPES:
        raise ExportError(f"dtype '{dtype}': the cache holds {' or '.join(DTYPES)}")
    if shard_contexts is not None and shard_contexts < 1:
        raise ExportError(f"shard_contexts must be at least 1, got {shard_contexts}")
    hook_name = layer if hook_name is None else hook_name
    if not hook_name or hook_name == "token_ids":
        raise ExportError(f"hook name '{hook_name}' cannot name the activations' column (token_ids is taken)")
    return dtype, hook_name, patches


Contexts = Callable[[int, int], dict[str, np.ndarray]]  # contexts first:last -> the dataset's columns


@dataclass(frozen=True)
class _Export:
    """What is exported: ``contexts`` of ``context_size`` tokens (or patches) of ``layer`` (``d_in`` values
    each), as column ``hook_name`` of ``dtype``, ``per_shard`` contexts per arrow file, ``per_block`` at a
    time, read by ``read``; an image store's contexts have no ``token_ids``."""

    features: Features
    layer: str
    hook_name: str
    dtype: str
    context_size: int
    d_in: int
    contexts: int
    per_shard: int
    per_block: int
    scaling_factor: float | None
    read: Contexts
    patches: bool

    @property
    def shards(self) -> int:
        return -(-self.contexts // self.per_shard)

    def shard(self, index: int) -> range:
        """The contexts of shard ``index``."""
        return range(index * self.per_shard, min(self.contexts, (index + 1) * self.per_shard))

    def schema(self) -> Any:
        return saelens_features(self.hook_name, self.context_size, self.d_in, self.dtype, token_ids=not self.patches)

    def metadata(self) -> dict[str, Any]:
        """``extract_export.json``: where the rows came from, and what a SAELens config needs."""
        features = self.features
        images = {"patches": self.context_size, "images_left_out": features.num_samples - self.contexts}
        return {
            "format": "saelens activation cache (CacheActivationsRunner layout)",
            "store": str(features.path.resolve()),
            "layer": self.layer,
            "hook_name": self.hook_name,
            "context_size": self.context_size,
            "d_in": self.d_in,
            "dtype": self.dtype,
            "contexts": self.contexts,
            "training_tokens": self.contexts * self.context_size,
            "scaling_factor": self.scaling_factor,
            "pack": features.pack,
            "model": features.attrs.get("model"),
            **(images if self.patches else {}),
        }


def _plan(
    features: Features, layer: str, hook_name: str, dtype: str, shard_contexts: int | None, patches: Rows | None
) -> _Export:
    """The store's contexts of ``layer`` cut into shards and blocks: a packed store's contexts (which must
    be whole), or an image store's valid images."""
    if patches is None:
        context_size, d_in, contexts, read = _token_contexts(features, layer, hook_name, dtype)
    else:
        context_size, d_in, contexts, read = _image_contexts(features, layer, hook_name, dtype, patches)
    if contexts == 0:
        raise ExportError(f"{features.path} holds no context of {context_size} tokens")
    context_bytes = context_size * d_in * np.dtype(dtype).itemsize
    per_shard = shard_contexts or max(1, SHARD_BYTES // context_bytes)
    per_block = max(1, BLOCK_BYTES // context_bytes)
    scaling_factor = _scaling_factor(features, layer, dtype)
    return _Export(
        features, layer, hook_name, dtype, context_size, d_in, contexts, per_shard, per_block, scaling_factor,
        read, patches is not None,
    )  # fmt: skip


def _scaling_factor(features: Features, layer: str, dtype: str) -> float | None:
    """The layer's ``scaling_factor`` (None for a store written before statistics); float16 is refused
    for a layer whose statistics hold a value float16 would make inf."""
    try:
        stats: dict[str, Any] | None = features.stats(layer)
    except StoreDamagedError:
        raise
    except ExtractError:  # written before stores kept statistics
        return None
    assert stats is not None
    with np.errstate(over="ignore"):
        if dtype == "float16" and np.isinf(np.float16(stats["max_abs"])):
            raise ExportError(
                f"layer '{layer}' of {features.path} holds |x| up to {stats['max_abs']:.4g}, which float16 "
                "would make inf; export it as float32"
            )
    return float(stats["scaling_factor"])


def _write_cache(datasets: Any, staging: Path, export: _Export, bar: tqdm) -> None:
    """The whole cache into ``staging``: its shards, ``dataset_info.json`` and ``state.json``, and
    ``extract_export.json``."""
    schema, files = export.schema(), []
    for shard in range(export.shards):
        name = f"data-{shard:05d}-of-{export.shards:05d}.arrow"
        _write_shard(staging / name, schema, export.read, export.shard(shard), export.per_block, bar)
        files.append({"filename": name})
    _write_dataset_files(datasets, staging, schema, files, export.features, export.layer, export.hook_name)
    (staging / METADATA).write_text(json.dumps(export.metadata(), indent=2, default=str) + "\n")


def _patches(features: Features, layer: str) -> Rows:
    """An image store's ``layer`` as patch rows, or an ``ExportError`` saying why it cannot be."""
    shape = features.shapes[layer]
    if len(shape) == 1:
        raise ExportError(
            f"layer '{layer}' of the image store {features.path} is pooled, one {shape} row per image; SAELens's "
            "contexts are an image's patches: extract the layer with --pool none and export that store"
        )
    try:
        return layer_rows(features, layer)
    except ExtractError as e:
        raise ExportError(str(e)) from None


def _token_contexts(features: Features, layer: str, hook_name: str, dtype: str) -> tuple[int, int, int, Contexts]:
    """A packed store's contexts: (context_size, d_in, contexts, how to read some)."""
    array = features.array(layer)
    context_size, d_in, tokens = int(features.pack["context_length"]), int(array.shape[1]), int(array.shape[0])
    if tokens % context_size:
        raise ExportError(f"{features.path}: {tokens} tokens are not whole contexts of {context_size}; re-extract it")

    def read(first: int, last: int) -> dict[str, np.ndarray]:
        rows = slice(first * context_size, last * context_size)
        values = np.asarray(features.load(layer, rows, dtype=dtype))
        ids = features.text.load_token_ids(rows).astype(np.int32, copy=False)
        return {
            hook_name: values.reshape(last - first, context_size, -1),
            "token_ids": ids.reshape(last - first, context_size),
        }

    return context_size, d_in, tokens // context_size, read


def _image_contexts(
    features: Features, layer: str, hook_name: str, dtype: str, patches: Rows
) -> tuple[int, int, int, Contexts]:
    """An image store's contexts, one per valid image: (context_size, d_in, contexts, how to read some)."""
    images = np.flatnonzero(features.valid)

    def read(first: int, last: int) -> dict[str, np.ndarray]:
        values = np.asarray(features.load(layer, images[first:last], dtype=dtype))
        return {hook_name: patches.as_rows(values).reshape(last - first, patches.positions, patches.width)}

    return patches.positions, patches.width, len(images), read


def _write_shard(path: Path, schema: Any, read: Contexts, contexts: range, per_block: int, bar: tqdm) -> None:
    """One arrow file of the contexts ``contexts``, written a block of ``per_block`` contexts at a time."""
    from datasets.arrow_writer import ArrowWriter

    writer = ArrowWriter(features=schema, path=str(path))
    try:
        for first in range(contexts.start, contexts.stop, per_block):
            last = min(contexts.stop, first + per_block)
            columns = read(first, last)
            writer.write_batch(columns)
            del columns
            bar.update(last - first)
        writer.finalize()
    finally:
        writer.close()


def _write_dataset_files(
    datasets: Any, directory: Path, schema: Any, files: list[dict[str, str]], features: Features, layer: str, hook: str
) -> None:
    """``dataset_info.json`` and ``state.json`` as ``Dataset.save_to_disk`` writes them, with the
    fingerprint ``CacheActivationsRunner._consolidate_shards`` gives its consolidated shards: that of the
    dataset loaded back (which also checks that the shards load)."""
    from datasets.fingerprint import generate_fingerprint

    try:
        from datasets.utils.py_utils import asdict
    except ImportError:  # pragma: no cover - an older or newer layout of datasets
        from dataclasses import asdict
    info = datasets.DatasetInfo(
        description=f"extract: layer '{layer}' of {features.path} as SAELens's activation cache (column '{hook}')",
        features=schema,
    )
    info_dict = asdict(info)
    (directory / "dataset_info.json").write_text(
        json.dumps({key: info_dict[key] for key in sorted(info_dict)}, indent=2)
    )
    state: dict[str, Any] = {
        "_data_files": files,
        "_fingerprint": None,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (directory / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    loaded = datasets.Dataset.load_from_disk(str(directory))
    state["_fingerprint"] = generate_fingerprint(loaded)
    del loaded
    (directory / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))


def _replace(staging: Path, out: Path) -> None:
    """Move the finished ``staging`` to ``out``; an existing ``out`` (checked replaceable) is moved aside
    first and deleted only once the new one is in place."""
    if not out.exists():
        os.replace(staging, out)
        return
    aside = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(out, aside)
    try:
        os.replace(staging, out)
    except BaseException:
        os.replace(aside, out)
        raise
    shutil.rmtree(aside, ignore_errors=True)
