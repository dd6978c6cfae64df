"""Creating and opening a store, on disk and on object storage (DESIGN.md, "The store's life cycle").

On disk a store is built beside its target and renamed into place; on object storage, where there is
no rename, its root metadata are written last (``remote.py``). Opening checks what it finds: a known
format version, every array there, shapes that agree with ``num_samples`` and the chunk size.
Metadata that disagree are an error, never believed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zarr

from ..errors import (
    ExtractError,
    InvalidRequestError,
    StoreBeingCreatedError,
    StoreDamagedError,
    StoreMismatchError,
    StoreNotFoundError,
)
from ..names import Kind
from . import latents, objects, remote
from .arrays import DIGESTS, METADATA, PACKED_ARRAYS, TEXT_ARRAYS, TOKEN_ARRAYS, row_arrays
from .fence import ROOT_METADATA, FencedStore
from .latents import row_arrays as latent_arrays
from .location import Location, open_store
from .paths import check_version, damaged_root, decoded_attrs, move_into_place, store_attrs
from .skeleton import Skeleton

if TYPE_CHECKING:  # the store opens itself through this module, which only checks it
    from .store import FeatureStore


def create(location: Location, skeleton: Skeleton, attrs: dict[str, Any], overwrite: bool) -> None:
    """Build ``skeleton`` at ``location`` (see ``FeatureStore.create``)."""
    if location.remote:
        _create_remote(location, skeleton, attrs, overwrite)
    else:
        assert location.path is not None
        _create_on_disk(location.path, skeleton, attrs, overwrite)


def _create_on_disk(path: Path, skeleton: Skeleton, attrs: dict[str, Any], overwrite: bool) -> None:
    """Build the store beside ``path`` and rename it into place; ``overwrite`` first moves the old
    store aside (one rename), then deletes it."""
    scratch = path.with_name(f".{path.name}.creating-{os.getpid()}")
    trash = path.with_name(f".{path.name}.trash-{os.getpid()}")
    try:
        skeleton.build(scratch, attrs)
        if overwrite and (store_attrs(path) is not None or damaged_root(path) is not None):
            os.rename(path, trash)
        move_into_place(scratch, path)
    except OSError as e:
        objects.settle()  # zarr's other writes of the skeleton, still queued: none may land after the removal
        shutil.rmtree(scratch, ignore_errors=True)
        raise ExtractError(
            f"--out {path}: cannot create the store ({e.strerror or e}); free space or choose another --out"
        ) from None
    shutil.rmtree(trash, ignore_errors=True)


def _create_remote(location: Location, skeleton: Skeleton, attrs: dict[str, Any], overwrite: bool) -> None:
    """On object storage, where there is no rename: the old store or a creation's debris is deleted
    (root metadata first), then the skeleton is written with its root metadata last."""
    url, store = str(location), open_store(location)
    found = remote.survey(store)
    if found.occupied and not found.ours:
        raise InvalidRequestError(
            f"--out {url} is a prefix of objects that are not an extract store; choose a new prefix"
        )
    if found.root is not None and not overwrite:
        raise StoreMismatchError(f"--out {url} already holds a store; pass --overwrite to replace it")
    if found.occupied:
        remote.delete_store(store)
    building = remote.RootLast(store)
    skeleton.build(building, attrs)
    building.commit()


def open_group(location: Location, mode: str, writer: str | None) -> tuple[zarr.Group, dict[str, Any]]:
    """The store's group and its attributes, of a known format version; fenced by ``writer`` when given
    (``fence.py``). Neither a store nor being created: ``StoreNotFoundError``, or ``ExtractError`` where
    something else is there."""
    if location.remote:
        return _open_remote(location, mode, writer)
    assert location.path is not None
    path = location.path
    attrs = store_attrs(path, damaged=True)
    if attrs is None:
        if not (path / ROOT_METADATA).exists():  # built beside the path, renamed into place when whole
            check_not_being_created(location)
        raise (ExtractError if path.exists() else StoreNotFoundError)(f"{path} is not an extract store")
    check_version(path, attrs)
    where: Any = path
    if writer is not None:
        where = FencedStore(zarr.storage.LocalStore(path, read_only=mode == "r"), token=writer, location=location)
    return zarr.open_group(where, mode=mode), attrs


def _open_remote(location: Location, mode: str, writer: str | None) -> tuple[zarr.Group, dict[str, Any]]:
    """A store on object storage, opened through zarr's ``ObjectStore`` (``location.py``)."""
    url = str(location)
    where: Any = open_store(location, read_only=mode == "r")
    data = objects.read(where, METADATA)
    attrs = None if data is None else decoded_attrs(data, f"{url}/{METADATA}", damaged=True)
    if attrs is None:
        if data is None:  # the root metadata are written last: a prefix without them may be a creation
            check_not_being_created(location)
        there = data is not None or bool(objects.children(where, ""))
        raise (ExtractError if there else StoreNotFoundError)(f"{url} is not an extract store")
    check_version(url, attrs)
    if writer is not None:
        where = FencedStore(where, token=writer, location=location)
    return zarr.open_group(where, mode=mode), attrs


def check_not_being_created(location: Location) -> None:
    """Raise ``StoreBeingCreatedError`` when a live job holds the lock of ``location``, where there is no
    store yet: the reader came while the job is creating it (or preparing to), not to a wrong path."""
    job = live_job(location)
    if job is None:
        return
    raise StoreBeingCreatedError(
        f"{location} is being created by a job ({job}); wait for the job, and read the store when it is done"
    )


def live_job(location: Location) -> str | None:
    """The live job holding the lock of ``location``, as messages name it (host, pid, since, and where
    its lock is); None when no live job holds it. The lock modules are loaded here only, for readers
    that found a store missing or unfinished."""
    from .locking import live_holder, lock_name

    holder, lock = live_holder(location), lock_name(location)
    if holder is None:
        return None
    job = "one that is starting"  # its claimer has not written its record yet
    if "pid" in holder:
        job = f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('started')}"
    return f"{job}; its lock is {lock}"


def validate(store: FeatureStore, attrs: dict[str, Any]) -> None:
    """Every array the attributes call for is there, with N rows in chunks of C (``_check_rows``)."""
    n, c = attrs.get("num_samples"), attrs.get("chunk_size")
    if not (type(n) is int and type(c) is int and n >= 1 and c >= 1):
        raise StoreDamagedError(f"{store.path}: num_samples {n!r} and chunk_size {c!r} must be positive integers")
    try:
        kind = Kind.of(attrs)
    except ValueError:
        known = ", ".join(Kind)
        raise StoreDamagedError(f"{store.path}: kind {attrs.get('kind')!r} is not one of {known}") from None
    expected = {f"features/{layer}": None for layer in attrs.get("layers", [])}
    expected.update(labels=None, valid=None)
    if kind.text:
        expected.update(dict.fromkeys(TEXT_ARRAYS))
    if kind is Kind.TOKENS:
        expected.update(dict.fromkeys(TOKEN_ARRAYS))
    packed = attrs.get("pack") is not None
    if packed:
        expected.update(dict.fromkeys(PACKED_ARRAYS))
    codes = latent_arrays(latents.layers_of(attrs))
    expected.update(dict.fromkeys(codes))
    optional = [name for name in ("keys", DIGESTS) if store.has(name)]  # read back, so checked too
    rows_of = set(row_arrays(kind, attrs.get("layers", []), packed=packed, latents=latents.layers_of(attrs)))
    per_chunk = {"done", DIGESTS}
    for name in [*expected, "done", *optional]:
        _check_rows(store, name, per_chunk, rows_of, n, c)
    for name in [name for name, _ in store.chunk_arrays()]:  # after the layers: their shapes decide these
        _check_rows(store, name, {name}, rows_of, n, c)


def _check_rows(store: FeatureStore, name: str, per_chunk: set[str], rows_of: set[str], n: int, c: int) -> None:
    """Array ``name`` exists and has N rows in chunks of C (K rows in chunks of 1 if in ``per_chunk``)."""
    try:
        array = store.array(name)
    except KeyError:
        raise StoreDamagedError(
            f"{store.path} has no array '{name}': it is damaged or not finished being created; "
            "rerun the job with --overwrite"
        ) from None
    if name not in rows_of and name not in per_chunk:
        return  # a text store's per-document or token-id arrays: their length is the corpus's
    rows, chunk = (-(-n // c), 1) if name in per_chunk else (n, c)
    if array.shape[:1] != (rows,) or array.chunks[:1] != (chunk,):
        raise StoreDamagedError(
            f"{store.path}: array '{name}' has shape {list(array.shape)} in chunks of {list(array.chunks)}, "
            f"but the metadata say num_samples {n} and chunk_size {c}; the store was edited or damaged"
        )
