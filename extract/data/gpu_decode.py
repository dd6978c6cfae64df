"""``--decode nvjpeg``: DataLoader workers only read bytes; batches of JPEGs are decoded on the GPU
with ``torchvision.io.decode_jpeg(list, device=...)`` (batched nvjpeg), then resized, cropped and
normalized there.

The transform on the device is the model's own where it accepts tensors (torchvision's presets do);
otherwise it is rebuilt from the preprocessing description (resize, interpolation, crop, mean, std),
and where that description is incomplete the decoder refuses to start and says so rather than
guess. Non-JPEG files were already decoded and transformed on the CPU by the workers; a JPEG the
device decoder rejects (CMYK, corrupt) is retried alone, then on the CPU path, then reported as a
bad sample like any other. Runs on the CPU too (``decode_jpeg`` does), which is how its batching
and fallbacks are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from ..errors import ExtractError
from .decode import Decoding, Transform

TensorTransform = Callable[[torch.Tensor], torch.Tensor]


def collate_encoded(batch: Sequence[tuple[torch.Tensor, int, int, str]]) -> tuple[Any, ...]:
    """Like the default collate, but images stay a list: encoded JPEGs differ in length."""
    images, labels, indices, errors = zip(*batch, strict=True)
    return list(images), default_collate(labels), default_collate(indices), errors


def is_encoded(image: torch.Tensor) -> bool:
    """A worker's item under nvjpeg: a 1-D uint8 tensor of JPEG bytes, or an already transformed image."""
    return image.dim() == 1 and image.dtype == torch.uint8


def transform_from_description(preprocessing: Mapping[str, Any]) -> TensorTransform:
    """The transform rebuilt for uint8 CHW tensors from the preprocessing description."""
    missing = [k for k in ("mean", "std", "interpolation") if preprocessing.get(k) is None]
    if missing:
        raise ExtractError(
            f"--decode nvjpeg cannot reproduce the model's preprocessing on the GPU: its description lacks "
            f"{', '.join(missing)} ({preprocessing.get('repr', '?')!s:.80}); use --decode pil or draft"
        )
    from torchvision.transforms import InterpolationMode  # on use: a text job imports this module too
    from torchvision.transforms import functional as F

    try:
        interpolation = InterpolationMode(preprocessing["interpolation"])
    except ValueError:
        raise ExtractError(
            f"--decode nvjpeg: interpolation '{preprocessing['interpolation']}' has no tensor version; use --decode pil"
        ) from None
    resize, crop = preprocessing.get("resize"), preprocessing.get("crop")
    mean, std = list(preprocessing["mean"]), list(preprocessing["std"])

    def apply(image: torch.Tensor) -> torch.Tensor:
        if resize is not None:
            size = [resize] if isinstance(resize, int) else list(resize)
            image = F.resize(image, size, interpolation=interpolation, antialias=True)
        if crop is not None:
            image = F.center_crop(image, list(crop))
        return F.normalize(image.float().div_(255), mean, std)

    return apply


def tensor_transform(preprocess: Transform, preprocessing: Mapping[str, Any]) -> tuple[TensorTransform, str]:
    """The model's own transform when it takes uint8 tensors, else one rebuilt from the description;
    returns it with a word on which it is."""
    probe = torch.randint(0, 256, (3, 40, 48), dtype=torch.uint8)
    try:
        out = preprocess(probe)
        if isinstance(out, torch.Tensor) and out.dim() == 3 and out.is_floating_point():
            return preprocess, "the model's own transform, on tensors"
    except (TypeError, AttributeError, ValueError):
        pass
    return transform_from_description(preprocessing), "rebuilt from the preprocessing description"


class GpuDecoder:
    """(list of worker items, indices, errors) -> (batch on ``device``, errors)."""

    def __init__(
        self, decoding: Decoding, preprocessing: Mapping[str, Any], device: torch.device, image_size: int,
        describe: Callable[[int], str],
    ) -> None:  # fmt: skip
        self.transform, self.how = tensor_transform(decoding.transform, preprocessing)
        self.decoding, self.device, self.image_size, self.describe = decoding, device, image_size, describe
        self.fallbacks = 0  # JPEGs the device decoder refused, done on the CPU path instead

    def _decode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        decoded = decode_jpeg(
            data, mode=ImageReadMode.RGB, device=self.device, apply_exif_orientation=self.decoding.exif_transpose
        )
        return decoded if isinstance(decoded, list) else [decoded]

    def _one(self, data: torch.Tensor) -> torch.Tensor:
        """A JPEG the batch decode refused: alone on the device, else the CPU path (PIL)."""
        try:
            return self.transform(self._decode([data])[0])
        except RuntimeError:
            self.fallbacks += 1
            return self.decoding.transform(self.decoding.open(data.numpy().tobytes())).to(self.device)

    def __call__(
        self, images: list[torch.Tensor], indices: torch.Tensor, errors: Sequence[str]
    ) -> tuple[torch.Tensor, list[str]]:
        errors = list(errors)
        out: list[torch.Tensor | None] = [None] * len(images)
        encoded = [i for i, image in enumerate(images) if is_encoded(image) and not errors[i]]
        for i, image in enumerate(images):
            if i not in encoded:
                out[i] = image.to(self.device, non_blocking=True)
        try:
            decoded = self._decode([images[i] for i in encoded]) if encoded else []
            for i, image in zip(encoded, decoded, strict=True):
                out[i] = self.transform(image)
        except RuntimeError:
            for i in encoded:
                try:
                    out[i] = self._one(images[i])
                except Exception as e:  # noqa: BLE001 - a bad sample, reported by the run loop
                    errors[i] = f"{self.describe(int(indices[i]))} ({e.__class__.__name__}: {str(e).splitlines()[0]})"
                    out[i] = torch.zeros(3, self.image_size, self.image_size, device=self.device)
        return torch.stack(out), errors  # type: ignore[arg-type]
