"""Fencing: a store refuses the writes of a job that lost its lock.

Rank 0 records its lock's token as the store's ``writer`` attribute before any chunk is written (at
creation, and on every resume or takeover), so ``--overwrite`` and a takeover start a new generation.
Every write of a job goes through ``FencedStore``, which reads the root ``zarr.json`` afresh and
refuses the write when the store's ``writer`` is not the job's token: a holder that was paused past the
stale age and comes back, after another job took the store, writes nothing into it. The check sits in
the store itself, right before each object is written, and not before a whole chunk is encoded: a pause
between a check and its write could otherwise land a chunk's worth of objects in the other job's store.
A check costs one read of a small object (benchmarks/RESULTS.md measures it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from zarr.abc.buffer import Buffer
from zarr.abc.store import Store
from zarr.buffer import default_buffer_prototype
from zarr.storage import WrapperStore

from ..errors import LockLostError
from .location import Location

ROOT_METADATA = "zarr.json"


def writer_of(metadata: bytes | None) -> str | None:
    """The ``writer`` recorded in the root metadata ``metadata``; None where there is none (a store from
    before fencing, a store being replaced, unreadable metadata)."""
    if metadata is None:
        return None
    try:
        writer = json.loads(metadata).get("attributes", {}).get("writer")
    except (ValueError, AttributeError):
        return None
    return writer if isinstance(writer, str) else None


def lost_lock(location: Location) -> LockLostError:
    """The error of a job that lost the lock of the store at ``location`` (a path, or a URL on object
    storage). The lock modules are loaded here, when it happens: only writers meet this, readers never
    load a lock."""
    from .locking import lost_lock as lost

    return lost(location)


class FencedStore(WrapperStore[Store]):
    """The store at ``location`` (``store``), writable only while its ``writer`` is ``token``."""

    def __init__(self, store: Store, *, token: str, location: Location) -> None:
        super().__init__(store)
        self.token, self.location = token, location

    def _with_store(self, store: Store) -> FencedStore:
        return type(self)(store, token=self.token, location=self.location)

    async def check(self) -> None:
        """Raise ``LockLostError`` unless the store's ``writer`` is our token."""
        metadata = await self._store.get(ROOT_METADATA, prototype=default_buffer_prototype())
        if writer_of(None if metadata is None else metadata.to_bytes()) != self.token:
            raise lost_lock(self.location)

    # zarr 3.1's WrapperStore does not pass these on: the base Store's would GET every object in full
    # to measure it (the job's summary would read back the whole store).
    async def getsize(self, key: str) -> int:
        return await self._store.getsize(key)

    async def getsize_prefix(self, prefix: str) -> int:
        return await self._store.getsize_prefix(prefix)

    async def set(self, key: str, value: Buffer) -> None:
        await self.check()
        await self._store.set(key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        await self.check()
        await self._store.set_if_not_exists(key, value)

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        await self.check()
        await self._store._set_many(values)

    async def delete(self, key: str) -> None:
        await self.check()
        await self._store.delete(key)

    async def delete_dir(self, prefix: str) -> None:
        await self.check()
        await self._store.delete_dir(prefix)
