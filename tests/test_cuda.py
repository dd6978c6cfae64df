"""CUDA-only checks of the async copy path: run by benchmarks/gpu_check.sh (``pytest -m cuda``).

Deselected by default (pyproject addopts ``-m 'not cuda'``) and skipped where there is no CUDA device.
"""

import numpy as np
import pytest
import torch
import zarr
from helpers.reference import reference, resnet18, synthetic_images
from torch import nn

from extract import Capture
from extract.capture.staging import HostStaging
from extract.store.chunks import Plan
from extract.store.store import FeatureStore
from extract.store.writer import ChunkWriter

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def slow_product(n: int = 4096, repeats: int = 4) -> torch.Tensor:
    """A tensor the compute stream is still busy producing when this returns (queued matmuls)."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    a = torch.randn(n, n, device=DEVICE, generator=g) / n**0.5
    out = a
    for _ in range(repeats):
        out = out @ a
    return out


def submit(writer: ChunkWriter, slot, indices: torch.Tensor, labels: torch.Tensor) -> None:
    writer.submit(slot, indices, labels, np.ones(len(indices), dtype=bool))


def test_pinned_slots_are_reused():
    staging = HostStaging({"a": (64,), "b": (8, 8)}, batch_size=16, dtype=torch.float16, device=DEVICE, slots=3)
    slots = [staging.acquire() for _ in range(3)]
    pointers = {(s.buffers["a"].data_ptr(), s.buffers["b"].data_ptr()) for s in slots}
    assert len(pointers) == 3
    assert all(buffer.is_pinned() for s in slots for buffer in s.buffers.values())
    for slot in slots:
        staging.release(slot)
    again = [staging.acquire() for _ in range(3)]
    assert {(s.buffers["a"].data_ptr(), s.buffers["b"].data_ptr()) for s in again} == pointers
    assert all(buffer.is_pinned() for s in again for buffer in s.buffers.values())


def test_side_stream_copy_sees_the_value_before_a_later_in_place_op():
    staging = HostStaging({"x": (4096,)}, batch_size=64, dtype=torch.float32, device=DEVICE, slots=1)
    slot = staging.acquire()
    source = slow_product()[:64]
    expected = source.clone()  # ordered on the compute stream, before the in-place op below
    staging.stage("x", source)
    source.mul_(-2).add_(7)  # in place, on the compute stream, right after the hook returned
    staging.seal(slot)
    HostStaging.wait(slot)
    torch.cuda.synchronize()
    assert torch.equal(slot.buffers["x"][:64], expected.cpu())
    assert not torch.equal(slot.buffers["x"][:64], source.cpu())


def test_in_place_relu_after_captured_bn1_through_a_real_model():
    model = resnet18().to(DEVICE)
    assert isinstance(model.relu, nn.ReLU) and model.relu.inplace
    x = torch.randn(8, 3, 64, 64, device=DEVICE)
    staging = HostStaging({"bn1": (64, 32, 32)}, batch_size=8, dtype=torch.float32, device=DEVICE, slots=1)
    slot = staging.acquire()
    with torch.inference_mode(), Capture(model, ["bn1"], stop=False, sink=staging.stage):
        model(x)
    staging.seal(slot)
    HostStaging.wait(slot)
    staged = slot.buffers["bn1"][:8]
    assert (staged < 0).any(), "the copy must hold bn1's output, not the ReLU'd tensor"
    with torch.inference_mode():
        expected = model.bn1(model.conv1(x)).cpu()
    torch.testing.assert_close(staged, expected, atol=1e-4, rtol=1e-4)


def test_writer_reads_only_after_the_slots_event(tmp_path):
    shapes = {"x": (4096,)}
    store = FeatureStore.create(
        tmp_path / "s.zarr",
        shapes=shapes,
        num_samples=64,
        chunk_size=32,
        dtype="float32",
        compressor="none",
        attrs={"layers": ["x"]},
    )
    staging = HostStaging(shapes, batch_size=32, dtype=torch.float32, device=DEVICE, slots=2)
    writer = ChunkWriter(store, staging, Plan(64, 32), shapes, threads=1)
    expected = []
    for start in (0, 32):
        slot = staging.acquire(writer.check)
        value = slow_product(repeats=6)[:32] + start
        expected.append(value.clone())
        staging.stage("x", value)
        value.zero_()
        staging.seal(slot)
        # The writer thread gets the slot while the copies are still queued: it must wait on the event.
        submit(writer, slot, torch.arange(start, start + 32), torch.zeros(32, dtype=torch.int64))
    writer.close()
    stored = zarr.open_group(tmp_path / "s.zarr", mode="r")["features/x"][:]
    np.testing.assert_array_equal(stored, torch.cat(expected).cpu().numpy())


@pytest.fixture
def no_tf32():
    """fp32 convolutions and matmuls in full precision, so the GPU can be compared with the CPU."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


LAYERS = ["layer1", "layer3", "layer4"]


def _run(out, precision: str, dtype: str = "float32", channels_last: bool = False) -> dict[str, np.ndarray]:
    """The resnet18 job on CUDA; its stored layers as float32, next to the CPU float32 reference's."""
    from extract import open_features
    from extract.job.runner import run
    from extract.job.spec import JobSpec

    spec = JobSpec(
        model="resnet18", weights="none", layers=LAYERS, data="synthetic:40", out=str(out), batch_size=16,
        num_workers=0, image_size=64, dtype=dtype, precision=precision, chunk_size=8, channels_last=channels_last,
    )  # fmt: skip
    summary = run(spec, log=lambda _: None)
    assert summary.samples == 40
    group = zarr.open_group(out, mode="r")
    assert group.attrs["status"] == "complete" and group.attrs["precision"] == precision
    features = open_features(out)
    return {name: np.asarray(features.load(name), dtype=np.float32) for name in LAYERS}


def _reference() -> dict[str, np.ndarray]:
    return reference(resnet18(), synthetic_images(40, 64), {n: (n, None) for n in LAYERS})


def _record(name: str, values: dict) -> None:
    """A measured deviation, kept where the GPU check collects its results (EXTRACT_GPU_CHECK_OUT)."""
    import json
    import os

    print(name, values)
    folder = os.environ.get("EXTRACT_GPU_CHECK_OUT")
    if folder:
        with open(os.path.join(folder, "deviations.jsonl"), "a") as file:
            file.write(json.dumps({"case": name, **values}) + "\n")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_full_pipeline_on_cuda_equals_cpu_float32(tmp_path, precision, no_tf32):
    stored, expected = _run(tmp_path / f"{precision}.zarr", precision), _reference()
    for name in LAYERS:
        assert stored[name].shape == expected[name].shape
        if precision == "fp32":
            assert np.abs(stored[name] - expected[name]).max() <= 1e-3, name
        else:
            error = np.linalg.norm(stored[name] - expected[name]) / np.linalg.norm(expected[name])
            assert error <= 5e-2, (name, error)


# per-value relative error of the storage dtype's rounding (float16: 11 bits, bfloat16: 8), with room for
# the GPU's summation order
STORAGE = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_full_pipeline_in_each_storage_dtype_and_layout(tmp_path, dtype, channels_last, no_tf32):
    stored, expected = _run(tmp_path / "s.zarr", "fp32", dtype, channels_last), _reference()
    for name in LAYERS:
        deviation = np.abs(stored[name] - expected[name])
        bound = STORAGE[dtype] * np.abs(expected[name]) + 1e-3 * np.abs(expected[name]).max()
        assert (deviation <= bound).all(), (name, float((deviation / np.maximum(bound, 1e-12)).max()))


def test_fp32_as_users_get_it_tf32_convolutions(tmp_path):
    """``--precision fp32`` on a GPU runs under torch's defaults: cuDNN convolutions in TF32 (allow_tf32 on),
    matmuls in full fp32 (docs/cli.md). Measured, recorded, and held to TF32's 10-bit mantissa."""
    assert torch.backends.cudnn.allow_tf32, "torch's default changed: docs/cli.md's --precision row says otherwise"
    stored, expected = _run(tmp_path / "tf32.zarr", "fp32"), _reference()
    deviations = {}
    for name in LAYERS:
        scale = float(np.abs(expected[name]).max())
        deviations[name] = float(np.abs(stored[name] - expected[name]).max()) / scale
    _record("fp32 (TF32 convolutions, torch's default)", {"max |a - b| / max |b|": deviations})
    assert all(value <= 2e-2 for value in deviations.values()), deviations


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_statistics_on_the_gpu_equal_the_hosts_bit_for_bit(tmp_path, dtype):
    """Issue 45: the whole blocks of each chunk's rows get their statistics on the GPU before the copy
    (``capture/block_stats.py``); elementwise float32 operations round as on the host, so the store's
    statistics are the host's alone bit for bit, whatever the batches (and so the process count); a
    second run on the GPU gives the same bits."""
    from helpers.stats_reference import staged_store

    rng = np.random.default_rng(3)
    layers = {
        "h": (rng.standard_normal((150, 300)) * np.exp(rng.normal(0, 2, 300))).astype(np.float32),
        "m": rng.standard_normal((150, 24, 3, 5)).astype(np.float32),
    }
    layers["h"][17] = np.nan
    host = staged_store(tmp_path / "host.zarr", layers, dtype, 64, 50, "cpu", device_stats=False)
    for batch in (7, 64, 150, 150):
        gpu = staged_store(tmp_path / f"gpu-{batch}-{len(list(tmp_path.iterdir()))}.zarr", layers, dtype, 64, batch,
                           "cuda", device_stats=True)  # fmt: skip
        for layer in layers:
            np.testing.assert_array_equal(gpu.array(f"stats/{layer}")[:], host.array(f"stats/{layer}")[:])
