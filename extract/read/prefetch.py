"""On object storage, every chunk object of a ``TokenStream`` window fetched at once, then read through zarr.

A window's chunks are read by the stream's few threads (2 by default), one zarr read a chunk: on object
storage that is at most 2 GETs in flight, each a round trip (tens of ms on S3) plus its transfer, so the
stream waits on latency. ``prefetch_window`` issues the GET of every object of the window, of every source,
at once, when the window is submitted; the threads then read the window as before, each chunk through
zarr, but from ``WindowObjects.array(array)``: the same array (its metadata and runtime configuration)
over a store that answers each prefetched key once, from its GET, waiting for it if it has not arrived,
and passes any other request to the array's own store. So the decode is zarr's own (the array's codec
pipeline: its compressor, its crc32c), an absent object is zarr's fill value (the checked read decides
whether that is damage), a checksum that fails is zarr's ``ValueError`` (the checked read names the
chunk), and an outage past the retries is obstore's error, all as for a read of the array itself.

The GETs are the array's store's own (zarr's ``ObjectStore.get``: obstore's ``get_async`` and
``bytes_async``, with the store's retries), run on an event loop of this module in a thread of its own,
so that submitting a window returns at once. Memory: the stream submits a window once the one before is
read, and each object is dropped once read, so at most one window of fetched objects is held.

Left to zarr's per-chunk read (the array itself): a local store (read from disk, ``direct.py``), sharding
(a shard is read by ranges of its index), zarr v2 metadata, and arrays chunked along more than their rows.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import zarr
from zarr.abc.store import ByteRequest, Store
from zarr.buffer import default_buffer_prototype
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import ObjectStore, StorePath, WrapperStore

Fetched = Future  # of a zarr Buffer, or None for an absent object


class _WindowStore(WrapperStore[Store]):
    """``store``, answering each key of ``objects`` once from its GET; anything else from ``store``."""

    def __init__(self, store: Store, objects: dict[str, Fetched]) -> None:
        super().__init__(store)
        self._objects = objects

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        # popped: the window holds an object until it is read, not after
        fetched = self._objects.pop(key, None) if byte_range is None else None
        if fetched is None:
            return await self._store.get(key, prototype, byte_range)
        buffer = await asyncio.wrap_future(fetched)
        if buffer is None or isinstance(buffer, prototype.buffer):
            return buffer
        return prototype.buffer.from_bytes(buffer.to_bytes())  # a read that wants another buffer class


@dataclass(frozen=True)
class WindowObjects:
    """One window's prefetched objects, as the arrays to read them through."""

    views: dict[int, tuple[zarr.Array, zarr.Array]] = field(default_factory=dict)  # id(array): (array, its view)

    def array(self, array: zarr.Array) -> zarr.Array:
        """``array`` reading this window's prefetched objects, or ``array`` itself where none were fetched."""
        found = self.views.get(id(array))
        return found[1] if found is not None and found[0] is array else array


NOT_PREFETCHED = WindowObjects()


def prefetchable(array: zarr.Array) -> bool:
    """Whether the objects of ``array`` are prefetched (see the module's docstring for what is not)."""
    return (
        isinstance(array.store, ObjectStore)
        and getattr(array.metadata, "zarr_format", None) == 3
        and array.shards is None
        and array.ndim >= 1
        and tuple(array.chunks[1:]) == tuple(array.shape[1:])
    )


def prefetch_window(arrays: Sequence[zarr.Array], rows: Iterable[tuple[int, int]]) -> WindowObjects:
    """Start the GET of every object holding rows ``[start, stop)`` of ``rows`` of each of ``arrays`` that is
    ``prefetchable``, all at once, and return at once: the window's reads go through ``.array(array)``."""
    spans = list(rows)
    views: dict[int, tuple[zarr.Array, zarr.Array]] = {}
    for array in arrays:
        if id(array) in views or not prefetchable(array):
            continue
        step = int(array.chunks[0])
        keys = {
            _object_key(array, index)
            for start, stop in spans
            for index in range(start // step, -(-min(stop, array.shape[0]) // step))
        }
        objects = {key: _fetch(array.store, key) for key in sorted(keys)}
        views[id(array)] = (array, _over(array, _WindowStore(array.store, objects)))
    return WindowObjects(views) if views else NOT_PREFETCHED


def _object_key(array: zarr.Array, index: int) -> str:
    """The store key of ``array``'s object ``index`` along its rows (one object across the other axes)."""
    return f"{array.path}/{array.metadata.encode_chunk_key((index, *[0] * (array.ndim - 1)))}"


def _over(array: zarr.Array, store: Store) -> zarr.Array:
    """``array`` over ``store``: its metadata and runtime configuration as they are, nothing read. zarr has
    no public call for this (``zarr.open_array`` reads the metadata again); ``AsyncArray(metadata,
    store_path, config)`` is its constructor, and builds the codec pipeline from the metadata."""
    return zarr.Array(zarr.AsyncArray(array.metadata, StorePath(store, array.path), array.config))


def _fetch(store: Store, key: str) -> Fetched:
    """Start the GET of ``key`` from ``store`` on this module's loop."""
    return asyncio.run_coroutine_threadsafe(store.get(key, prototype=default_buffer_prototype()), _loop())


_loop_lock = threading.Lock()
_running: tuple[int, asyncio.AbstractEventLoop] | None = None  # (the process it runs in, the loop)


def _loop() -> asyncio.AbstractEventLoop:
    """This process's loop for the GETs, running in a daemon thread. Keyed by process: a forked child has
    the parent's loop object but not its thread (obstore refuses a forked child anyway: ``check_not_forked``)."""
    global _running
    with _loop_lock:
        if _running is None or _running[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="extract-prefetch", daemon=True).start()
            _running = (os.getpid(), loop)
        return _running[1]
