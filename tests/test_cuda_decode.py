"""CUDA-only: ``--decode nvjpeg`` (batched nvjpeg + the transform on the GPU) against the CPU path.
Run by benchmarks/gpu_check.sh (``pytest -m cuda``); deselected by default and skipped without CUDA.

Tolerances, normalized units: the CPU-run tests' (tensor vs PIL resizing, tests/test_decoding.py)
plus nvjpeg's IDCT, which may differ from libjpeg-turbo's by a few levels: max 0.5, mean 0.03 per
pixel; stored features within 5% (mean absolute difference relative to the mean magnitude).
"""

import io

import numpy as np
import pytest
import torch
from helpers.data_files import encoded_image, write_shards
from helpers.reference import preset
from PIL import Image

from extract import open_features
from extract.data.decode import Decoding
from extract.data.gpu_decode import GpuDecoder, collate_encoded
from extract.models import preprocessing_record

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PIXEL_MAX, PIXEL_MEAN, FEATURES_RELATIVE = 0.5, 0.03, 0.05


def grayscale_jpeg(seed: int, size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(encoded_image(seed, "PNG", size))).convert("L").save(buffer, format="JPEG")
    return buffer.getvalue()


def test_nvjpeg_on_the_gpu_matches_the_cpu_path():
    images = [
        encoded_image(1, "JPEG", (600, 400)),
        encoded_image(2, "PNG", (226, 150)),
        encoded_image(3, "JPEG", (640, 427)),
    ]
    images += [images[0][:300], grayscale_jpeg(4, (512, 512))]  # cut short; grayscale
    transform = preset(224)
    decoding = Decoding(transform, "nvjpeg")
    batch, _, indices, errors = collate_encoded([(decoding(data), 0, i, "") for i, data in enumerate(images)])
    decoder = GpuDecoder(decoding, preprocessing_record(transform), torch.device("cuda"), 224, lambda i: f"sample{i}")
    out, errors = decoder(batch, indices, errors)
    assert out.device.type == "cuda" and out.shape == (5, 3, 224, 224)
    assert errors[3].startswith("sample3 (") and not any(errors[:3] + errors[4:])
    cpu = Decoding(transform)
    for i in (0, 1, 2, 4):
        diff = (out[i].cpu() - cpu(images[i])).abs()
        assert diff.max() <= PIXEL_MAX and diff.mean() <= PIXEL_MEAN, (i, diff.max(), diff.mean())


def test_nvjpeg_job_matches_the_pil_job(tmp_path):
    from extract.job.runner import run
    from extract.job.spec import JobSpec

    write_shards(tmp_path / "shards", [10, 7])
    stores = {}
    for decode in ("pil", "nvjpeg"):
        out = tmp_path / f"{decode}.zarr"
        spec = JobSpec(model="resnet18", weights="none", layers=["layer3"], pool="avg", data=f"wds:{tmp_path / 'shards'}",
                       out=str(out), batch_size=8, num_workers=2, image_size=64, dtype="float32", precision="fp32",
                       decode=decode)  # fmt: skip
        run(spec, log=lambda _: None)
        stores[decode] = open_features(out)
    pil, nv = stores["pil"].load("layer3"), stores["nvjpeg"].load("layer3")
    assert stores["nvjpeg"].keys.tolist() == stores["pil"].keys.tolist()
    assert np.abs(nv - pil).mean() <= FEATURES_RELATIVE * np.abs(pil).mean()
