"""The chunk geometry every stage shares: N samples in K chunks of C, and a batch's runs per chunk.

It lives with the store because a chunk is the store's unit of writing (one object per array), and
the reader, the writer and verification need it without knowing anything about the job.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


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


def share(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """``rank``'s contiguous run (start, stop) of ``count`` items split into ``world_size`` runs whose
    lengths differ by at most one, the first ones longer."""
    per_rank, extra = divmod(count, world_size)
    start = rank * per_rank + min(rank, extra)
    return start, start + per_rank + (rank < extra)


def chunk_segments(indices: np.ndarray, chunk_size: int) -> Iterator[tuple[int, int, int]]:
    """Split a sorted batch of sample indices into (chunk, first row, end row) runs."""
    chunk_ids = indices // chunk_size
    edges = np.flatnonzero(np.diff(chunk_ids)) + 1
    starts = [0, *edges.tolist()]
    ends = [*edges.tolist(), len(indices)]
    for start, end in zip(starts, ends, strict=True):
        yield int(chunk_ids[start]), start, end
