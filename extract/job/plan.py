"""Which samples go in which chunk, and which rank writes which chunks (the geometry itself, ``Plan``,
is the store's: ``extract.store.chunks``)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from torch.utils.data import Sampler

from ..store.chunks import Plan, share

CHUNK_TARGET_BYTES = 16 * 2**20
MAX_CHUNK_SIZE = 1024
MAX_TOKEN_CHUNK_SIZE = 2**16  # a token's row is one vector: 16 MiB of d=768 float16 rows is ~11k tokens
MIN_STEPS = 16  # chunks (progress steps) of a job with at least MIN_STEPS_FROM samples
MIN_STEPS_FROM = 256


def default_chunk_size(
    num_samples: int, bytes_per_sample: int, world_size: int = 1, largest: int = MAX_CHUNK_SIZE
) -> int:
    """Samples per chunk so that the largest layer's chunk is about 16 MiB uncompressed: large enough
    for codecs and filesystems, small enough to keep writer memory and the work lost to a crash small.
    A power of two, at most ``largest`` (1024 images or documents, 2**16 tokens). Small jobs get smaller chunks so that every rank has work (K >= 4 x
    world size when N allows it) and the progress bar moves (K >= 16 from a few hundred samples)."""
    fit = max(1, CHUNK_TARGET_BYTES // max(1, bytes_per_sample))
    size = min(largest, 2 ** int(math.log2(fit)))
    steps = max(4 * world_size, MIN_STEPS if num_samples >= MIN_STEPS_FROM else 1)
    return max(1, min(size, num_samples // steps))


def assign(chunks: Sequence[int], world_size: int) -> list[list[int]]:
    """Split ``chunks`` into ``world_size`` contiguous runs whose lengths differ by at most one.

    Like accelerate's ``split_between_processes``, but over whole chunks (ranks must never
    share a zarr chunk) and returning every rank's share, which the store's provenance records.
    """
    return [list(chunks[slice(*share(len(chunks), rank, world_size))]) for rank in range(world_size)]


class ChunkBatchSampler(Sampler[list[int]]):
    """Batches of sample indices covering ``chunks`` in order, lazily (memory does not grow with N).

    A chunk's batches start at its first sample and never take another chunk's: every sample's batch
    is then fixed by the job alone, not by which chunks a rank has or which are pending, so the same
    job gives the same bytes with any process count and after a resume (a batch's size can change a
    kernel's rounding).
    """

    def __init__(self, plan: Plan, chunks: Sequence[int], batch_size: int) -> None:
        self.plan, self.chunks, self.batch_size = plan, list(chunks), batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for chunk in self.chunks:
            start, stop = self.plan.bounds(chunk)
            for first in range(start, stop, self.batch_size):
                yield list(range(first, min(first + self.batch_size, stop)))

    def __len__(self) -> int:
        return sum(-(-(stop - start) // self.batch_size) for start, stop in map(self.plan.bounds, self.chunks))
