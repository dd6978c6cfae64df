"""A store's objects through zarr's store API (list, size, get, delete), called from synchronous code.

zarr 3.1's ``Store`` methods are coroutines, and zarr's own bridge from its synchronous ``Array`` and
``Group`` to them (its internal ``sync`` module) is private; 3.1.6 has synchronous ``get``/``set``/``delete``
on the local and memory stores only, and no synchronous ``exists`` or ``list_prefix`` at all. So each
call here runs the store's coroutine to completion on an event loop of this module's, in a thread of
its own: that also works where the caller's thread already runs a loop (a notebook), where
``asyncio.run`` alone would refuse. The loop and its thread live as long as the process: starting a
thread and a loop for every call cost ~1.5 ms of CPU, paid per chunk written (the digests' read).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from zarr.abc.store import Store, SuffixByteRequest
from zarr.buffer import default_buffer_prototype

T = TypeVar("T")


_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_starting = threading.Lock()


def _forget_loop() -> None:
    """In a forked child (a DataLoader worker) the loop's thread does not exist: start another if needed."""
    global _loop, _loop_thread, _starting
    _loop, _loop_thread, _starting = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget_loop)


def _the_loop() -> asyncio.AbstractEventLoop:
    global _loop, _loop_thread
    with _starting:
        if _loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="extract-store", daemon=True)
            thread.start()
            _loop, _loop_thread = loop, thread
        return _loop


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a store's ``coroutine`` to completion from synchronous code (see above)."""
    loop = _the_loop()
    if threading.current_thread() is _loop_thread:  # a coroutine on the loop waiting for the loop: a deadlock
        coroutine.close()
        raise RuntimeError("objects.run called from its own event loop")
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result()


def listed(store: Store, prefix: str) -> set[str]:
    """The keys under ``prefix``: one listing (one LIST request on object storage), not one per key."""

    async def collect() -> set[str]:
        return {key async for key in store.list_prefix(prefix)}

    return run(collect())


def children(store: Store, prefix: str) -> set[str]:
    """The names one level below ``prefix`` (one delimited LIST on object storage; no walk on disk)."""

    async def collect() -> set[str]:
        return {name async for name in store.list_dir(prefix)}

    return run(collect())


def size(store: Store, prefix: str) -> int:
    """The bytes of every object under ``prefix``."""
    return run(store.getsize_prefix(prefix))


def read(store: Store, key: str) -> bytes | None:
    """The bytes of object ``key``, or None where there is none."""

    async def get() -> bytes | None:
        buffer = await store.get(key, prototype=default_buffer_prototype())
        return None if buffer is None else buffer.to_bytes()

    return run(get())


async def tails(store: Store, keys: Iterable[str], size: int) -> list[bytes | None]:
    """``suffixes``, awaited on the caller's loop (a coroutine that also writes: ``FeatureStore.write_chunk``)."""

    async def tail(key: str) -> bytes | None:
        try:
            buffer = await store.get(key, prototype=default_buffer_prototype(), byte_range=SuffixByteRequest(size))
        except OSError:  # an object shorter than ``size`` (seeking before its start)
            return None
        data = None if buffer is None else buffer.to_bytes()
        return data if data is not None and len(data) == size else None

    return list(await asyncio.gather(*(tail(key) for key in keys)))


def suffixes(store: Store, keys: Iterable[str], size: int) -> list[bytes | None]:
    """The last ``size`` bytes of each object ``keys``, fetched concurrently (one ranged GET each on
    object storage); None where an object is absent, shorter, or cannot be read."""
    return run(tails(store, keys, size))


async def all_of(coroutines: Iterable[Coroutine[Any, Any, Any]]) -> None:
    """Await ``coroutines`` concurrently, every one to its end, then raise the first error if any: a write
    that failed (a full disk) leaves none of the others still writing once the caller has the error."""
    results = await asyncio.gather(*coroutines, return_exceptions=True)
    if errors := [r for r in results if isinstance(r, BaseException)]:
        raise errors[0]


def write(store: Store, key: str, data: bytes) -> None:
    """Replace object ``key`` with ``data`` (one PUT)."""
    run(store.set(key, default_buffer_prototype().buffer.from_bytes(data)))


def delete(store: Store, keys: Iterable[str]) -> None:
    """Delete the objects ``keys`` (an absent one is fine)."""

    async def remove() -> None:
        await asyncio.gather(*(store.delete(key) for key in keys))

    run(remove())


def settle() -> None:
    """Wait until zarr's event loop has no task left, and take the errors of those that failed.

    zarr gathers an array's writes with ``asyncio.gather``, which does not cancel the others when one
    fails (a full disk): they go on in zarr's loop thread after the error has reached the caller, so
    they could write into a directory the caller is removing, and at exit asyncio prints "Task was
    destroyed but it is pending" and "exception was never retrieved" for each. Waiting, rather than
    cancelling, is what stops their writes: a write already handed to a thread cannot be cancelled.
    zarr's loop is reached through its ``sync``, the one bridge zarr itself uses."""
    from zarr.core.sync import sync

    async def drain() -> None:
        me = asyncio.current_task()
        while rest := [task for task in asyncio.all_tasks() if task is not me]:
            await asyncio.gather(*rest, return_exceptions=True)

    sync(drain())
