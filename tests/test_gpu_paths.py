"""The GPU paths' logic, run where it can be emulated on the CPU (issue 49): the tensor-parallel stop flag
over a process group whose backend map has no CPU device (NCCL's), all_gather of unequal shards, the
nvjpeg decoder's EXIF routing and its placeholder for a bad image, and the GPU check refusing to pass
without CUDA. What needs a device is in tests/test_cuda*.py and benchmarks/gpu_check.sh."""

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import patience
from helpers.launches import free_port

# ---------------------------------------------------------------------------------------------------------
# spawned gloo ranks


def _ranks(world: int, target, *args) -> None:
    """``target(rank, world, *args)`` in ``world`` spawned processes joined in a process group; a failure in
    any of them fails the test with its traceback."""
    port = free_port()
    errors = mp.get_context("spawn").Manager().dict()
    mp.spawn(_rank, args=(world, port, errors, target, args), nprocs=world, join=True)
    assert not dict(errors), "\n".join(dict(errors).values())


def _rank(rank: int, world: int, port: int, errors, target, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        target(rank, world, *args)
    except BaseException:  # noqa: BLE001 - reported by the parent, with the rank
        errors[rank] = f"rank {rank}:\n{traceback.format_exc()}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop_flag_over_a_map_without_cpu(rank: int, world: int, which: str) -> None:
    from extract.job.dist import Mesh

    # NCCL's backend map is {cuda: nccl}: "cuda:gloo" gives gloo the same map, with no backend for CPU tensors
    dist.init_process_group("cuda:gloo", rank=rank, world_size=world)
    group = dist.group.WORLD if which == "default" else dist.new_group(list(range(world)))
    mesh = Mesh(0, 1, rank, world, group)
    assert mesh.agree_to_stop(None) is None
    assert mesh.agree_to_stop(15 if rank == world - 1 else None) == 15  # one rank's signal stops the group
    assert mesh.agree_to_stop(2 if rank == 0 else None) == 2


@pytest.mark.parametrize("which", ["default", "new_group"])
def test_the_tensor_parallel_stop_flag_works_over_nccls_backend_map(which):
    _ranks(2, _stop_flag_over_a_map_without_cpu, which)


def _gather_unequal_shards(rank: int, world: int) -> None:
    from extract.capture.sharded import GroupGather

    dist.init_process_group("gloo", rank=rank, world_size=world)
    widths = [3, 2, 2][:world]  # 7 features over 3 ranks (or 5 over 2): the first rank holds one more
    start = sum(widths[:rank])
    full = torch.arange(4 * sum(widths), dtype=torch.float32).reshape(4, sum(widths))
    gather = GroupGather(dist.group.WORLD, world, sharded={"x": sum(widths)})
    for _ in range(2):  # the widths are learnt once, then reused
        out = gather("x", full[:, start : start + widths[rank]])
        assert torch.equal(out, full), (rank, out)
    assert gather("y", full[:, :1]).shape == (4, 1)  # a replicated layer passes through


@pytest.mark.parametrize("world", [2])
def test_all_gather_of_unequal_shards_joins_them_in_rank_order(world):
    _ranks(world, _gather_unequal_shards)


# ---------------------------------------------------------------------------------------------------------
# the nvjpeg decoder: EXIF orientation, the placeholder of a bad image


def _photo(orientation: int | None, size: tuple[int, int] = (96, 64)) -> bytes:
    from helpers.data_files import exif_jpeg

    return exif_jpeg(orientation, size)


def _to_float(image):
    """A transform that takes PIL images and uint8 tensors alike (so the decoder uses it as is)."""
    import numpy as np

    tensor = image if isinstance(image, torch.Tensor) else torch.from_numpy(np.array(image)).permute(2, 0, 1)
    return tensor.float() / 255


def _cuda_like_decode(monkeypatch) -> list:
    """torchvision's decode_jpeg as its CUDA branch behaves: ``apply_exif_orientation`` has no effect there."""
    import torchvision.io as module

    real, calls = module.decode_jpeg, []

    def ignores_exif(data, **kwargs):
        calls.append(kwargs.get("apply_exif_orientation"))
        return real(data, **{**kwargs, "apply_exif_orientation": False})

    monkeypatch.setattr(module, "decode_jpeg", ignores_exif)
    return calls


@pytest.mark.parametrize("exif_transpose", [True, False])
def test_nvjpeg_turns_exif_oriented_jpegs_as_the_pil_path_does(monkeypatch, exif_transpose):
    from extract.data.decode import Decoding
    from extract.data.gpu_decode import GpuDecoder, collate_encoded

    calls = _cuda_like_decode(monkeypatch)
    images = [_photo(o) for o in (6, 8, 3, 1, None)]
    decoding = Decoding(_to_float, "nvjpeg", exif_transpose=exif_transpose)
    pil = Decoding(_to_float, exif_transpose=exif_transpose)
    decoder = GpuDecoder(decoding, {}, torch.device("cpu"), 64, lambda i: f"sample{i}")
    for i, data in enumerate(images):  # one at a time: the turned ones differ in shape from the others
        batch, _, indices, errors = collate_encoded([(decoding(data), 0, i, "")])
        out, errors = decoder(batch, indices, errors)
        expected = pil(data)
        assert not any(errors) and out[0].shape == expected.shape, (i, out.shape, expected.shape)
        diff = (out[0] - expected).abs()
        assert diff.mean() <= 0.01 and diff.max() <= 0.25, (i, diff.mean(), diff.max())
    assert calls  # the decoder went through torchvision's decode_jpeg


def test_exif_orientation_and_its_turns_match_pil():
    import io

    import numpy as np
    from PIL import Image, ImageOps

    from extract.data.gpu_decode import exif_orientation, orient

    pixels = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)
    for orientation in range(1, 9):
        data = _photo(orientation)
        assert exif_orientation(data) == Image.open(io.BytesIO(data)).getexif().get(0x0112)
        image = Image.fromarray(pixels)
        exif = image.getexif()
        exif[0x0112] = orientation
        image.info["exif"] = exif.tobytes()
        upright = np.array(ImageOps.exif_transpose(image))
        turned = orient(torch.from_numpy(pixels).permute(2, 0, 1), orientation).permute(1, 2, 0).numpy()
        assert np.array_equal(turned, upright), orientation
    assert exif_orientation(_photo(None)) == 1
    assert exif_orientation(_photo(6)[:40]) == 1  # cut inside its EXIF: read as none, never an error


def test_the_placeholder_of_a_bad_jpeg_has_the_models_input_size():
    from torchvision.transforms import functional as F

    from extract.data.decode import Decoding
    from extract.data.gpu_decode import GpuDecoder, collate_encoded

    def to_32_by_48(image):  # a model whose input is not square: (H, W) = (32, 48)
        return F.resize(_to_float(image), [32, 48], antialias=True)

    decoding = Decoding(to_32_by_48, "nvjpeg")
    good = _photo(None, (120, 80))
    items = [(decoding(data), 0, i, "") for i, data in enumerate([good, good[:300], good])]
    batch, _, indices, errors = collate_encoded(items)
    decoder = GpuDecoder(decoding, {}, torch.device("cpu"), (32, 48), lambda i: f"sample{i}")
    out, errors = decoder(batch, indices, errors)
    assert out.shape == (3, 3, 32, 48)
    assert errors[1].startswith("sample1 (") and not errors[0] and not errors[2]
    assert not out[1].any()


def test_the_job_gives_the_decoder_the_models_input_height_and_width(monkeypatch):
    """The runner passes the model's (H, W), not its longer side (a square placeholder fails torch.stack)."""
    from types import SimpleNamespace

    from extract.job import runner

    seen = {}

    class Recorder:
        def __init__(self, decoding, preprocessing, device, size, describe):
            seen["size"] = size
            self.how = "recorded"

    monkeypatch.setattr(runner, "GpuDecoder", Recorder)
    monkeypatch.setattr(
        runner, "attach_decoding", lambda dataset, *a, **k: SimpleNamespace(decoding=None, describe=str)
    )
    monkeypatch.setattr(runner, "_check_kinds", lambda *a: None)
    monkeypatch.setattr(runner, "_data_options", lambda spec: None)
    spec = SimpleNamespace(decode="nvjpeg")
    loaded = SimpleNamespace(input_size=(32, 48), preprocess=None, preprocessing={}, kind="images")
    data = SimpleNamespace(dataset=None, notes=[], gpu_decoder=None)
    runner._attach_model(spec, SimpleNamespace(device=torch.device("cpu")), data, loaded)
    assert tuple(seen["size"]) == (32, 48)


# ---------------------------------------------------------------------------------------------------------
# the host side of the CUDA path: what goes up for a text batch, the writer thread's device


def test_a_text_batch_goes_up_once_from_pinned_memory(monkeypatch):
    from types import SimpleNamespace

    import numpy as np

    from extract.job.text import TextBatch
    from extract.job.text_stage import upload

    pinned, sent = [], []
    real_to = torch.Tensor.to

    def pin(self):
        pinned.append(self.data_ptr())
        return self

    def to(self, *args, **kwargs):
        sent.append((self.data_ptr(), kwargs.get("non_blocking", False), self.data_ptr() in pinned))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    ids, mask = torch.arange(12).reshape(2, 6), torch.ones(2, 6, dtype=torch.int64)
    batch = TextBatch(ids, mask, np.arange(10), flat=torch.arange(10))
    layers = SimpleNamespace(selection=SimpleNamespace(mask=None, flat=None, order=None))
    inputs = upload(layers, batch, torch.device("meta"), pin=True)  # meta: a device that is not the host
    assert sorted(inputs) == ["attention_mask", "input_ids"] and inputs["input_ids"].device.type == "meta"
    assert layers.selection.mask is inputs["attention_mask"]  # the mask went up once, for both
    assert len(sent) == 3 and all(non_blocking and was_pinned for _, non_blocking, was_pinned in sent), sent


def test_the_writer_thread_waits_on_each_event_under_its_device(monkeypatch):
    import threading

    from extract.capture.staging import HostStaging, Slot

    active: list = [None]
    seen: dict = {}

    class Guard:  # torch.cuda.device, on a machine without CUDA
        def __init__(self, device):
            self.device, self.before = device, None

        def __enter__(self):
            self.before, active[0] = active[0], self.device

        def __exit__(self, *exc):
            active[0] = self.before

    class Event:
        def synchronize(self):
            seen["device while waiting"] = active[0]

    monkeypatch.setattr(torch.cuda, "device", Guard)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.setdefault("thread's device", device))
    staging = HostStaging({"x": (4,)}, batch_size=2, dtype=torch.float32, device=torch.device("cpu"), slots=1)
    staging._home = 1  # as on the GPU of rank 1
    slot = Slot({"x": torch.zeros(2, 4)}, {})
    gpu = torch.device("cuda", 1)
    slot.sources.add(gpu)
    slot.events[gpu] = Event()
    writer = threading.Thread(target=staging.ready, args=(slot,))
    writer.start()
    writer.join()
    assert seen == {"device while waiting": gpu, "thread's device": 1}


# ---------------------------------------------------------------------------------------------------------
# the GPU check, here where there is no CUDA


def _gpu_check_test_lines() -> list[list[str]]:
    """The commands of benchmarks/gpu_check.sh's steps that run pytest, as argument lists for this machine."""
    import shlex
    import sys

    from helpers import ROOT

    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if not line.startswith("step ") or not ("cuda_tests.sh" in line or "-m pytest" in line):
            continue
        words = shlex.split(line.replace('"$PY"', shlex.quote(sys.executable)).replace("$OUTDIR", "/tmp"))[3:]
        if words[0] == "--dry":
            words = words[words.index("--") + 1 :]
        commands.append(words)
    return commands


@pytest.mark.skipif(torch.cuda.is_available(), reason="what the GPU check does without CUDA")
def test_the_gpu_checks_test_steps_fail_without_cuda_and_say_why():
    import sys

    from helpers import ROOT

    commands = _gpu_check_test_lines()
    assert len(commands) >= 4, commands
    # one line per test file: they differ only in -k and where the XML goes (each start costs a torch import)
    commands = list({next(w for w in c if w.startswith("tests/")): c for c in commands}.values())
    env = {k: v for k, v in os.environ.items() if k not in ("EXTRACT_REQUIRE_CUDA", "PYTEST_ADDOPTS")}
    env["PY"] = sys.executable
    for command in commands:
        done = patience.run(command, capture_output=True, text=True, quiet=120, cwd=ROOT, env=env)
        said = done.stdout + done.stderr
        assert done.returncode != 0, (command, said[-2000:])
        assert "torch.cuda.is_available() is False" in said and "unrecognized arguments" not in said, said[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="what the GPU check does without CUDA")
def test_the_gpu_check_fails_without_cuda(tmp_path):

    from helpers import ROOT

    done = patience.run(["bash", "benchmarks/gpu_check.sh", str(tmp_path)], capture_output=True, text=True,
                        quiet=30, cwd=ROOT)  # fmt: skip
    assert done.returncode == 1 and "no CUDA device" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
