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


# PIL's ImageOps.exif_transpose, on a CHW tensor: EXIF orientation -> the transpose that makes it upright
_ORIENT: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    2: lambda t: t.flip(-1),  # FLIP_LEFT_RIGHT
    3: lambda t: t.flip(-2, -1),  # ROTATE_180
    4: lambda t: t.flip(-2),  # FLIP_TOP_BOTTOM
    5: lambda t: t.transpose(-2, -1),  # TRANSPOSE
    6: lambda t: torch.rot90(t, -1, (-2, -1)),  # ROTATE_270 (a quarter turn clockwise)
    7: lambda t: t.transpose(-2, -1).flip(-2, -1),  # TRANSVERSE
    8: lambda t: torch.rot90(t, 1, (-2, -1)),  # ROTATE_90 (a quarter turn counter-clockwise)
}


def exif_orientation(data: bytes | memoryview) -> int:
    """The EXIF orientation (1-8) of a JPEG, read from its APP1 segment without decoding; 1 where it has none
    or the segment is unreadable (PIL's exif_transpose then leaves the image as it is, too)."""
    data = memoryview(data)
    at = 2
    while at + 4 <= len(data) and data[at] == 0xFF:
        marker, length = data[at + 1], int.from_bytes(data[at + 2 : at + 4], "big")
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no metadata beyond
            return 1
        segment = data[at + 4 : at + 2 + length]
        at += 2 + length
        if marker != 0xE1 or bytes(segment[:6]) != b"Exif\0\0":
            continue
        tiff = segment[6:]
        order = {b"II": "little", b"MM": "big"}.get(bytes(tiff[:2]))
        if order is None or len(tiff) < 8:
            return 1
        ifd = int.from_bytes(tiff[4:8], order)
        if ifd + 2 > len(tiff):
            return 1
        for k in range(int.from_bytes(tiff[ifd : ifd + 2], order)):
            entry = tiff[ifd + 2 + 12 * k : ifd + 14 + 12 * k]
            if len(entry) < 12:
                return 1
            if int.from_bytes(entry[:2], order) == 0x0112:
                value = int.from_bytes(entry[8:10], order)
                return value if 1 <= value <= 8 else 1
        return 1
    return 1


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """``image`` (C, H, W) turned upright as EXIF ``orientation`` says (PIL's exif_transpose)."""
    turn = _ORIENT.get(orientation)
    return image if turn is None else turn(image).contiguous()


class GpuDecoder:
    """(list of worker items, indices, errors) -> (batch on ``device``, errors).

    ``input_size`` is the model's input (H, W) (an int: square): the size of the placeholder of a bad image,
    which must stack with the others. On CUDA the batch is decoded and transformed on a stream of its own,
    for the reason in ``__call__``."""

    def __init__(
        self, decoding: Decoding, preprocessing: Mapping[str, Any], device: torch.device,
        input_size: int | Sequence[int], describe: Callable[[int], str],
    ) -> None:  # fmt: skip
        self.transform, self.how = tensor_transform(decoding.transform, preprocessing)
        self.decoding, self.device, self.describe = decoding, device, describe
        self.input_size = (input_size, input_size) if isinstance(input_size, int) else tuple(input_size)
        self.fallbacks = 0  # JPEGs the device decoder refused, done on the CPU path instead
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _decode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        if self.stream is not None:
            # torchvision allocates the decoded images on the current stream (ours, see __call__) and fills them
            # on a private stream that does not wait for it: nothing queued on ours may still use a block the
            # allocator can hand out, so everything queued there is finished first (earlier decodes and
            # transforms only, never a forward)
            self.stream.synchronize()
        # torchvision's CUDA decoder ignores apply_exif_orientation ("only implemented for JPEG format on
        # CPU") where PIL's path honours --exif-transpose: the orientation is applied here instead, on every
        # device alike, so that one store never mixes turned and unturned photographs.
        decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device, apply_exif_orientation=False)
        decoded = decoded if isinstance(decoded, list) else [decoded]
        if self.decoding.exif_transpose:
            decoded = [orient(image, exif_orientation(d.numpy())) for image, d in zip(decoded, data, strict=True)]
        return decoded

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
        if self.stream is None:
            return self._batch(images, indices, errors)
        # torchvision allocates the decoded images on the caller's current stream and fills them on a private
        # stream that does not wait for it: on the compute stream, a block the queued forward of the previous
        # batch has freed but not finished reading could receive pixels under it. So the decode runs with a
        # stream of ours current: its outputs come from that stream's blocks, and ``_decode`` synchronizes it
        # (our earlier decodes and transforms only, never a forward) so that nothing queued still uses any of
        # them. The compute stream then waits for the batch, and the batch's block is kept from our stream
        # until the forward that reads it is done (record_stream).
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            batch, errors = self._batch(images, indices, errors)
        compute.wait_stream(self.stream)
        batch.record_stream(compute)
        return batch, errors

    def _batch(
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
                    out[i] = torch.zeros(3, *self.input_size, device=self.device)
        return torch.stack(out), errors  # type: ignore[arg-type]
