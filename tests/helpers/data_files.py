"""Small real-format data sets for the data-source tests: an ImageFolder tree of PNGs, JPEG/PNG bytes,
tar shards in the webdataset layout, and independent readers."""

import io
import tarfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .reference import preset


def make_png_tree(root: Path, classes: dict[str, int], seed: int = 0) -> list[tuple[Path, int]]:
    """ImageFolder layout ROOT/CLASS/N.png with random RGB images of varied sizes; (path, label) each."""
    rng = np.random.default_rng(seed)
    files = []
    for label, (name, count) in enumerate(sorted(classes.items())):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            h, w = rng.integers(36, 56, size=2)
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            path = root / name / f"{i:03d}.png"
            Image.fromarray(pixels).save(path)
            files.append((path, label))
    return files


def encoded_image(seed: int, fmt: str = "JPEG", size: tuple[int, int] | None = None) -> bytes:
    rng = np.random.default_rng(seed)
    w, h = size or tuple(int(v) for v in rng.integers(36, 60, size=2))
    base = rng.integers(0, 256, size=(h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8)
    pixels = np.asarray(Image.fromarray(base).resize((w, h), Image.BILINEAR))
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(root: Path, sizes: list[int], seed: int = 0) -> list[Path]:
    """Shards of ``sizes`` samples each: key.jpg (every fifth a .png) + key.cls, plus a .txt caption.
    Keys continue across shard boundaries (sample numbers do not restart)."""
    root.mkdir(parents=True, exist_ok=True)
    paths, number = [], 0
    for shard, count in enumerate(sizes):
        path = root / f"train-{shard:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for _ in range(count):
                key = f"sample{number:05d}"
                ext = "png" if number % 5 == 4 else "jpg"
                add_member(tar, f"{key}.txt", f"caption {number}".encode())
                add_member(tar, f"{key}.{ext}", encoded_image(seed + number, "PNG" if ext == "png" else "JPEG"))
                add_member(tar, f"{key}.cls", str(number % 3).encode())
                number += 1
        paths.append(path)
    return paths


def read_shards_with_tarfile(paths: list[Path]) -> list[tuple[str, bytes, int]]:
    """(shard/key, image bytes, label) per sample, read independently of extract."""
    samples = []
    for path in paths:
        with tarfile.open(path) as tar:
            grouped: dict[str, dict[str, bytes]] = {}
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                grouped.setdefault(key, {})[ext] = tar.extractfile(member).read()
        for key, members in grouped.items():
            image = members.get("jpg", members.get("png"))
            samples.append((f"{path.name}/{key}", image, int(members["cls"])))
    return samples


def decode_all(images: list[bytes], size: int = 32) -> torch.Tensor:
    transform = preset(size)
    return torch.stack([transform(Image.open(io.BytesIO(b)).convert("RGB")) for b in images])


def exif_jpeg(orientation: int | None, size: tuple[int, int] = (96, 64), seed: int = 0) -> bytes:
    """A smooth, asymmetric JPEG of ``size`` (w, h) carrying EXIF ``orientation`` (None: no EXIF block)."""
    rng = np.random.default_rng(seed)
    w, h = size
    base = rng.integers(0, 256, size=(h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    pixels = np.asarray(Image.fromarray(base).resize((w, h), Image.BILINEAR))
    buffer = io.BytesIO()
    if orientation is None:
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=95, exif=exif)
    return buffer.getvalue()
