"""Reads that name damage: a read of a store's chunks or of an array written whole at its creation
either returns what was written, or fails with the chunk or object that is missing or fails its
checksum and the fix (``verify --repair``, then the job's command), never with NaN rows or a codec's
trace. ``Features`` reads through one of these, and so do its text view and ``TokenStream``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import cached_property
from pathlib import Path
from typing import TypeVar

import numpy as np
import zarr

from ..errors import ExtractError, StoreDamagedError
from ..store import objects
from ..store.arrays import chunk_key
from ..store.integrity import decodes
from ..store.location import from_object_storage, storage_error
from ..store.store import FeatureStore
from .placed import UNREADABLE, Misplaced, placed

T = TypeVar("T")

NOT_RECORDED = -2  # ``CheckedReads.recorded`` of a chunk not done: nothing to compare its objects with

# A chunk of a complete store whose done flag is False: every chunk was marked done before the status said
# complete, so the flag's object was lost or torn since (``verify`` says the same, and --repair clears it).
NOT_DONE = "is not marked done in a complete store (its done flag was lost or fails its check)"


def first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def _object_rows(array: zarr.Array, chunk: int) -> tuple[int, int]:
    """The rows [start, stop) of a 1-D ``array``'s object ``chunk``."""
    start = chunk * array.chunks[0]
    return start, min(start + array.chunks[0], array.shape[0])


class CheckedReads:
    """The checked reads of ``store`` (named ``path`` in messages; ``complete``: its status says so)."""

    def __init__(self, store: FeatureStore, path: Path | str, complete: bool) -> None:
        self.store, self.path, self.complete = store, path, complete
        self.plan = store.plan
        # per array written whole at creation: whether all its objects are stored (one listing, at its first read)
        self._whole_objects: dict[str, bool] = {}

    @cached_property
    def done(self) -> np.ndarray:
        """(K,) bool: the chunks marked done, read once."""
        return self.store.done_flags()

    @cached_property
    def lost(self) -> dict[int, list[str]]:
        """Done chunks whose object is absent, per array: found once, at the first read."""
        return self.store.integrity.missing_objects(np.flatnonzero(self.done).tolist())

    @cached_property
    def recorded(self) -> tuple[dict[str, int], np.ndarray] | None:
        """The digests the store recorded for its done chunks: ({array: column}, (K, A) int64, -2 for a chunk
        not done, nothing recorded yet; ``UNREADABLE`` for a done chunk whose digests row is missing or fails
        its check), read once; None for a store written before digests."""
        rows = self.store.integrity.digests_array()
        if rows is None:
            return None
        done = self.done  # first: a digests row is written before its done flag, never after
        columns = {str(name): i for i, name in enumerate(rows.attrs["arrays"])}
        table = np.full((len(done), len(columns)), NOT_RECORDED, dtype=np.int64)
        try:
            values = np.asarray(rows[:], dtype=np.int64)
            readable = np.ones(len(done), dtype=bool)
        except ValueError:  # a row that fails its checksum: read the others one by one
            values = np.zeros((len(done), len(columns)), dtype=np.int64)
            readable = np.zeros(len(done), dtype=bool)
            for k in np.flatnonzero(done):
                try:
                    values[k], readable[k] = rows[int(k)], True
                except ValueError:
                    pass
        # an absent row reads as its fill value, 0s: every object's crc32c 0 is a 1 in 2^32A chance
        readable &= values.any(axis=1)
        table[done] = np.where(readable[done, None], values[done], UNREADABLE)
        return columns, table

    def follow(self, chunks: list[int]) -> None:
        """Chunks seen done since the store was opened (a job still writes it): read as done, their lost
        objects found (one listing per array) and their digests read, as for the chunks done at the open."""
        done, lost, recorded = self.done, self.lost, self.recorded  # as of the open, if not read yet
        done[chunks] = True
        for k, names in self.store.integrity.missing_objects(chunks).items():
            lost[k] = names
        rows = self.store.integrity.digests_array()
        if recorded is None or rows is None:
            return
        for k in chunks:  # a digests row is written before its chunk's done flag
            try:
                row = np.asarray(rows[k], dtype=np.int64)
            except ValueError:
                row = np.zeros(len(recorded[0]), dtype=np.int64)
            recorded[1][k] = row if row.any() else UNREADABLE

    def expected(self, name: str, chunk: int) -> int | None:
        """The digest recorded for chunk ``chunk``'s object in array ``name``; None where there is none to
        compare with (no digests, an array they do not cover, a chunk not done)."""
        recorded = self.recorded
        if recorded is None or name not in recorded[0]:
            return None
        value = int(recorded[1][chunk, recorded[0][name]])
        return None if value == NOT_RECORDED else value

    def placed(self, name: str, array: zarr.Array) -> zarr.Array:
        """``array`` (array ``name``'s, or a view of it) reading each chunk object only if it is the one the
        store recorded for that chunk (``placed.py``); ``array`` itself where nothing was recorded."""
        recorded = self.recorded
        if recorded is None or name not in recorded[0]:
            return array
        return placed(array, lambda chunk: self.expected(name, chunk))

    def checked(self, name: str, what: str, chunks: Iterable[int], read: Callable[[], T]) -> T:
        """``read()``, unless one of ``chunks`` of array ``name`` is damaged: a done chunk whose object is
        missing or fails its checksum, or, in a complete store, a chunk not marked done (every chunk was,
        so its flag was lost or torn since, and its objects may have gone with it: they would read as
        NaN). Then an error naming ``what`` and the chunk, instead of NaN rows or a codec trace."""
        chunks = list(chunks)
        try:
            for k in chunks:
                if not self.done[k]:
                    if self.complete:
                        raise self.damaged(what, k, NOT_DONE)
                elif name in self.lost.get(k, ()):
                    raise self.damaged(what, k, "is missing")
            return read()
        except ExtractError:
            raise
        except Misplaced as e:  # a whole object, in another chunk's place
            raise self.damaged(what, e.chunk, e.problem) from None
        except Exception as e:  # noqa: BLE001 - a codec's error on a damaged object: name the chunk
            if from_object_storage(e):  # an outage past the retries: not damage
                raise storage_error(str(self.path), e) from None
            array = self.store.array(name)
            bad = next((k for k in chunks if not decodes(array, *self.plan.bounds(k))), None)
            if bad is None:
                raise
            raise self.damaged(what, bad, f"fails its check ({first_line(e)})") from None

    def chunk_rows(self, name: str, what: str) -> tuple[list[int], np.ndarray]:
        """The rows of ``name``, an array of one row per chunk (``stats/...``), of every done chunk: (the done
        chunks, their rows), unless one of them is missing or fails its check (or, in a complete store, a
        chunk is not marked done): rows merged over fewer chunks would look whole."""
        if self.complete and not self.done.all():
            raise self.damaged(what, int(np.argmin(self.done)), NOT_DONE)
        done = np.flatnonzero(self.done).tolist()
        if lost := sorted(set(done) - self.store.integrity.stored_chunks(name, done)):  # one listing of this array
            raise self.damaged(what, lost[0], "are missing")
        rows = self.store.array(name)
        try:
            return done, rows.get_orthogonal_selection((np.asarray(done, dtype=np.int64), slice(None)))
        except Exception as e:  # noqa: BLE001 - a codec's error on a damaged object: name the chunk
            bad = next((k for k in done if not decodes(rows, k, k + 1)), None)
            if bad is None:
                raise
            raise self.damaged(what, bad, f"fail their check ({first_line(e)})") from None

    def whole(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """Rows ``rows`` of ``name``, an array written whole when the store was created (a text store's
        ``offsets``; a token store's ``labels``, ``valid`` and ``keys``), unless one of its objects fails its checksum or is missing: every object is
        stored (write_empty_chunks), so an absent one was lost and would read as the fill value."""
        array = self.store.array(name)
        try:
            values = np.asarray(array[rows])
        except Exception as e:  # noqa: BLE001 - a codec's error on a damaged object: name the object
            if from_object_storage(e):  # an outage past the retries: not damage
                raise storage_error(str(self.path), e) from None
            bad = next((k for k in range(array.nchunks) if not decodes(array, *_object_rows(array, k))), None)
            if bad is None:
                raise
            raise self._unrepairable(array, bad, f"fails its check ({first_line(e)})") from None
        if name not in self._whole_objects:  # zarr counts the stored objects: one listing per array
            self._whole_objects[name] = array.nchunks_initialized == array.nchunks
        if not self._whole_objects[name]:
            raise self._unrepairable(array, self._absent_object(array), "is missing")
        return values

    def damaged(self, what: str, chunk: int, problem: str) -> StoreDamagedError:
        """The error of chunk ``chunk`` of ``what`` (``problem``: missing, failing its check...)."""
        start, stop = self.plan.bounds(chunk)
        return StoreDamagedError(
            f"{self.path}: {what}, chunk {chunk} (samples {start}-{stop - 1}) {problem}; run "
            f"`python -m extract.verify {self.path} --repair`, then the job's command again to recompute it"
        )

    def _absent_object(self, array: zarr.Array) -> int:
        """The first of ``array``'s objects that is not stored (one listing; only once one is known lost)."""
        if array.nchunks == 1:
            return 0
        stored = objects.listed(self.store.group.store, f"{array.path}/")
        return next(k for k in range(array.nchunks) if chunk_key(array, k) not in stored)

    def _unrepairable(self, array: zarr.Array, chunk: int, problem: str) -> StoreDamagedError:
        # written once, at the store's creation: verify names it (by the digests recorded then), and the
        # job's command writes it again from the data
        start, stop = _object_rows(array, chunk)
        return StoreDamagedError(
            f"{self.path}: '{array.path}', object {chunk_key(array, chunk)} (rows {start}-{stop - 1}) "
            f"{problem}; run `python -m extract.verify {self.path} --repair`, then the job's command again to "
            "write it again from the data"
        )
