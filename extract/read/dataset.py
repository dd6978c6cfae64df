"""A torch ``Dataset`` over a store's layers that reads whole chunks, and a batch sampler whose shuffled
epochs read each chunk about once, also with several DataLoader workers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from ..names import Kind
from ..store.location import check_not_forked, locate
from .features import Features, open_features
from .sources import Rows, layer_rows

Sample = tuple[torch.Tensor | dict[str, torch.Tensor], int]


class FeatureDataset(Dataset):
    """``(features, label)`` per sample: a float tensor for one layer, a ``{layer: tensor}`` dict for several.
    In a token store a sample is one token's row, and its label is its document's.

    Items are served from the last ``cache_chunks`` chunks read (per process), so indices within them
    cost no read; pair it with ``ChunkShuffleSampler`` (``window`` <= ``cache_chunks``) for shuffled
    epochs. ``pool`` reduces each layer as ``Features.load`` does: one value for every layer, or a
    ``{layer: pool}`` mapping (layers it leaves out are read whole), as ``--pool layer3=avg`` does at
    extraction. Labels are read with their chunk, so a store still being written (``allow_partial``)
    serves the labels of the chunks written since the dataset was made. The store is opened lazily in
    each process: only the path is pickled to DataLoader workers, never an open zarr handle.

    ``rows="patches"`` reads an image store's per-position layers (a ViT block or a conv map kept whole,
    ``--pool none``) as one sample per (image, patch), as ``TokenStream`` streams them: item
    ``i = image * positions + patch`` is that patch's (D,) row and its image's label, where ``positions``
    is the patches per image (a ViT's tokens, CLS first; ``h * W + w`` of a map). ``len`` is
    ``num_samples * positions`` and a chunk is ``chunk_rows`` = ``chunk_size * positions`` rows: pass
    ``ChunkShuffleSampler(len(dataset), dataset.chunk_rows, ...)``, and ``subset=np.arange(len(dataset))
    % dataset.positions >= 1`` to leave out each image's CLS token.
    """

    def __init__(
        self,
        path: str | Path,
        layers: str | Sequence[str],
        *,
        pool: str | Mapping[str, str | None] | None = None,
        dtype: str = "float32",
        allow_partial: bool = False,
        cache_chunks: int = 1,
        rows: str = "samples",
    ) -> None:
        if rows not in ("samples", "patches"):
            raise ValueError(f"rows={rows!r}: 'samples' (one per stored sample) or 'patches' (one per image patch)")
        self.location = locate(path)  # a URL on object storage stays one (s3://...)
        self.path = self.location.place
        self.dtype, self.allow_partial = dtype, allow_partial
        self.cache_chunks = max(1, cache_chunks)
        self.single = isinstance(layers, str)
        self.layers = [layers] if isinstance(layers, str) else list(layers)
        if isinstance(pool, Mapping):
            if unknown := sorted(set(pool) - set(self.layers)):
                raise ValueError(f"pool names {', '.join(unknown)}, which are not among the layers {self.layers}")
            self.pools = {layer: pool.get(layer) for layer in self.layers}
        else:
            self.pools = dict.fromkeys(self.layers, pool)
        features = open_features(self.location, allow_partial=allow_partial)
        for layer in self.layers:  # an unknown layer, or a pool that does not fit one (a layer pooled at
            # extraction), fails here, in the main process, not at the first item in a DataLoader worker
            pool = self.pools[layer]
            features.pooled_shape(layer, pool, call=f"FeatureDataset(..., {layer!r}, pool={pool!r})")
        self.patches = self._patch_rows(features) if rows == "patches" else None
        self.positions = 1 if self.patches is None else next(iter(self.patches.values())).positions
        self.num_samples, self.chunk_size = features.num_samples, features.chunk_size
        self.chunk_rows = self.chunk_size * self.positions
        self.chunk_reads = 0  # in this process; lets tests and benchmarks check the sampler's locality
        self._reset()

    def _patch_rows(self, features: Features) -> dict[str, Rows]:
        """Each layer's patches (``rows="patches"``): an image store's per-position layers, read whole."""
        if features.kind is not Kind.IMAGES:
            raise ValueError(
                f"rows='patches' reads an image store's patches; {features.path} is a {features.kind} store"
            )
        if any(pool not in (None, "none") for pool in self.pools.values()):
            raise ValueError("rows='patches' reads each patch's row: leave pool=None")
        patches = {layer: layer_rows(features, layer) for layer in self.layers}
        if len({rows.positions for rows in patches.values()}) > 1:
            counts = {layer: rows.positions for layer, rows in patches.items()}
            raise ValueError(f"rows='patches': the layers have different numbers of patches per image ({counts})")
        return patches

    def _reset(self) -> None:
        self._features: Features | None = None
        self._cache: OrderedDict[int, tuple[dict[str, torch.Tensor], np.ndarray]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_features=None, _cache=OrderedDict())
        return state

    def __len__(self) -> int:
        return self.num_samples * self.positions

    def __getitem__(self, index: int) -> Sample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        index %= len(self)
        chunk, row = divmod(index, self.chunk_rows)
        cached = self._cache.get(chunk)
        if cached is None:
            cached = self._read_chunk(chunk)
        else:
            self._cache.move_to_end(chunk)
        layers, labels = cached
        values = {layer: layers[layer][row] for layer in self.layers}
        return (values[self.layers[0]] if self.single else values), int(labels[row])

    def _read_chunk(self, chunk: int) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        check_not_forked(self.location)
        if self._features is None:
            self._features = open_features(self.location, allow_partial=self.allow_partial)
        start = chunk * self.chunk_size
        rows = slice(start, min(start + self.chunk_size, self.num_samples))
        values = {
            layer: self._features.load(layer, rows, pool=self.pools[layer], dtype=self.dtype, as_torch=True)
            for layer in self.layers
        }
        if self._features.kind is Kind.TOKENS:  # a token's label is its document's
            labels = self._features.labels[self._features.text.documents_of(rows)]
        else:
            labels = self._features.load_labels(rows)
        if self.patches is not None:  # each image's patches, in order, with the image's label
            values = {layer: self.patches[layer].as_rows(value) for layer, value in values.items()}
            labels = np.repeat(labels, self.positions)
        self._cache[chunk] = (values, labels)
        while len(self._cache) > self.cache_chunks:
            self._cache.popitem(last=False)
        self.chunk_reads += 1
        return self._cache[chunk]


class ChunkShuffleSampler(Sampler[list[int]]):
    """Batches of a shuffled epoch that touch each chunk about once; use as ``DataLoader(batch_sampler=...)``.

    The chunk order is permuted, and samples are shuffled within windows of ``window`` consecutive
    chunks of that order (give ``FeatureDataset`` ``cache_chunks >= window`` so a window is read once).
    A larger window mixes better (a store in class order, like ImageFolder's, needs one spanning
    several classes) at the cost of caching that many chunks per worker. With ``num_workers`` > 1 the chunks are
    dealt to that many streams and their batches interleaved, because the DataLoader hands batch j to
    worker j % num_workers: each worker then reads only its own chunks. Streams end unevenly, so the
    last few batches may make a worker read a chunk another one also read. There are never more
    streams than full batches, so a small store still gets batches of ``batch_size``.

    The permutation depends on ``seed`` and the epoch (``set_epoch``), not on global RNG state.

    In a multi-process (DDP) training loop each rank gets its own whole chunks: the epoch's chunk
    order is the same on every rank (same seed and epoch) and rank r takes every ``world_size``-th
    chunk of it, so ranks never read the same chunk and together cover every sample once. ``rank``
    and ``world_size`` default to those of an initialized ``torch.distributed`` process group (0 and
    1 without one). Ranks may get a chunk more or less than others, so their batch counts can differ
    by about a chunk's worth: stop all ranks at the smallest ``len(sampler)`` or wrap the loop in DDP's
    ``join()``. ``subset`` (an (N,) bool mask or sample indices) restricts the epoch to those samples
    (a training split), keeping the chunk locality.
    """

    def __init__(
        self,
        num_samples: int,
        chunk_size: int,
        batch_size: int,
        *,
        num_workers: int = 0,
        window: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        subset: np.ndarray | Sequence[int] | None = None,
    ) -> None:
        if min(num_samples, chunk_size, batch_size, window) < 1 or num_workers < 0:
            raise ValueError("num_samples, chunk_size, batch_size and window must be positive, num_workers 0 or more")
        self.window = window
        self.num_samples, self.chunk_size, self.batch_size = num_samples, chunk_size, batch_size
        self.workers = max(1, num_workers)
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.rank, self.world_size = _rank_and_world_size(rank, world_size)
        self.subset = None if subset is None else _as_mask(subset, num_samples)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _window_indices(self, chunks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        rows = np.concatenate(
            [np.arange(c * self.chunk_size, min((c + 1) * self.chunk_size, self.num_samples)) for c in chunks]
        )
        if self.subset is not None:
            rows = rows[self.subset[rows]]
        return rng.permutation(rows) if self.shuffle else rows

    def _stream_chunks(self) -> list[np.ndarray]:
        """The chunks of each stream, in reading order, for this epoch."""
        rng = np.random.default_rng((self.seed, self.epoch))
        num_chunks = -(-self.num_samples // self.chunk_size)
        order = rng.permutation(num_chunks) if self.shuffle else np.arange(num_chunks)
        mine = order[self.rank :: self.world_size]
        # a stream per worker, but no more streams than full batches: with fewer samples than
        # workers x batch_size, more streams would only cut every batch short
        streams = max(1, min(self.workers, self._stream_samples(mine) // self.batch_size))
        return [mine[w::streams] for w in range(streams)]

    def _stream_samples(self, chunks: np.ndarray) -> int:
        if self.subset is not None:
            return int(sum(self.subset[c * self.chunk_size : (c + 1) * self.chunk_size].sum() for c in chunks))
        return int(sum(min(self.chunk_size, self.num_samples - c * self.chunk_size) for c in chunks))

    def __iter__(self) -> Iterator[list[int]]:
        # Seeded by (seed, epoch) and separate from the chunk order's generator, so both are reproducible.
        rng = np.random.default_rng((self.seed, self.epoch, 1))
        streams = []
        for chunks in self._stream_chunks():
            windows = [chunks[i : i + self.window] for i in range(0, len(chunks), self.window)]
            indices = np.concatenate([self._window_indices(w, rng) for w in windows] or [np.empty(0, np.int64)])
            streams.append([indices[i : i + self.batch_size].tolist() for i in range(0, len(indices), self.batch_size)])
        for step in range(max(map(len, streams), default=0)):
            for batches in streams:
                if step < len(batches):
                    yield batches[step]

    def __len__(self) -> int:
        return sum(-(-self._stream_samples(chunks) // self.batch_size) for chunks in self._stream_chunks())


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The given rank and world size, else the initialized process group's, else 0 of 1."""
    if rank is None or world_size is None:
        group = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = rank if rank is not None else (torch.distributed.get_rank() if group else 0)
        world_size = world_size if world_size is not None else (torch.distributed.get_world_size() if group else 1)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) and world_size positive; got rank {rank} of {world_size}")
    return rank, world_size


def _as_mask(subset: np.ndarray | Sequence[int], num_samples: int) -> np.ndarray:
    subset = np.asarray(subset)
    if subset.dtype == bool:
        if subset.shape != (num_samples,):
            raise ValueError(f"a boolean subset needs shape ({num_samples},), got {subset.shape}")
        return subset
    mask = np.zeros(num_samples, dtype=bool)
    mask[subset.astype(np.int64)] = True
    return mask
