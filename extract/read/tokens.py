"""A torch ``IterableDataset`` that streams a token store's rows in shuffled batches for training on
activations (an SAE, a probe, a transcoder, a crosscoder): whole chunks read in windows by background
threads, rows shuffled across each window, every kept token exactly once per epoch over all ranks and
DataLoader workers. Its rows may be several layers of one store, the same rows of several stores built
from the same tokens, or the patches of an image store's per-position layers (``sources.py``)."""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import ExcludeRuleError, InvalidRequestError
from ..names import Kind
from ..store import dtypes as storage
from ..store.chunks import Plan
from ..store.location import Location, check_not_forked, locate
from .dataset import _rank_and_world_size
from .direct import DirectChunks, direct_chunks
from .features import Features, _read, follow_done, open_features
from .latents import LATENTS, codes_of, csr
from .prefetch import NOT_PREFETCHED, WindowObjects, prefetch_window
from .sources import Rows, check_aligned, layer_rows

Key = str | tuple[int, str]  # a layer's name; with a list of stores, (the store's place in it, the layer)
Batch = torch.Tensor | dict[Key, torch.Tensor]

# high_norm's median is taken over the rows of every chunk of a store of at most this many chunks, else of
# this many chunks drawn with np.random.default_rng(0) (the same on every rank, worker and epoch)
NORM_SAMPLE_CHUNKS = 32

RULE_FORMS = "'special', 'first:K' (K a positive int) or 'high_norm:M' (M a positive number)"


@dataclass(frozen=True)
class _Rules:
    special: bool = False
    first: int = 0  # drop positions < first of each document (context), or of each image's patches
    high_norm: float | None = None  # drop rows whose norm exceeds high_norm x the median norm


def _parse_rules(exclude: str | Sequence[str]) -> _Rules:
    rules = [exclude] if isinstance(exclude, str) else list(exclude)
    special, first, high_norm = False, 0, None
    for rule in rules:
        name, _, value = rule.partition(":") if isinstance(rule, str) else ("", "", "")
        try:
            if name == "special" and not value:
                special = True
                continue
            if name == "first" and int(value) > 0:
                first = max(first, int(value))
                continue
            if name == "high_norm" and float(value) > 0 and np.isfinite(float(value)):
                high_norm = float(value) if high_norm is None else min(high_norm, float(value))
                continue
        except ValueError:
            pass
        raise ExcludeRuleError(f"exclude rule {rule!r} is not one of {RULE_FORMS}")
    return _Rules(special, first, high_norm)


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise InvalidRequestError(
            f"dtype {dtype!r} is not a torch floating dtype (use float32, float16, bfloat16, float64)"
        )
    return value


def _layers_per_store(layers: str | Sequence[str] | Sequence[Sequence[str]], stores: int) -> list[list[str]]:
    """``layers`` for each store: the same name or names for every store, or one list per store."""
    if isinstance(layers, str):
        return [[layers]] * stores
    given = list(layers)
    if given and all(not isinstance(names, str) for names in given):
        if len(given) != stores:
            raise ValueError(f"layers: {len(given)} lists of layers for {stores} stores; give one list per store")
        return [[names] if isinstance(names, str) else list(names) for names in given]
    return [given] * stores


@dataclass(frozen=True)
class _Source:
    """One layer of one store: where its rows are read from, and its key in a batch dict."""

    store: int  # the store's place in the stream's list
    layer: str
    rows: Rows
    key: Key
    d_sae: int | None = None  # SAE codes (``latents/<layer>``): their rows are (k indices, k float16 bits) int32
    stored: torch.dtype | None = None  # a dense layer's values as stored (bfloat16: its bits' view)

    @property
    def codes(self) -> bool:
        return self.d_sae is not None


@dataclass
class _Buffers:
    """What a pass reads into, kept for the next epoch's: two windows of ``dtype`` rows (one tensor per
    source, or one (rows, sources, D) tensor when stacked), and one stored-dtype chunk per reading thread
    for the chunks that are converted (taken from ``scratch`` by a task, put back when it is done)."""

    windows: list[list[torch.Tensor]]
    scratch: queue.SimpleQueue

    @classmethod
    def make(cls, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], threads: int) -> _Buffers:
        scratch: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(max(1, threads)):
            scratch.put({})  # source -> its chunk, made at first use
        windows = [[_alloc(shape, dtype) for shape, dtype in zip(shapes, dtypes, strict=True)] for _ in range(2)]
        return cls(windows, scratch)

    def fits(self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> bool:
        return [(tuple(t.shape), t.dtype) for t in self.windows[0]] == list(zip(shapes, dtypes, strict=True))


@dataclass
class _Window:
    """A window read: the rows kept (window-local) and every row's global index."""

    keep: np.ndarray  # (kept,) int64, positions in the window's buffers
    rows: np.ndarray  # (window rows,) int64, global rows (sample x positions + position)


class TokenStream(IterableDataset):
    """Shuffled batches of a token store's rows: ``(batch, D)`` tensors of ``dtype`` for one layer
    (``layers`` a str), a ``{layer: tensor}`` dict for several (a list); with ``return_index=True``
    ``(values, rows)``, ``rows`` the (batch,) int64 global token rows (``Features.text.documents_of`` and
    ``token_positions`` say where they come from). Use it as ``DataLoader(stream, batch_size=None,
    num_workers=k)``: it batches itself.

    Several stores (``store`` a list) built from the same tokens, say two models with one tokenizer
    (a crosscoder) or two runs, are read side by side: row i of every source in a batch is the same
    token. They are refused in one line naming the first difference unless their tokenizer, packing,
    token count, ``--chunk-size``, document offsets and token rows agree, proven by the digests the
    stores recorded (``sources.check_aligned``). A batch is then a dict keyed by ``(i, layer)``, ``i``
    the store's place in the list; ``layers`` names the layers of every store, or is one list per
    store. ``stack=True`` gives one ``(batch, sources, D)`` tensor instead (sources in the order store
    by store, then layer by layer; their D must agree), for one store's layers too.

    A layer's SAE codes (a store extracted with ``--sae LAYER=PATH``) stream as ``"latents/<layer>"``: its
    batch is a (batch, d_sae) ``torch.sparse_csr_tensor`` of ``dtype`` (columns sorted within a row; the
    stored k codes of each token, ``extract.read.latents``), the rows of the same tokens as the dense
    layers beside it in a dict: what a probe or transcoder trained on codes takes (``crow_indices``,
    ``col_indices`` and ``values`` give the (indices, values) pairs). ``high_norm`` is of dense rows only;
    codes cannot be stacked.

    An image store's per-position layers stream as one row per (image, patch): a ViT block kept whole
    (``--pool none``: (T, D) per image, CLS and register tokens first), or a conv map (NCHW / NHWC as H x W
    rows of C, patch ``h * W + w``), as the store's ``layouts`` say; every layer read must have as many
    patches. ``return_index=True`` then gives a (batch, 2) int64 tensor of (image, patch) pairs, and
    rows of images that could not be decoded (``valid`` False) are never yielded.

    An epoch yields every row that ``exclude`` keeps exactly once, over all ranks and workers. The
    epoch's chunk order is a permutation seeded by ``(seed, epoch)``, the same on every rank and for
    every source; rank r takes every ``world_size``-th chunk of it (as ``ChunkShuffleSampler`` does;
    ``rank`` and ``world_size`` default to those of an initialized process group), and DataLoader
    worker w of W every W-th of the rank's chunks. Each worker reads its chunks ``window`` at a time,
    permutes the window's kept rows and emits full batches, carrying the rest into the next window; its
    last partial batch is emitted unless ``drop_last``, so with W workers a rank may end with up to W
    short batches. Ranks may get a chunk more or less than others: stop all at the shortest or use
    DDP's ``join()``. ``set_epoch(e)`` reshuffles deterministically; call it before iterating (a
    DataLoader with ``persistent_workers=True`` would keep the workers' old epoch).

    ``threads`` background threads read and decode the next window (whole chunks, each object's checksum
    checked, and each object's checksum compared with the digest the store recorded for its chunk, so an
    object in another chunk's place is refused: an uncompressed layer on local disk read straight into the
    window, ``direct.py``, any other through zarr; on object storage, from GETs of all the window's objects
    at once, ``prefetch.py``) while the consumer takes batches from this one; ``threads=0`` reads in the
    consumer. A window holds the rows as stored; each batch is converted to ``dtype`` as it is gathered (a
    stacked window is converted as it is read). Memory per worker is two windows of stored rows
    (``2 x window x chunk_size x D`` per source, times the patches per image; of ``dtype`` when stacked)
    plus a stored chunk per thread and a batch per source (and on object storage the next window's objects,
    each until it is read). zarr's decode releases the GIL, so ``num_workers=0`` already uses several
    cores; DataLoader workers add a copy of every batch through shared memory, which on a small machine
    costs more than the decode (``benchmarks/token_stream.py``).

    ``exclude`` rules (a str or a sequence of them) drop rows:

    - ``"special"``: the tokenizer's special tokens (``Features.text.special``: BOS, EOS, CLS, SEP, and the
      BOS and separators packing inserted); token stores only;
    - ``"first:K"``: positions 0..K-1 of every document (every context of a packed store), the
      attention sinks; of an image, its first K tokens (``first:1`` the CLS token, ``first:5`` CLS and
      four registers);
    - ``"high_norm:M"``: rows whose L2 norm (computed in float32 from the stored values) exceeds M x
      the source's median norm; with several sources a row is dropped if it does so in any of them.
      The median (``median_norms``, per source, keyed as a batch dict is) is of the rows the other
      rules keep, over every chunk of a store of at most ``NORM_SAMPLE_CHUNKS`` (32) chunks, else over
      32 chunks drawn with ``np.random.default_rng(0)``: computed once, when the stream is made, the
      same for every rank, worker and epoch.

    The stores are opened once per process that iterates: only the paths are pickled to DataLoader
    workers, never an open zarr handle. They must be complete, unless ``follow=True``: then the first
    pass follows a store a job is still writing (on disk or object storage, from its creation on): it
    reads each chunk once it is marked done (every ``poll`` seconds it lists ``done``), ``window`` done
    chunks at a time in the order they were done, their rows shuffled within the window, and ends when the
    store says complete. Each row comes exactly once in that pass, over all ranks and workers (chunk k is
    rank ``k % world_size``'s). A killed job leaves the pass waiting; its rerun (resume) is followed
    through. Later passes in the same process are shuffled epochs over the complete store (a DataLoader
    without ``persistent_workers`` pickles the stream anew: set ``follow = False`` after the first pass).
    ``high_norm`` needs the finished store, and is refused with ``follow``.
    """

    def __init__(
        self,
        store: str | Path | Sequence[str | Path],
        layers: str | Sequence[str] | Sequence[Sequence[str]],
        batch_size: int,
        *,
        window: int = 8,
        exclude: str | Sequence[str] = (),
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        dtype: str | torch.dtype = "float32",
        drop_last: bool = False,
        threads: int = 2,
        return_index: bool = False,
        stack: bool = False,
        follow: bool = False,
        poll: float = 1.0,
    ) -> None:
        if batch_size < 1 or window < 1 or threads < 0:
            raise ValueError(
                f"batch_size and window must be positive, threads 0 or more; got {batch_size}, {window}, {threads}"
            )
        several = not isinstance(store, (str, Path))
        self.path = store
        given: list[str | Path] = list(store) if several else [store]  # type: ignore[list-item]
        # parsed once: every process that iterates opens them
        self.locations: list[Location] = [locate(path) for path in given]
        if not self.locations:
            raise ValueError("store: name a store, or a list of stores")
        per_store = _layers_per_store(layers, len(self.locations))
        if not all(per_store):
            raise ValueError("layers: name at least one layer")
        self.layers = per_store[0]
        self.stack, self.single = stack, not several and isinstance(layers, str) and not stack
        self.batch_size, self.window, self.threads = batch_size, window, threads
        self.seed, self.epoch, self.drop_last, self.return_index = seed, 0, drop_last, return_index
        self.dtype = _torch_dtype(dtype)
        self.rules = _parse_rules(exclude)
        self.rank, self.world_size = _rank_and_world_size(rank, world_size)
        self.follow, self.poll = follow, poll
        self._followed = self._following = False  # follow's first pass: done in this process / under way
        if follow and self.rules.high_norm is not None:
            raise ExcludeRuleError(
                "exclude rule 'high_norm' takes a median over the store's chunks, which a store being written "
                "does not have yet: follow=True streams without it"
            )
        opened = [open_features(location, allow_partial=follow) for location in self.locations]
        if several:
            check_aligned(opened)
        self.sources = [
            _source(features, i, layer, (i, layer) if several else layer)
            for i, (features, names) in enumerate(zip(opened, per_store, strict=True))
            for layer in names
        ]
        self._check_sources(opened[0])
        first = opened[0]
        self.images = first.kind is Kind.IMAGES
        self.positions = self.sources[0].rows.positions  # rows per stored sample: 1 for a token store
        self.num_samples, self.chunk_size = first.num_samples, first.chunk_size
        self.num_chunks = first.num_chunks
        self.num_rows = self.num_tokens = self.num_samples * self.positions
        self.median_norms: dict[Key, float] | None = None
        self._features: list[Features] | None = opened
        self._spare: list[_Buffers] = []  # the last pass's buffers, for the next one in this process
        self._direct: dict[tuple[str, str], DirectChunks | None] = {}  # (store path, layer): its reader
        self._gathered: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}  # ``_take``'s batches
        if self.rules.high_norm is not None:
            self.median_norms = self._median_norms(opened)

    def _check_sources(self, first: Features) -> None:
        if first.kind is Kind.IMAGES and self.rules.special:
            raise ExcludeRuleError(
                f"exclude rule 'special': {first.path} is an image store, which has no special tokens; "
                "use 'first:K' to drop each image's CLS and register tokens"
            )
        keys = [source.key for source in self.sources]
        if len(set(keys)) != len(keys):
            raise ValueError(f"layers: a layer is named twice ({keys})")
        positions = {source.key: source.rows.positions for source in self.sources}
        if len(set(positions.values())) > 1:
            raise InvalidRequestError(
                f"{first.path}: the layers have different numbers of patches per image ({positions}); "
                "stream layers of one patch grid together"
            )
        if self.stack and any(source.codes for source in self.sources):
            raise InvalidRequestError(
                "stack=True stacks dense layers; SAE codes (latents/...) stream as their own sparse batch"
            )
        widths = {source.key: source.rows.width for source in self.sources}
        if self.stack and len(set(widths.values())) > 1:
            raise InvalidRequestError(
                f"stack=True needs one width D for every source, but they have {widths}; use stack=False"
            )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_features=None, _spare=[], _direct={}, _gathered={}, _following=False)
        return state

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _open(self) -> list[Features]:
        for location in self.locations:
            check_not_forked(location)
        if self._features is None:
            following = self.follow and not self._followed
            self._features = [open_features(location, allow_partial=following) for location in self.locations]
        return self._features

    def _bounds(self, chunk: int) -> tuple[int, int]:
        """The samples (tokens, or images) of chunk ``chunk``."""
        return Plan(self.num_samples, self.chunk_size).bounds(int(chunk))

    def chunks(self, worker: int = 0, num_workers: int = 1) -> np.ndarray:
        """The chunks this rank's worker ``worker`` of ``num_workers`` reads this epoch, in reading order."""
        order = np.random.default_rng((self.seed, self.epoch)).permutation(self.num_chunks)
        return order[self.rank :: self.world_size][worker::num_workers]

    def _window_arrays(self, opened: list[Features]) -> list:
        """The arrays a window reads chunk by chunk: every dense source's, and ``special`` when excluded."""
        arrays = [opened[source.store].array(source.layer) for source in self.sources if not source.codes]
        return arrays + [opened[0].store.array("special")] if self.rules.special else arrays

    def _kept_by_position(self, features: Features, chunk: int, objects: WindowObjects = NOT_PREFETCHED) -> np.ndarray:
        """The rows of chunk ``chunk`` that ``special`` and ``first:K`` keep (of an image store: the
        patches of its valid images that ``first:K`` keeps)."""
        start, stop = self._bounds(chunk)
        if self.images:
            if self._following:  # ``valid`` is read once, and chunks written since would read as invalid
                read = lambda: features._placed("valid")[start:stop]  # noqa: E731
                valid = np.asarray(features._reads.checked("valid", "valid", [chunk], read), dtype=bool)
            else:
                valid = features.valid[start:stop]
            keep = np.repeat(valid, self.positions)
            if self.rules.first:
                keep &= np.tile(np.arange(self.positions) >= self.rules.first, stop - start)
            return keep
        keep = np.ones(stop - start, dtype=bool)
        if self.rules.special:
            special = features._reads.placed("special", objects.array(features.store.array("special")))
            flags = features._reads.checked("special", "special tokens", [chunk], lambda: special[start:stop])
            keep &= ~np.asarray(flags, dtype=bool)
        if self.rules.first:
            offsets = features.text.offsets
            rows = np.arange(start, stop)
            keep &= rows - offsets[np.searchsorted(offsets, rows, side="right") - 1] >= self.rules.first
        return keep

    def _read_stored(
        self, features: Features, layer: str, chunk: int, into: np.ndarray, objects: WindowObjects = NOT_PREFETCHED
    ) -> np.ndarray:
        """Chunk ``chunk`` of ``layer`` as stored, into the first samples of ``into``; a missing or damaged
        object is an error naming it (``Features``' own check)."""
        start, stop = self._bounds(chunk)
        array, name, reads = features.array(layer), f"features/{layer}", features._reads
        through_zarr = lambda: _read(reads.placed(name, objects.array(array)), slice(start, stop), into)  # noqa: E731
        direct = self._direct_chunks(features, layer)
        if direct is None:
            read = through_zarr
        else:
            read = lambda: direct.read(chunk, into, through_zarr, reads.expected(name, chunk))  # noqa: E731
        return reads.checked(name, f"layer '{layer}'", [chunk], read)

    def _direct_chunks(self, features: Features, layer: str) -> DirectChunks | None:
        """``layer``'s direct reader (an uncompressed layer on local disk: ``direct.py``), or None for zarr's
        read; found once per store and layer (threads racing to find it find the same)."""
        key = (str(features.path), layer)
        if key not in self._direct:
            self._direct[key] = direct_chunks(features.array(layer))
        return self._direct[key]

    def _median_norms(self, opened: list[Features]) -> dict[Key, float]:
        if self.num_chunks <= NORM_SAMPLE_CHUNKS:
            sample = np.arange(self.num_chunks)
        else:
            sample = np.sort(np.random.default_rng(0).choice(self.num_chunks, NORM_SAMPLE_CHUNKS, replace=False))
        norms: list[list[np.ndarray]] = [[] for _ in self.sources]
        for chunk in sample:
            start, stop = self._bounds(chunk)
            keep = self._kept_by_position(opened[0], chunk)
            for found, source in zip(norms, self.sources, strict=True):
                if source.codes:  # high_norm is a rule of dense rows: codes do not take part
                    continue
                features = opened[source.store]
                into = np.empty((stop - start, *source.rows.shape), features.array(source.layer).dtype)
                values = self._read_stored(features, source.layer, chunk, into)
                tensor = storage.as_tensor(values, storage.is_bfloat16(features.array(source.layer)))
                found.append(_norms(source.rows.as_rows(tensor))[keep])
        medians = {
            source.key: float(np.median(np.concatenate(found)))
            for source, found in zip(self.sources, norms, strict=True)
            if not source.codes
        }
        if any(not np.isfinite(m) for m in medians.values()):
            raise InvalidRequestError(
                f"{opened[0].path}: no rows to take the median norm of for high_norm (every row is excluded)"
            )
        return medians

    def _shapes(self) -> list[tuple[int, ...]]:
        """The window buffers' shapes: one (rows, D) per source, or one (rows, sources, D) stacked."""
        rows = self.window * self.chunk_size * self.positions
        if self.stack:
            return [(rows, len(self.sources), self.sources[0].rows.width)]
        return [(rows, source.rows.width) for source in self.sources]

    def _dtypes(self) -> list[torch.dtype]:
        """The windows' dtypes: a dense source's window holds its rows as stored, converted to ``dtype`` as
        each batch is gathered (``_take``): a window converted whole would be written in ``dtype`` (twice the
        bytes of float16) and gathered from at that size, and the reads could not go straight into it
        (``direct.py``). A stacked window is one tensor of ``dtype``, its sources' dtypes may differ."""
        if self.stack:
            return [self.dtype]
        return [torch.int32 if s.codes else s.stored or self.dtype for s in self.sources]

    def _targets(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each source's (rows, D) part of a window's buffers."""
        if self.stack:
            return [buffers[0][:, i] for i in range(len(self.sources))]
        return buffers

    def __iter__(self) -> Iterator[Batch | tuple[Batch, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self._following = self.follow and not self._followed
        if self._following:
            opened = self._open()
            windows: Iterator[np.ndarray] = self._done_windows(opened, worker, num_workers)
        else:
            chunks = self.chunks(worker, num_workers)
            if not len(chunks):
                return
            windows = iter([chunks[i : i + self.window] for i in range(0, len(chunks), self.window)])
            opened = self._open()
        self._prepare(opened)
        rng = np.random.default_rng((self.seed, self.epoch, 1, self.rank, worker))
        shapes = self._shapes()
        spare = self._spare.pop() if self._spare else None  # another pass in this process takes none
        allocated = spare if spare is not None and spare.fits(shapes, self._dtypes()) else None
        allocated = allocated or _Buffers.make(shapes, self._dtypes(), self.threads)
        buffers, scratch = allocated.windows, allocated.scratch
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="extract-stream") if self.threads else None
        try:
            read = lambda chunks, k: self._submit(pool, opened, chunks, buffers[k % 2], scratch)  # noqa: E731
            yield from self._batches(windows, read, buffers, rng)
            if self._following:  # the store is complete: later passes are shuffled epochs over it
                self._followed, self._features = True, None
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            self._spare = [allocated]
            self._following = False

    def _done_windows(self, opened: list[Features], worker: int, num_workers: int) -> Iterator[np.ndarray]:
        """``follow``'s first pass: this worker's chunks (chunk k is rank ``k % world_size``'s, and of its
        chunks every ``num_workers``-th is this worker's) as the job marks them done in every store, ``window``
        at a time (fewer at the end), until every store says complete; waits ``poll`` seconds between looks.
        Each look is a listing of ``done`` and a read of the status, the status first: a store says complete
        only once every chunk is done, so the listing after it has them all."""
        mine = np.arange(self.num_chunks)
        mine = mine[mine % self.world_size == self.rank][worker::num_workers]
        ready: list[int] = []
        for new, last in follow_done(opened, mine.tolist(), self.poll):
            ready += new
            while len(ready) >= self.window or (ready and last):
                yield np.asarray(ready[: self.window])
                ready = ready[self.window :]

    def _prepare(self, opened: list[Features]) -> None:
        """Read what the threads share once, here, rather than race for it: the listing of missing objects,
        the arrays, the offsets or the valid flags."""
        for features in opened:
            features._reads.lost  # noqa: B018
            features._reads.recorded  # noqa: B018
            for source in self.sources:
                if opened[source.store] is not features:
                    continue
                if source.codes:
                    codes_of(features, source.layer.partition("/")[2])
                else:
                    features.array(source.layer)
        if self.images and not self._following:
            opened[0].valid  # noqa: B018
        if self.rules.special:
            opened[0].store.array("special")
        if self.rules.first and not self.images:
            opened[0].text.offsets  # noqa: B018

    def _batches(
        self, windows: Iterator[np.ndarray], read: Any, buffers: list[list[torch.Tensor]], rng: np.random.Generator
    ) -> Iterator[Batch | tuple[Batch, torch.Tensor]]:
        """The batches of the ``windows`` (each an array of chunks), the k-th read by ``read(chunks, k)``.
        With reading threads the next window is read while this one is cut; without, after it: read before,
        it would push this window out of the CPU's cache before its rows are gathered (a window of 4 chunks
        of 768 float16 is 20 MB, the L3 32). Following a job (``follow``), the next window may not be done
        yet: it is read after this one is cut, never waited for before this one's batches."""
        carry: tuple[list[torch.Tensor], np.ndarray] | None = None
        ahead = self.threads > 0 and not self._following
        first = next(windows, None)
        pending = None if first is None else read(first, 0)
        k = 0
        while pending is not None:
            window = _gather(pending, self.positions)
            pending = None
            if ahead and (upcoming := next(windows, None)) is not None:
                pending = read(upcoming, k + 1)
            values = buffers[k % 2]
            order = rng.permutation(window.keep)
            at = 0
            if carry is not None:
                take = order[: self.batch_size - len(carry[1])]
                at = len(take)
                merged = (
                    [self._take(v, take, head=h) for v, h in zip(values, carry[0], strict=True)],
                    np.concatenate([carry[1], window.rows[take]]),
                )
                carry = None
                if len(merged[1]) < self.batch_size:
                    carry = merged
                else:
                    yield self._item(*merged)
            while carry is None and at + self.batch_size <= len(order):
                take = order[at : at + self.batch_size]
                at += self.batch_size
                yield self._item([self._take(v, take) for v in values], window.rows[take])
            if carry is None and at < len(order):
                take = order[at:]
                carry = ([self._take(v, take) for v in values], window.rows[take])
            if not ahead and (upcoming := next(windows, None)) is not None:
                pending = read(upcoming, k + 1)
            k += 1
        if carry is not None and not self.drop_last:
            yield self._item(*carry)

    def _take(self, values: torch.Tensor, rows: np.ndarray, head: torch.Tensor | None = None) -> torch.Tensor:
        """``_take`` in the batches' dtype: a window of another dtype (a dense source's, as stored) is
        gathered into a reused batch of its own dtype, which stays in the CPU's cache, and converted from
        there into the fresh batch: one pass over the rows gathered, one over the batch."""
        wanted = values.dtype if values.dtype == torch.int32 else self.dtype
        if values.dtype == wanted:
            return _take(values, rows, head)
        shape = (self.batch_size, *values.shape[1:])
        gathered = self._gathered.get((shape, values.dtype))
        if gathered is None:
            gathered = self._gathered[shape, values.dtype] = _alloc(shape, values.dtype)
        part = gathered[: len(rows)]
        np.take(_row_bytes(values), rows, axis=0, out=_row_bytes(part), mode="clip")
        skip = 0 if head is None else len(head)
        out = _alloc((skip + len(rows), *values.shape[1:]), wanted)
        if head is not None:  # numpy's copy of the bytes, not torch's: see ``_take``
            _row_bytes(out)[:skip] = _row_bytes(head)
        _convert(out[skip:], part)
        return out

    def _under_norm(self, source: _Source, rows: torch.Tensor) -> np.ndarray | bool:
        """The rows of ``rows`` that ``high_norm`` keeps (True without the rule)."""
        if self.rules.high_norm is None:
            return True
        return _norms(rows) <= self.rules.high_norm * self.median_norms[source.key]

    def _item(self, values: list[torch.Tensor], rows: np.ndarray) -> Batch | tuple[Batch, torch.Tensor]:
        batch: Batch
        if not self.stack:  # stacked, the window is one dense (rows, sources, D) tensor: stack=True refuses codes
            values = [self._sparse(s, v) if s.codes else v for s, v in zip(self.sources, values, strict=True)]
        if self.stack or self.single:
            batch = values[0]
        else:
            batch = {source.key: value for source, value in zip(self.sources, values, strict=True)}
        if not self.return_index:
            return batch
        if self.positions == 1:
            return batch, torch.from_numpy(rows)
        return batch, torch.from_numpy(np.stack(np.divmod(rows, self.positions), axis=1))

    def _sparse(self, source: _Source, rows: torch.Tensor) -> torch.Tensor:
        """A codes source's (batch, 2k) int32 rows as a (batch, d_sae) ``torch.sparse_csr_tensor`` of ``dtype``."""
        k = rows.shape[1] // 2
        packed = rows.numpy()
        values = packed[:, k:].astype(np.int16).view(np.float16)
        return csr(
            packed[:, :k], values, source.d_sae or 0, as_torch=True, dtype=str(self.dtype).removeprefix("torch.")
        )

    def _submit(
        self,
        pool: ThreadPoolExecutor | None,
        opened: list[Features],
        chunks: np.ndarray,
        buffers: list[torch.Tensor],
        scratch: queue.SimpleQueue,
    ) -> list[tuple[Future | np.ndarray, int, int]]:
        """Start reading ``chunks`` into ``buffers`` (one task a chunk); (keep mask or its future, start, stop)."""
        tasks = []
        at = 0
        targets = self._targets(buffers)
        # on object storage, every object of the window is fetched at once, read by the tasks (prefetch.py)
        objects = prefetch_window(self._window_arrays(opened), [self._bounds(chunk) for chunk in chunks])
        for chunk in chunks:
            start, stop = self._bounds(chunk)
            args = (opened, int(chunk), targets, at, scratch, objects)
            tasks.append((pool.submit(self._fill, *args) if pool is not None else self._fill(*args), start, stop))
            at += (stop - start) * self.positions
        return tasks

    def _fill(
        self,
        opened: list[Features],
        chunk: int,
        targets: list[torch.Tensor],
        at: int,
        scratch: queue.SimpleQueue,
        objects: WindowObjects = NOT_PREFETCHED,
    ) -> np.ndarray:
        """Read chunk ``chunk`` of every source into rows ``at:`` of its target, in the target's dtype, and
        return the mask of its rows the rules keep."""
        start, stop = self._bounds(chunk)
        samples = stop - start
        keep = self._kept_by_position(opened[0], chunk, objects)
        for index, source in enumerate(self.sources):
            features = opened[source.store]
            if source.codes:
                codes = codes_of(features, source.layer.partition("/")[2])
                indices, values = codes.read(start, stop)
                target = targets[index][at : at + samples].numpy()
                target[:, : codes.k], target[:, codes.k :] = indices, values.view(np.int16)
                continue
            array = features.array(source.layer)
            target = targets[index][at : at + samples * self.positions]
            direct = _stored_view(target, source.stored) if source.rows.contiguous else None
            if direct is not None and not direct.flags.c_contiguous and self._direct_chunks(features, source.layer):
                direct = None  # a stacked window's column: the direct read fills a thread's chunk, copied in
            if direct is not None:  # decoded straight into the window (bfloat16 too: its bits)
                self._read_stored(
                    features, source.layer, chunk, _reshaped(direct, (samples, *source.rows.shape)), objects
                )
                keep &= self._under_norm(source, target)
                continue
            mine = scratch.get()  # a thread's chunk: a fresh one each time would page-fault on every chunk
            try:
                stored = mine.get(index)
                if stored is None:
                    stored = mine[index] = np.empty((self.chunk_size, *source.rows.shape), dtype=array.dtype)
                values = self._read_stored(features, source.layer, chunk, stored, objects)
                tensor = storage.as_tensor(values, storage.is_bfloat16(array))
                moved = tensor if source.rows.channels is None else tensor.movedim(source.rows.channels, -1)
                target.view(source.rows.moved_shape(samples)).copy_(moved)
                if self.rules.high_norm is not None:
                    keep &= self._under_norm(source, source.rows.as_rows(tensor))
            finally:
                scratch.put(mine)
        return keep


def _source(features: Features, store: int, layer: str, key: Key) -> _Source:
    """``layer`` of ``features`` as a source: a layer's rows, or ``latents/<layer>``, its SAE codes."""
    if layer.startswith(f"{LATENTS}/") and layer not in features.layers:
        codes = codes_of(features, layer.partition("/")[2])
        return _Source(store, layer, Rows((2 * codes.k,)), key, codes.d_sae)
    array = features.array(layer)
    stored = storage.as_tensor(np.empty(0, array.dtype), storage.is_bfloat16(array)).dtype
    return _Source(store, layer, layer_rows(features, layer), key, stored=stored)


def _stored_view(target: torch.Tensor, stored: torch.dtype | None) -> np.ndarray | None:
    """``storage.numpy_view`` of a window's rows, from the source's stored dtype found once: asked per chunk,
    the array's attributes would be read again each time."""
    if target.dtype != stored:
        return None
    return target.view(torch.uint16).numpy() if stored == torch.bfloat16 else target.numpy()


def _alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in numpy's memory, which asks for transparent huge pages for large arrays:
    filling it page-faults far less than filling a ``torch.empty`` (a batch 2x, a window 5x faster here).
    Any dtype, bfloat16 too: the bytes are numpy's, the view torch's."""
    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _take(values: torch.Tensor, rows: np.ndarray, head: torch.Tensor | None = None) -> torch.Tensor:
    """``values[rows]`` after the rows of ``head`` (if any), a fresh tensor (a batch outlives the window it
    came from). numpy gathers the rows' bytes (any dtype, bfloat16 too), not torch: a torch op starts
    torch's intra-op threads, and with the reading threads busy on a small machine each op waited for
    them (7.6 ms of CPU for a 4096-row ``index_select`` with 2 torch threads on 2 busy cores, 0.5 ms here;
    ``benchmarks/codecs.py``)."""
    skip = 0 if head is None else len(head)
    out = _alloc((skip + len(rows), *values.shape[1:]), values.dtype)
    into = _row_bytes(out)
    if head is not None:
        into[:skip] = _row_bytes(head)
    np.take(_row_bytes(values), rows, axis=0, out=into[skip:], mode="clip")  # rows are in range: no "raise" copy
    return out


# torch runs an op of at most this many elements inline, on the calling thread (ATen's ``GRAIN_SIZE``)
INLINE_ELEMENTS = 32768


def _convert(into: torch.Tensor, values: torch.Tensor) -> None:
    """``into[:] = values`` (both contiguous) in ``into``'s dtype, in pieces that torch converts on this
    thread: a whole batch goes to torch's intra-op threads, which on a busy machine spin and wait for the
    cores the reading threads hold (1.18 CPU-s/GB for a float16 batch of 4096 x 768 with 2 torch threads at
    load 13; 0.11-0.13 in pieces, as with 1 torch thread; numpy converts float16 in scalar code, 0.84)."""
    pieces = into.view(-1).split(INLINE_ELEMENTS)
    for piece, part in zip(pieces, values.reshape(-1).split(INLINE_ELEMENTS), strict=True):
        piece.copy_(part)


def _row_bytes(values: torch.Tensor) -> np.ndarray:
    """A (rows, ..., D) tensor's rows as (rows, ..., D x itemsize) bytes, the same memory."""
    return values.view(torch.uint8).numpy()


def _reshaped(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``values`` (rows, possibly a stacked window's strided column) as ``shape``, the same memory: zarr
    decodes into it, so a reshape that copied would lose the chunk (setting ``shape`` raises instead)."""
    view = values.view()
    view.shape = shape
    return view


def _norms(values: torch.Tensor) -> np.ndarray:
    """(n,) float32 L2 norms of the rows, computed in float32."""
    return torch.linalg.vector_norm(values, dim=1, dtype=torch.float32).numpy()


def _gather(tasks: list[tuple[Future | np.ndarray, int, int]], positions: int = 1) -> _Window:
    """Wait for a window's chunks: its kept rows (window-local) and global rows (``positions`` a sample)."""
    masks = [task.result() if isinstance(task, Future) else task for task, _, _ in tasks]
    rows = np.concatenate([np.arange(start * positions, stop * positions) for _, start, stop in tasks])
    return _Window(np.flatnonzero(np.concatenate(masks)), rows)
