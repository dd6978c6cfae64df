"""Chunk planning, host staging and the writer, without the CLI."""

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers import patience
from zarr.buffer import default_buffer_prototype

from extract.capture.staging import HostStaging
from extract.job.plan import ChunkBatchSampler, assign, default_chunk_size
from extract.store.chunks import Plan, chunk_segments
from extract.store.store import FeatureStore
from extract.store.writer import ChunkWriter, WriterError


@pytest.mark.parametrize("num_samples", [1, 2, 7, 16, 17, 33, 100])
@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_every_index_lands_in_exactly_one_chunk_of_one_rank(num_samples, chunk_size, world_size):
    plan = Plan(num_samples, chunk_size)
    shares = assign(list(range(plan.num_chunks)), world_size)
    assert len(shares) == world_size
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1
    seen = []
    for share in shares:
        assert share == list(range(share[0], share[0] + len(share))) if share else True  # contiguous run
        for batch in ChunkBatchSampler(plan, share, batch_size=5):
            assert len(batch) <= 5
            seen.extend(batch)
    assert sorted(seen) == list(range(num_samples))
    assert len(seen) == num_samples


def test_resume_assigns_only_pending_chunks():
    plan = Plan(50, 8)
    pending = [1, 2, 5, 6]
    shares = assign(pending, 3)
    assert shares == [[1, 2], [5], [6]]
    assert sum(len(b) for b in ChunkBatchSampler(plan, shares[2], 4)) == 2  # chunk 6 is the short last one


def test_chunk_segments():
    indices = np.array([6, 7, 8, 9, 10, 16])
    assert list(chunk_segments(indices, 4)) == [(1, 0, 2), (2, 2, 5), (4, 5, 6)]


def test_default_chunk_size():
    assert default_chunk_size(10_000, 1024 * 14 * 14 * 2) == 32  # resnet50 layer3 float16: ~12.5 MiB chunks
    assert default_chunk_size(100_000, 2048 * 2) == 1024  # pooled features: capped
    assert default_chunk_size(10_000, 2048 * 2) == 625  # at least 16 progress steps
    assert default_chunk_size(5, 100) == 1  # never more than N, and several chunks when N allows
    assert default_chunk_size(1, 100, world_size=4) == 1


@pytest.mark.parametrize("n", [1, 3, 7, 8, 13, 100, 200, 255, 256, 300, 1000, 5000, 10_000, 1_281_167])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_default_chunk_size_gives_every_rank_work_and_the_bar_steps(n, world):
    for sample_bytes in (100, 2048 * 2, 1024 * 14 * 14 * 2):
        size = default_chunk_size(n, sample_bytes, world)
        chunks = Plan(n, size).num_chunks
        assert 1 <= size <= 1024
        assert chunks >= min(n, 4 * world), "every rank gets chunks (K >= 4 x world size when N allows)"
        if n >= 256:
            assert chunks >= 16, "the progress bar takes at least 16 steps"
        assert size * sample_bytes <= 16 * 2**20 or size == 1, "chunks stay about 16 MiB at most"
        if n >= 1_000_000:
            assert size * sample_bytes > 8 * 2**20 or size == 1024, "large jobs keep large chunks"


def test_staging_reuses_slots_and_blocks_when_all_are_in_use():
    staging = HostStaging({"a": (3,)}, batch_size=4, dtype=torch.float16, device=torch.device("cpu"), slots=2)
    first, second = staging.acquire(), staging.acquire()
    pointers = {first.buffers["a"].data_ptr(), second.buffers["a"].data_ptr()}
    got, checks, found_empty = [], [], threading.Event()

    def check():  # acquire calls it before each wait for a slot: a second call means the first wait found none
        checks.append(None)
        if len(checks) == 2:
            found_empty.set()

    waiter = threading.Thread(target=lambda: got.append(staging.acquire(check)))
    waiter.start()
    assert found_empty.wait(timeout=patience.ceiling(10))
    assert got == [], "a full pool must make the loop wait (backpressure)"
    staging.release(first)
    waiter.join(timeout=patience.ceiling(5))
    assert got and got[0].buffers["a"].data_ptr() in pointers  # reused, not reallocated


def test_staging_copies_and_casts():
    staging = HostStaging({"a": (2,)}, batch_size=4, dtype=torch.float16, device=torch.device("cpu"), slots=1)
    slot = staging.acquire()
    value = torch.tensor([[1.0, -2.0], [3.5, 70000.0]])
    staging.stage("a", value)
    value.zero_()  # a later in-place op must not reach the slot
    assert slot.buffers["a"][:2].tolist() == [[1.0, -2.0], [3.5, float("inf")]]


def test_check_propagates_acquire_errors():
    staging = HostStaging({"a": (1,)}, batch_size=1, dtype=torch.float32, device=torch.device("cpu"), slots=1)
    staging.acquire()

    def failing():
        raise WriterError("writer died")

    with pytest.raises(WriterError):
        staging.acquire(failing)


def _store(tmp_path, num_samples=10, chunk_size=4):
    return FeatureStore.create(
        tmp_path / "s.zarr", shapes={"a": (2,)}, num_samples=num_samples, chunk_size=chunk_size,
        dtype="float32", compressor="zstd", attrs={"layers": ["a"]},
    )  # fmt: skip


def _feed(writer, staging, indices):
    for start in range(0, len(indices), 3):
        batch = torch.tensor(indices[start : start + 3])
        slot = staging.acquire(writer.check)
        staging.stage("a", torch.stack([batch.float(), -batch.float()], dim=1))
        staging.seal(slot)
        writer.submit(slot, batch, batch % 2, np.ones(len(batch), dtype=bool))


@pytest.mark.parametrize("threads", [1, 3])
def test_writer_assembles_whole_chunks(tmp_path, threads):
    store = _store(tmp_path)
    staging = HostStaging({"a": (2,)}, 3, torch.float32, torch.device("cpu"), slots=2)
    writer = ChunkWriter(store, staging, Plan(10, 4), {"a": (2,)}, threads=threads)
    _feed(writer, staging, list(range(10)))
    writer.close()
    assert writer.chunks_written == 3
    stored = store.array("features/a")[:]
    np.testing.assert_array_equal(stored[:, 0], np.arange(10))
    np.testing.assert_array_equal(stored[:, 1], -np.arange(10))
    np.testing.assert_array_equal(store.array("labels")[:], np.arange(10) % 2)
    assert store.array("done")[:].all()


def test_writer_error_stops_the_run_and_marks_nothing_done(tmp_path, monkeypatch):
    store = _store(tmp_path)
    staging = HostStaging({"a": (2,)}, 3, torch.float32, torch.device("cpu"), slots=2)
    writer = ChunkWriter(store, staging, Plan(10, 4), {"a": (2,)}, threads=1)
    real = store.array("features/a")
    from zarr.storage import LocalStore

    original = LocalStore.set

    async def full_disk(self, key, value):  # the disk fills up at the first chunk object of layer a
        if key.startswith("features/a/c"):
            raise OSError(28, "No space left on device")
        await original(self, key, value)

    monkeypatch.setattr(LocalStore, "set", full_disk)
    with pytest.raises(WriterError, match="No space left"):
        _feed(writer, staging, list(range(10)))
        writer.close()
    writer.abort()
    assert not store.array("done")[:].any()
    assert np.isnan(real[:]).all()


def test_a_fenced_store_measures_its_size_from_the_listing_without_reading_an_object(tmp_path, monkeypatch):
    """The job's summary asks ``stored_bytes`` of its fenced store; zarr's ``WrapperStore`` would measure
    each object by reading it whole (a 1.5 TB store read back at the end of the job)."""
    from zarr.storage import LocalStore

    _store(tmp_path).update_attrs(writer="job")
    store = FeatureStore.open(tmp_path / "s.zarr", writer="job")
    store.write_chunk(0, 0, 4, {"a": np.ones((4, 2), np.float32)}, np.zeros(4, np.int64), np.ones(4, bool))
    on_disk = sum(f.stat().st_size for f in (tmp_path / "s.zarr" / "features").rglob("*") if f.is_file())
    reads = []
    original = LocalStore.get

    async def counted(self, key, *args, **kwargs):
        reads.append(key)
        return await original(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "get", counted)
    assert store.stored_bytes() == on_disk
    assert reads == []


def test_a_launcher_world_the_state_does_not_see_is_refused(monkeypatch):
    """WORLD_SIZE=3 from the launcher but a one-process state: every process would write everything."""
    import extract.job.dist
    from extract.errors import ExtractError

    class OneProcess:
        num_processes = 1

        def __init__(self, **kwargs):
            pass

    monkeypatch.setattr(extract.job.dist, "PartialState", OneProcess)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ExtractError, match="started 3 processes but this one sees a world of 1"):
        extract.job.dist.process_state()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert extract.job.dist.process_state().num_processes == 1


def test_done_flags_listings_and_sizes_go_through_the_zarr_store_not_the_disk(tmp_path):
    """The same store copied into memory answers the same: nothing reads paths on disk."""
    on_disk = _store(tmp_path)
    on_disk.array("features/a")[0:8] = 1.0
    on_disk.array("labels")[0:8] = 1
    on_disk.array("valid")[0:8] = True
    on_disk.array("stats/a")[0:2] = 0.0  # the chunks' statistics rows (one object per chunk)
    on_disk.array("done")[0:2] = True
    files = {
        path.relative_to(on_disk.path).as_posix(): path.read_bytes()
        for path in on_disk.path.rglob("*")
        if path.is_file()
    }
    memory = zarr.storage.MemoryStore(
        {key: default_buffer_prototype().buffer.from_bytes(v) for key, v in files.items()}
    )
    stores = [on_disk, FeatureStore(zarr.open_group(memory, mode="r+"), tmp_path / "nowhere.zarr")]
    for store in stores:
        assert store.integrity.stored_chunks("done", range(3)) == {0, 1}
        assert store.integrity.stored_chunks("features/a", range(3)) == {0, 1}
        assert store.integrity.missing_objects() == {}
        assert sorted(store.integrity.missing_objects([2])[2]) == ["features/a", "labels", "stats/a", "valid"]
        assert store.stored_bytes() == sum(len(v) for key, v in files.items() if key.startswith("features/"))
        store.integrity.clear_done([1])
        assert store.integrity.stored_chunks("done", range(3)) == {0}
        assert store.done_flags().tolist() == [True, False, False]  # an absent flag reads False
    assert not (tmp_path / "nowhere.zarr").exists()


def test_an_overwrite_sets_aside_every_late_write_of_a_holder_that_lost_the_lock(tmp_path, monkeypatch):
    """A holder that lost its lock can land several writes it checked before the old store went aside,
    one after another, each making its chunk's directories again at --out: the overwrite sets each aside,
    and the new store is whole (CI once saw the second such write refuse the overwrite)."""
    old = _store(tmp_path)
    old.write_chunk(0, 0, 4, {"a": np.ones((4, 2), "float32")}, np.zeros(4), np.ones(4, bool))
    path, real_rename, late_writes = old.path, os.rename, [3]

    def rename_with_late_writes(source, target):
        if Path(target) == path and late_writes[0]:  # the new store about to move in; the old is aside
            late_writes[0] -= 1
            (path / "features" / "a" / "c").mkdir(parents=True, exist_ok=True)
            (path / "features" / "a" / "c" / "0").write_bytes(b"a late chunk")
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename_with_late_writes)
    new = FeatureStore.create(
        path, shapes={"a": (2,)}, num_samples=10, chunk_size=4, dtype="float32", compressor="zstd",
        attrs={"layers": ["a"]}, overwrite=True,
    )  # fmt: skip
    assert late_writes == [0] and not new.done_flags().any()
    assert not (path / "features" / "a" / "c" / "0").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


def test_a_chunks_writes_all_end_before_its_first_error_is_raised():
    """``write_chunk`` gathers a chunk's writes: a failed one (a full disk) must leave none of the others
    still writing once the caller has the error, nor a coroutine left on the loop."""
    import asyncio

    from extract.store import objects

    finished = []

    async def slow(data: bytes) -> None:
        await asyncio.sleep(0.2)
        finished.append(data)

    async def failing() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        objects.run(objects.all_of([failing(), slow(b"kept")]))
    assert finished == [b"kept"]


def test_the_stores_loop_serves_a_forked_child(tmp_path):
    """``objects.run``'s loop lives in a thread of the parent; a forked child (a DataLoader worker) has no
    such thread and must start its own instead of waiting forever on the parent's."""
    from zarr.storage import LocalStore

    from extract.store import objects

    store = LocalStore(tmp_path)
    objects.write(store, "a", b"parent")  # the parent's loop runs now
    pid = os.fork()
    if pid == 0:
        try:
            objects.write(store, "b", objects.read(store, "a") + b" and child")
        finally:
            os._exit(0)
    import signal
    import time

    deadline = time.monotonic() + 60
    while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if waited[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child waited forever on its parent's loop")
    assert waited[1] == 0
    assert objects.read(store, "b") == b"parent and child"
