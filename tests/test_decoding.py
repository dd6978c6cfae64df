"""Decoding: --decode draft against full decoding, the identity refusing to mix them, and the
nvjpeg path's batching and fallbacks, run on the CPU (decode_jpeg runs there too)."""

import io

import numpy as np
import pytest
import skimage.data
import torch
from helpers.cli import SMALL
from helpers.data_files import write_shards
from helpers.reference import preset
from PIL import Image
from torchvision import transforms as T

from extract import open_features
from extract.data import DataOptions, build_dataset
from extract.data.decode import Decoding
from extract.data.gpu_decode import GpuDecoder, collate_encoded, tensor_transform, transform_from_description
from extract.errors import ExtractError
from extract.models import preprocessing_record

# Normalized units (after mean/std). Draft: 2000x1500 JPEGs at crop 224 (DCT scale 1/4), measured max
# 0.105-0.21, mean 0.005-0.010 (benchmarks/RESULTS.md also has a harder case). nvjpeg: tensor resize vs
# PIL resize, both antialiased.
DRAFT_MAX, DRAFT_MEAN = 0.25, 0.012
NVJPEG_MAX, NVJPEG_MEAN = 0.35, 0.02


def photo(name: str, size: tuple[int, int], fmt: str = "JPEG", mode: str = "RGB") -> bytes:
    image = Image.fromarray(getattr(skimage.data, name)()).convert("RGB").resize(size, Image.LANCZOS)
    buffer = io.BytesIO()
    image.convert(mode).save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


@pytest.mark.parametrize("name", ["coffee", "astronaut"])
def test_draft_stays_within_tolerance_of_full_decoding(name):
    data = photo(name, (2000, 1500))
    transform = preset(224)
    draft = Decoding(transform, "draft", preprocessing=preprocessing_record(transform))
    assert draft.open(data).size == (500, 375)  # 1/4 scale: the shorter side still covers the resize (256)
    diff = (draft(data) - Decoding(transform)(data)).abs()
    assert diff.max() <= DRAFT_MAX and diff.mean() <= DRAFT_MEAN, (diff.max(), diff.mean())
    png = photo(name, (300, 200), "PNG")
    assert torch.equal(draft(png), Decoding(transform)(png))  # only JPEGs are drafted


def test_draft_needs_a_resize_target():
    with pytest.raises(ExtractError, match="--decode draft needs the resize target"):
        Decoding(lambda image: image, "draft", preprocessing=preprocessing_record(lambda image: image))


def test_the_identity_refuses_to_mix_draft_and_full_decoding(cli, tmp_path, png_tree):
    root, _ = png_tree
    out = tmp_path / "d.zarr"
    assert cli(*SMALL, "--data", f"imagefolder:{root}", "--out", out)[0] == 0
    before = (out / "zarr.json").read_text()
    code, _, err = cli(*SMALL, "--data", f"imagefolder:{root}", "--out", out, "--decode", "draft")
    assert code == 2 and "differs in: decode" in err
    assert (out / "zarr.json").read_text() == before
    code, _, err = cli(*SMALL, "--data", f"imagefolder:{root}", "--out", out, "--exif-transpose")
    assert code == 2 and "differs in: exif_transpose" in err


def test_exif_transpose_is_off_by_default_and_rotates_when_asked():
    image = Image.fromarray(np.arange(40 * 60 * 3, dtype=np.uint8).reshape(40, 60, 3))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees when shown
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif)
    data = buffer.getvalue()
    assert Decoding(lambda x: x).open(data).size == (60, 40)
    assert Decoding(lambda x: x, exif_transpose=True).open(data).size == (40, 60)


def nvjpeg_items(images: list[bytes], transform) -> tuple[list, GpuDecoder, list]:
    """What the workers hand the main process under --decode nvjpeg, and a decoder on the CPU."""
    decoding = Decoding(transform, "nvjpeg")
    items = [(decoding(data), 0, i, "") for i, data in enumerate(images)]
    decoder = GpuDecoder(decoding, preprocessing_record(transform), torch.device("cpu"), 64, lambda i: f"sample{i}")
    return items, decoder, collate_encoded(items)


def test_nvjpeg_batch_matches_the_cpu_path_and_falls_back_for_png_and_bad_jpegs():
    images = [photo("coffee", (300, 200)), photo("chelsea", (226, 150), "PNG"), photo("rocket", (320, 214))]
    images.append(images[0][:300])  # a JPEG cut short
    images.append(photo("astronaut", (200, 200), mode="L"))  # grayscale JPEG
    transform = preset(64)
    items, decoder, (batch, labels, indices, errors) = nvjpeg_items(images, transform)
    assert [tuple(image.shape) for image in batch][1] == (3, 64, 64)  # the PNG was done by the worker
    assert batch[0].dim() == 1 and batch[0].dtype == torch.uint8  # JPEGs stay bytes
    out, errors = decoder(batch, indices, errors)
    assert out.shape == (5, 3, 64, 64)
    assert errors[3].startswith("sample3 (") and not any(errors[:3] + errors[4:])
    cpu = Decoding(transform)
    for i in (0, 1, 2, 4):
        diff = (out[i] - cpu(images[i])).abs()
        assert diff.max() <= NVJPEG_MAX and diff.mean() <= NVJPEG_MEAN, (i, diff.max(), diff.mean())


def test_nvjpeg_decodes_alone_what_the_batch_decoder_refuses(monkeypatch):
    import torchvision.io as module  # gpu_decode imports its decode_jpeg on use

    images = [photo("coffee", (300, 200)), photo("rocket", (320, 214))]
    _, decoder, (batch, _, indices, errors) = nvjpeg_items(images, preset(64))
    whole, _ = decoder(batch, indices, errors)
    real = module.decode_jpeg

    def refuses_batches(data, **kwargs):
        if len(data) > 1:
            raise RuntimeError("nvjpeg: batch refused")
        return real(data, **kwargs)

    monkeypatch.setattr(module, "decode_jpeg", refuses_batches)
    alone, errors = decoder(batch, indices, errors)
    assert torch.equal(alone, whole) and not any(errors) and decoder.fallbacks == 0

    monkeypatch.setattr(module, "decode_jpeg", lambda data, **kwargs: (_ for _ in ()).throw(RuntimeError("no")))
    on_cpu, errors = decoder(batch, indices, errors)
    assert not any(errors) and decoder.fallbacks == 2
    assert torch.allclose(on_cpu[0], Decoding(preset(64))(images[0]))


def test_a_transform_that_takes_no_tensors_is_rebuilt_or_refused():
    pil_only = T.Compose([T.Resize(37), T.CenterCrop(32), T.ToTensor(), T.Normalize([0.5] * 3, [0.25] * 3)])
    described = {"repr": "Compose(...)", "mean": [0.5] * 3, "std": [0.25] * 3, "interpolation": "bilinear",
                 "resize": 37, "crop": [32, 32]}  # fmt: skip
    rebuilt, how = tensor_transform(pil_only, described)
    assert how.startswith("rebuilt")
    image = Image.open(io.BytesIO(photo("coffee", (90, 60))))
    as_tensor = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()
    assert (rebuilt(as_tensor) - pil_only(image)).abs().max() <= NVJPEG_MAX
    assert tensor_transform(preset(32), {})[1].startswith("the model's own")
    with pytest.raises(ExtractError, match="cannot reproduce.*lacks mean, std"):
        transform_from_description({**described, "mean": None, "std": None})


def test_nvjpeg_end_to_end_on_the_cpu_matches_pil(cli, tmp_path):
    root = tmp_path / "shards"
    write_shards(root, [4, 3])  # one PNG among them
    base = [*SMALL, "--data", f"wds:{root}", "--batch-size", "3", "--chunk-size", "2"]
    assert cli(*base, "--out", tmp_path / "pil.zarr")[0] == 0
    code, _, err = cli(*base, "--out", tmp_path / "nv.zarr", "--decode", "nvjpeg")
    assert code == 0, err
    pil, nv = open_features(tmp_path / "pil.zarr"), open_features(tmp_path / "nv.zarr")
    assert nv.keys.tolist() == pil.keys.tolist() and nv.labels.tolist() == pil.labels.tolist()
    assert nv.attrs["identity"]["decode"] == "nvjpeg"
    scale = np.abs(pil.load("layer3")).mean()
    assert np.abs(nv.load("layer3") - pil.load("layer3")).mean() <= 0.05 * scale


def test_options_reach_the_sources(tmp_path):
    root = tmp_path / "s"
    write_shards(root, [2])
    source = build_dataset(f"wds:{root}", preset(32), 32, DataOptions(decode="nvjpeg"))
    assert source[0][0].dim() == 1 and source.decoding.mode == "nvjpeg"
