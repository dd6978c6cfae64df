"""What a store on object storage needs instead of a rename: root metadata written last, and deletion
in the order that keeps a half-deleted store recognisable (DESIGN.md, "The store's life cycle").

On disk a store is built beside its target and renamed into place. An object store has no rename, so
a store there becomes valid when its root ``zarr.json`` is written, after every other object of the
skeleton (``RootLast``). A prefix without root metadata is then a creation in progress while the lock
is held, and debris once it is not: the next holder deletes it. It is recognised as a store's by
``features/zarr.json``, the first object a creation writes and the last a deletion removes; a prefix
of other objects is never deleted. ``--overwrite`` deletes the root metadata first, so that an
interrupted overwrite leaves debris, never a half store that opens as valid.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from zarr.abc.buffer import Buffer, BufferPrototype
from zarr.abc.store import ByteRequest, Store
from zarr.storage import WrapperStore

from . import objects

ROOT = "zarr.json"
RECOGNISED = "features/zarr.json"  # written first by a creation, deleted last by a deletion
DELETE_BATCH = 1000  # keys per bulk delete (S3's DeleteObjects takes at most 1000)


@dataclass(frozen=True)
class Prefix:
    """What a store's prefix holds: its root metadata (None where absent), whether it holds any
    object, and whether those are recognisably a store's (finished, being created or being deleted)."""

    root: bytes | None
    occupied: bool
    ours: bool


def survey(store: Store) -> Prefix:
    """Look at a prefix with a read or two and one delimited listing, not a walk of its objects."""
    root = objects.read(store, ROOT)
    if root is not None:
        return Prefix(root, True, objects.read(store, RECOGNISED) is not None)
    occupied = bool(objects.children(store, ""))
    return Prefix(None, occupied, occupied and objects.read(store, RECOGNISED) is not None)


def delete_store(store: Store) -> None:
    """Delete every object of the store at ``store``: its root metadata first (from then on it is
    debris, not a store), ``RECOGNISED`` last (until then the debris is recognisably a store's)."""
    keys = objects.listed(store, "")
    _delete(store, [ROOT] if ROOT in keys else [])
    _delete(store, sorted(keys - {ROOT, RECOGNISED}))
    _delete(store, [RECOGNISED] if RECOGNISED in keys else [])


def _delete(store: Store, keys: list[str]) -> None:
    inner = getattr(store, "store", None)  # zarr's ObjectStore: obstore's bulk delete (1000 keys a request)
    if inner is None or not keys:
        objects.delete(store, keys)
        return
    import obstore

    async def remove() -> None:
        batches = [keys[i : i + DELETE_BATCH] for i in range(0, len(keys), DELETE_BATCH)]
        await asyncio.gather(*(obstore.delete_async(inner, batch) for batch in batches))

    objects.run(remove())


class RootLast(WrapperStore[Store]):
    """``store``, with writes of the root metadata held back until ``commit()``: a skeleton built through
    it becomes a store only once every other object is written. Reads of the root see what was held."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.held: Buffer | None = None

    def _with_store(self, store: Store) -> RootLast:
        return type(self)(store)

    async def set(self, key: str, value: Buffer) -> None:
        if key == ROOT:
            self.held = value
            return
        await self._store.set(key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if key == ROOT:  # zarr makes each new node's parent groups, the root among them, "if absent"
            self.held = self.held or value
            return
        await self._store.set_if_not_exists(key, value)

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        if key == ROOT and self.held is not None and byte_range is None:
            return self.held
        return await self._store.get(key, prototype, byte_range)

    async def exists(self, key: str) -> bool:
        return (key == ROOT and self.held is not None) or await self._store.exists(key)

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        for key, value in values:
            await self.set(key, value)

    def commit(self) -> None:
        """Write the held root metadata: the store is valid from here on."""
        assert self.held is not None, "a skeleton writes its root metadata"
        objects.write(self._store, ROOT, self.held.to_bytes())
