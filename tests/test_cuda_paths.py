"""CUDA-only checks of issue 49's GPU paths, run by benchmarks/gpu_check.sh (benchmarks/cuda_tests.sh): the
``record_stream`` of a staged source, the float16 overflow check on the device, the nvjpeg race and EXIF
orientation, the writer thread's device, ``--sae`` statistics copied with the slot, and the tensor-parallel
stop flag over NCCL. Their CPU emulations are in tests/test_gpu_paths.py.

Deselected by default (``-m 'not cuda'``); skipped without CUDA, except under ``EXTRACT_REQUIRE_CUDA=1``
(the GPU check), where no CUDA device fails the run (tests/conftest.py).
"""

import threading

import numpy as np
import pytest
import torch
from helpers.data_files import exif_jpeg

from extract.capture.staging import HostStaging
from extract.errors import CastOverflowError

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s on a 1.5-2 GHz GPU, far longer than the work queued after it


def _staged_after_the_source_is_dropped() -> torch.Tensor:
    """Stage a batch whose copy is held behind a sleep on the copy stream, drop the source, then allocate and
    fill tensors of its size on the compute stream; returns the staged rows (all 3.0 where the source's
    block was kept from reuse until the copy read it)."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no cached block of this size from an earlier test: only the two freed below
    rows, width = 4, 1 << 20  # 16 MiB of float32: large blocks, reused by size from the stream's pool
    staging = HostStaging({"x": (width,)}, batch_size=rows, dtype=torch.float32, device=device, slots=1)
    staging.copy_streams[device] = stream = torch.cuda.Stream(device)
    slot = staging.acquire()
    value = torch.full((rows, width), 3.0, device=device)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(CYCLES)  # the copy queued next waits behind this
    staging.stage("x", value)  # copies a fresh tensor (value.to(copy=True)) on the side stream
    del value  # the source and the fresh copy are both free to the allocator now
    others = [torch.full((rows, width), -1.0, device=device) for _ in range(3)]  # one would get the fresh block
    staging.seal(slot)
    HostStaging.wait(slot)
    torch.cuda.synchronize()
    del others
    return slot.buffers["x"][:rows].clone()


def test_record_stream_keeps_a_staged_source_until_its_copy_has_read_it():
    staged = _staged_after_the_source_is_dropped()
    assert bool((staged == 3.0).all()), f"staged rows overwritten: {staged.unique()[:8].tolist()}"


def test_without_record_stream_the_same_check_sees_the_source_overwritten(monkeypatch):
    """The check above is not vacuous: with record_stream made a no-op, the fill lands before the copy."""
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    staged = _staged_after_the_source_is_dropped()
    assert not bool((staged == 3.0).all()), "the allocator did not reuse the block: the check proves nothing here"


def test_the_float16_overflow_check_on_the_device():
    device = torch.device("cuda", torch.cuda.current_device())
    staging = HostStaging({"x": (8,)}, batch_size=2, dtype=torch.float16, device=device, slots=2)
    slot = staging.acquire()
    beyond = torch.tensor([[1.0] * 8, [7e4] * 8], dtype=torch.bfloat16, device=device)  # bf16 holds 7e4
    staging.stage("x", beyond)
    staging.seal(slot)
    with pytest.raises(CastOverflowError, match="layer 'x' reaches"):
        staging.ready(slot)
    staging.release(slot)
    slot = staging.acquire()
    own = torch.tensor([[1.0] * 8, [float("inf"), -float("inf"), float("nan")] + [2.0] * 5], device=device)
    staging.stage("x", own.to(torch.bfloat16))  # the model's own inf and NaN: stored as computed
    staging.seal(slot)
    staging.ready(slot)
    stored = slot.buffers["x"][:2].float()
    assert torch.isinf(stored[1, :2]).all() and torch.isnan(stored[1, 2]) and (stored[0] == 1).all()


def _to_float(image):
    tensor = image if isinstance(image, torch.Tensor) else torch.from_numpy(np.array(image)).permute(2, 0, 1)
    return tensor.float() / 255


def test_nvjpeg_decodes_into_no_block_a_queued_forward_still_reads():
    """Tensors of the decoded images' size are summed behind a sleep on the compute stream, then freed; the
    decode that follows must not write into their blocks before the sums have read them."""
    from extract.data.decode import Decoding
    from extract.data.gpu_decode import GpuDecoder, collate_encoded

    device = torch.device("cuda", torch.cuda.current_device())
    size = (1024, 768)  # (w, h): a decoded image is 3 x 768 x 1024 bytes
    images = [exif_jpeg(None, size, seed=i) for i in range(4)]
    decoding = Decoding(_to_float, "nvjpeg")
    decoder = GpuDecoder(decoding, {}, device, (768, 1024), str)
    batch, _, indices, errors = collate_encoded([(decoding(data), 0, i, "") for i, data in enumerate(images)])
    decoder(batch, indices, errors)  # warm: nvjpeg's state, the stream
    torch.cuda.synchronize()
    bad = 0
    for _ in range(20):
        pending = [torch.full((3, 768, 1024), 7, dtype=torch.uint8, device=device) for _ in images]
        torch.cuda._sleep(CYCLES // 4)
        sums = [p.sum(dtype=torch.int64) for p in pending]  # queued behind the sleep
        del pending  # their blocks are free to the allocator while the sums still wait to read them
        decoder(batch, indices, errors)
        torch.cuda.synchronize()
        bad += sum(int(s) != 7 * 3 * 768 * 1024 for s in sums)
    assert bad == 0, f"{bad} of {20 * len(images)} sums read decoded pixels"


@pytest.mark.parametrize("orientation", [6, 8, 3])
def test_nvjpeg_turns_exif_oriented_jpegs_as_pil_does(orientation):
    from extract.data.decode import Decoding
    from extract.data.gpu_decode import GpuDecoder, collate_encoded

    device = torch.device("cuda", torch.cuda.current_device())
    data = exif_jpeg(orientation, (96, 64))
    decoding = Decoding(_to_float, "nvjpeg", exif_transpose=True)
    decoder = GpuDecoder(decoding, {}, device, 64, str)
    batch, _, indices, errors = collate_encoded([(decoding(data), 0, 0, "")])
    out, errors = decoder(batch, indices, errors)
    expected = Decoding(_to_float, exif_transpose=True)(data)
    assert not any(errors) and out[0].shape == expected.shape
    diff = (out[0].cpu() - expected).abs()
    assert diff.mean() <= 0.02, diff.mean()  # nvjpeg's IDCT against libjpeg-turbo's: a few levels


def test_the_writer_thread_works_on_the_staging_device():
    """With 2 GPUs, on GPU 1: the writer thread's current device is 1, not the 0 a new thread starts on."""
    index = torch.cuda.device_count() - 1
    device = torch.device("cuda", index)
    seen = {}
    with torch.cuda.device(index):
        staging = HostStaging({"x": (16,)}, batch_size=4, dtype=torch.float16, device=device, slots=1)
        slot = staging.acquire()
        staging.stage("x", torch.randn(4, 16, device=device))
        staging.seal(slot)

    def writer():
        staging.ready(slot)
        seen["device"] = torch.cuda.current_device()

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen["device"] == index


def test_sae_statistics_travel_with_the_slot_into_pinned_memory():
    from extract.capture.sae import LatentStats

    device = torch.device("cuda", torch.cuda.current_device())

    class Encoder:  # the SaeEncoder surface staging uses: codes are the rows' top 2 entries
        k, dtype, values_dtype, d_sae = 2, "float32", "float32", 6

        def new_stats(self, where):
            return LatentStats.zeros(self.d_sae, where)

        def raw(self, rows):
            return rows

        def encode(self, rows, stats):
            values, indices = rows.topk(2, dim=1)
            stats.update(rows, values, 2)
            return type("Codes", (), {"indices": indices.int(), "values": values})()

    staging = HostStaging({"x": (6,)}, 4, torch.float32, device, slots=1, encoders={"x": Encoder()})
    slot = staging.acquire()
    staging.segments = [(0, 0, 3), (1, 3, 4)]  # the batch straddles chunks 0 and 1
    rows = torch.arange(24, dtype=torch.float32, device=device).reshape(4, 6)
    staging.stage("x", rows)
    staging.seal(slot)
    staging.ready(slot)
    for chunk, (first, end) in {0: (0, 3), 1: (3, 4)}.items():
        stats = slot.latent_stats["x"][chunk]
        assert stats.count.device.type == "cpu" and stats.count.is_pinned()
        np.testing.assert_array_equal(stats.sum.numpy(), rows[first:end].sum(0).double().cpu().numpy())
        assert float(stats.rows) == end - first


def test_the_stop_flag_over_nccl_on_one_gpu():
    """An NCCL world of 1 and a group of 1: the flag is not a CPU tensor on NCCL (which has no CPU backend)."""
    import socket

    import torch.distributed as dist

    from extract.job.dist import Mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(torch.cuda.current_device())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        with pytest.raises(RuntimeError):  # what the old flag did at every tensor-parallel job's first batch
            dist.all_reduce(torch.tensor([1]), group=group)
        for tp_group in (dist.group.WORLD, group):
            mesh = Mesh(0, 1, 0, 1, tp_group)
            assert mesh.agree_to_stop(None) is None and mesh.agree_to_stop(15) == 15
    finally:
        dist.destroy_process_group()


def test_block_statistics_travel_with_the_slot_into_pinned_memory():
    """Issue 45's statistics of whole blocks, computed on the device, reach the writer as issue 49's --sae
    statistics do: copied with the slot into pinned host tensors, equal to the device's."""
    from extract.capture.block_stats import block_stats
    from extract.names.stats import BLOCK_ROWS

    device = torch.device("cuda", torch.cuda.current_device())
    rows = 3 * BLOCK_ROWS
    staging = HostStaging({"x": (40,)}, rows, torch.float32, device, slots=1, stats={"x": None}, chunk_size=rows)
    slot = staging.acquire()
    staging.rows = np.arange(rows)
    values = torch.randn(rows, 40, device=device)
    staging.stage("x", values)
    staging.seal(slot)
    staging.ready(slot)
    part = slot.block_stats["x"][0]
    expected = block_stats(values, 0)
    for name in ("sums", "squares", "norm_squared", "peak", "beyond", "infinite"):
        host = getattr(part, name)
        assert host.device.type == "cpu" and host.is_pinned(), name
        torch.testing.assert_close(host, getattr(expected, name).cpu(), rtol=0, atol=0)


def test_a_text_batch_goes_up_pinned_and_once(monkeypatch):
    from types import SimpleNamespace

    from extract.job.text import TextBatch
    from extract.job.text_stage import upload

    device = torch.device("cuda", torch.cuda.current_device())
    real_pin, pinned = torch.Tensor.pin_memory, []

    def pin(self):
        out = real_pin(self)
        pinned.append(out)
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    ids, mask = torch.arange(12).reshape(2, 6), torch.ones(2, 6, dtype=torch.int64)
    batch = TextBatch(ids, mask, np.arange(10), flat=torch.arange(10))
    layers = SimpleNamespace(selection=SimpleNamespace(mask=None, flat=None, order=None))
    inputs = upload(layers, batch, device)
    torch.cuda.synchronize()
    assert len(pinned) == 3 and all(p.is_pinned() for p in pinned)
    assert layers.selection.mask is inputs["attention_mask"] and inputs["input_ids"].device == device
    assert torch.equal(inputs["input_ids"].cpu(), ids) and torch.equal(layers.selection.flat.cpu(), batch.flat)
