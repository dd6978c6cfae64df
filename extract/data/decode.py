"""Turning a source's raw image into the model's input on the CPU: PIL decoding (in full, or at a
reduced JPEG DCT scale with ``--decode draft``), optional EXIF orientation, then the model's own
transform."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps

from ..errors import ExtractError
from ..names import DECODES

RawImage = bytes | Image.Image | torch.Tensor
Transform = Callable[[Any], torch.Tensor]

JPEG_MAGIC = b"\xff\xd8\xff"


def stored_image(value: Any, beside: Path | None = None) -> RawImage:
    """A cell of an image column: bytes, or Hugging Face's ``{bytes, path}`` struct (bytes, else the
    file at path); an empty one is an error the run reports as a bad sample.

    A relative path is opened as ``datasets`` opens it, from the working directory; where no file is
    there, from the folder ``beside`` (the Parquet file's), so that a run from elsewhere finds them."""
    if isinstance(value, dict):
        data = value.get("bytes")
        if data is None and value.get("path"):
            data = _read_image_file(value["path"], beside)
        value = data
    if value is None:
        raise ValueError("the image is empty")
    return value


def _read_image_file(path: str, beside: Path | None) -> bytes:
    places = [Path(path)]
    if beside is not None and not Path(path).is_absolute():
        places.append(beside / path)
    for place in places:
        if place.is_file():
            return place.read_bytes()
    where = f"in neither the working directory nor {beside}" if len(places) > 1 else "not found"
    raise FileNotFoundError(f"the image's path '{path}' is {where}")


def is_jpeg(data: bytes | memoryview) -> bool:
    return bytes(data[:3]) == JPEG_MAGIC


def draft_request(size: tuple[int, int], resize: int | list[int]) -> tuple[int, int] | None:
    """The smallest (w, h) a reduced-scale decode may return so that the transform's resize still
    scales down: the shorter side at least ``resize`` (an int), or at least (h, w) (a pair). None
    when not even the 1/2 scale would cover it (the image is decoded in full, at no extra cost)."""
    width, height = size
    if isinstance(resize, int):
        scale = resize / min(width, height)
        wanted = math.ceil(width * scale), math.ceil(height * scale)
    else:
        wanted = int(resize[1]), int(resize[0])
    return wanted if 2 * wanted[0] <= width and 2 * wanted[1] <= height else None


class Decoding:
    """raw image -> the model's input tensor, in a DataLoader worker.

    ``mode="draft"`` asks the JPEG decoder for the smallest DCT scale (1/2, 1/4, 1/8) whose image
    still covers the transform's resize target (``preprocessing["resize"]``), then applies the usual
    transform: 2-4x less decoding on large JPEGs, pixels within a small tolerance of full decoding.
    ``exif_transpose`` rotates images as their EXIF orientation says; off by default, like
    torchvision's and timm's loaders, since the model's weights were trained without it.
    """

    def __init__(
        self, transform: Transform, mode: str = "pil", *, preprocessing: Mapping[str, Any] | None = None,
        exif_transpose: bool = False,
    ) -> None:  # fmt: skip
        if mode not in DECODES:
            raise ExtractError(f"unknown --decode '{mode}'; choose one of {', '.join(DECODES)}")
        self.transform, self.mode, self.exif_transpose = transform, mode, exif_transpose
        self.resize = None
        if mode == "draft":
            self.resize = (preprocessing or {}).get("resize")
            if self.resize is None:
                raise ExtractError(
                    "--decode draft needs the resize target of the model's preprocessing, and "
                    f"{(preprocessing or {}).get('repr', 'this model')} has none; use --decode pil"
                )

    def open(self, data: bytes) -> Image.Image:
        """Decode encoded bytes to an RGB PIL image (reduced-scale for JPEGs under ``draft``)."""
        image = Image.open(io.BytesIO(data))
        if self.resize is not None and image.format == "JPEG":
            if (request := draft_request(image.size, self.resize)) is not None:
                image.draft("RGB", request)
        return self.rgb(image)

    def rgb(self, image: Image.Image) -> Image.Image:
        if self.exif_transpose:
            image = ImageOps.exif_transpose(image)
        return image.convert("RGB")

    def __call__(self, raw: RawImage) -> torch.Tensor:
        """The transformed image; under ``nvjpeg`` a JPEG stays encoded (a 1-D uint8 tensor of its
        bytes) for the batched GPU decoder (``gpu_decode.py``), and other formats take this path."""
        if isinstance(raw, bytes | bytearray | memoryview):
            if self.mode == "nvjpeg" and is_jpeg(raw):
                return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            return self.transform(self.open(bytes(raw)))
        if isinstance(raw, Image.Image):
            return self.transform(self.rgb(raw))
        return self.transform(raw)
