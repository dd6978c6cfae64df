"""Which samples go in which chunk, and which rank writes which chunks."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Sampler

CHUNK_TARGET_BYTES = 16 * 2**20
MAX_CHUNK_SIZE = 1024
MIN_STEPS = 16  # chunks (progress steps) of a job with at least MIN_STEPS_FROM samples
MIN_STEPS_FROM = 256


def default_chunk_size(num_samples: int, bytes_per_sample: int, world_size: int = 1) -> int:
    """Samples per chunk so that the largest layer's chunk is about 16 MiB uncompressed: large enough
    for codecs and filesystems, small enough to keep writer memory and the work lost to a crash small.
    A power of two, at most 1024. Small jobs get smaller chunks so that every rank has work (K >= 4 x
    world size when N allows it) and the progress bar moves (K >= 16 from a few hundred samples)."""
    fit = max(1, CHUNK_TARGET_BYTES // max(1, bytes_per_sample))
    size = min(MAX_CHUNK_SIZE, 2 ** int(math.log2(fit)))
    steps = max(4 * world_size, MIN_STEPS if num_samples >= MIN_STEPS_FROM else 1)
    return max(1, min(size, num_samples // steps))


@dataclass(frozen=True)
class Plan:
    """N samples in K = ceil(N / C) chunks of C samples; the last may be short."""

    num_samples: int
    chunk_size: int

    @property
    def num_chunks(self) -> int:
        return -(-self.num_samples // self.chunk_size)

    def bounds(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_size
        return start, min(start + self.chunk_size, self.num_samples)

    def samples_in(self, chunks: Sequence[int]) -> int:
        return sum(stop - start for start, stop in map(self.bounds, chunks))


def assign(chunks: Sequence[int], world_size: int) -> list[list[int]]:
    """Split ``chunks`` into ``world_size`` contiguous runs whose lengths differ by at most one.

    Like accelerate's ``split_between_processes``, but over whole chunks (ranks must never
    share a zarr chunk) and returning every rank's share, which the store's provenance records.
    """
    per_rank, extra = divmod(len(chunks), world_size)
    runs, start = [], 0
    for rank in range(world_size):
        stop = start + per_rank + (rank < extra)
        runs.append(list(chunks[start:stop]))
        start = stop
    return runs


class ChunkBatchSampler(Sampler[list[int]]):
    """Batches of sample indices covering ``chunks`` in order, lazily (memory does not grow with N).

    Batches may straddle chunk boundaries; the writer assembles whole chunks from them.
    """

    def __init__(self, plan: Plan, chunks: Sequence[int], batch_size: int) -> None:
        self.plan, self.chunks, self.batch_size = plan, list(chunks), batch_size

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for chunk in self.chunks:
            for index in range(*self.plan.bounds(chunk)):
                batch.append(index)
                if len(batch) == self.batch_size:
                    yield batch
                    batch = []
        if batch:
            yield batch

    def __len__(self) -> int:
        return -(-self.plan.samples_in(self.chunks) // self.batch_size)


def chunk_segments(indices: np.ndarray, chunk_size: int) -> Iterator[tuple[int, int, int]]:
    """Split a sorted batch of sample indices into (chunk, first row, end row) runs."""
    chunk_ids = indices // chunk_size
    edges = np.flatnonzero(np.diff(chunk_ids)) + 1
    starts = [0, *edges.tolist()]
    ends = [*edges.tolist(), len(indices)]
    for start, end in zip(starts, ends, strict=True):
        yield int(chunk_ids[start]), start, end
