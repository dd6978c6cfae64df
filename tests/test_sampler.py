"""ChunkShuffleSampler across ranks: each rank gets whole chunks of its own, together covering every sample once."""

import json

import numpy as np
import pytest
from helpers import HELPERS, ROOT, patience
from helpers.launches import launcher
from helpers.stores import array_store

from extract import ChunkShuffleSampler


def chunks_of(indices, chunk):
    return {i // chunk for i in indices}


@pytest.mark.parametrize(
    "n, chunk, world, workers",
    [(100, 8, 2, 0), (100, 8, 3, 2), (13, 4, 2, 0), (5, 4, 3, 0), (3, 8, 2, 1), (64, 8, 4, 3)],
)
def test_ranks_get_disjoint_whole_chunks_covering_everything(n, chunk, world, workers):
    for epoch in range(2):
        per_rank = []
        for rank in range(world):
            sampler = ChunkShuffleSampler(
                n, chunk, 3, num_workers=workers, window=2, seed=5, rank=rank, world_size=world
            )
            sampler.set_epoch(epoch)
            batches = list(sampler)
            assert len(batches) == len(sampler)
            per_rank.append([i for b in batches for i in b])
        everything = sorted(i for indices in per_rank for i in indices)
        assert everything == list(range(n))  # every sample exactly once across ranks
        owned = [chunks_of(indices, chunk) for indices in per_rank]
        for a in range(world):
            for b in range(a + 1, world):
                assert not owned[a] & owned[b]  # no chunk read by two ranks
    # the deal changes with the epoch (the chunk order is reshuffled)
    firsts = []
    for epoch in range(4):
        sampler = ChunkShuffleSampler(100, 8, 3, seed=5, rank=0, world_size=2)
        sampler.set_epoch(epoch)
        firsts.append(tuple(sorted(chunks_of([i for b in sampler for i in b], 8))))
    assert len(set(firsts)) > 1


def test_subset_keeps_only_those_samples_and_their_chunks():
    subset = np.zeros(50, dtype=bool)
    subset[[0, 3, 9, 17, 18, 19, 40, 49]] = True
    for form in (subset, np.flatnonzero(subset)):
        got = []
        for rank in range(2):
            sampler = ChunkShuffleSampler(50, 10, 2, seed=0, rank=rank, world_size=2, subset=form)
            batches = list(sampler)
            assert len(sampler) == len(batches)
            got += [i for b in batches for i in b]
        assert sorted(got) == np.flatnonzero(subset).tolist()
    with pytest.raises(ValueError, match="rank"):
        ChunkShuffleSampler(10, 2, 2, rank=2, world_size=2)


@pytest.mark.slow
def test_ddp_loop_with_two_processes(tmp_path):
    n, chunk = 45, 4
    rng = np.random.default_rng(0)
    store = array_store(
        tmp_path / "s.zarr", {"feat": rng.normal(size=(n, 6)).astype(np.float32)}, rng.integers(0, 10, n), chunk
    )
    out = tmp_path / "seen.json"
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    command = [*launcher(2)[:-1], str(HELPERS / "ddp_sampler_script.py"), str(store), str(out)]
    result = patience.run(command, capture_output=True, text=True, quiet=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    ranks = sorted(record["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)  # from the group
    for epoch in ("0", "1"):
        seen = [r["seen"][epoch] for r in ranks]
        assert sorted(seen[0] + seen[1]) == list(range(n))
        assert not chunks_of(seen[0], chunk) & chunks_of(seen[1], chunk)
    assert record["same_weights"]


def test_a_small_store_still_gets_full_batches_with_workers():
    sampler = ChunkShuffleSampler(256, 32, batch_size=256, num_workers=2)
    assert [len(batch) for batch in sampler] == [256] and len(sampler) == 1
    sampler = ChunkShuffleSampler(1024, 32, batch_size=256, num_workers=2)
    assert [len(batch) for batch in sampler] == [256] * 4  # two streams, each of whole batches
