"""``--model open_clip:ARCH[:PRETRAINED]``: the image tower (``model.visual``) of an OpenCLIP model
with OpenCLIP's own eval preprocess. PRETRAINED is a tag (``laion2b_s34b_b79k``; from the cache or
downloaded) or a local checkpoint file. With ``--weights none`` a tag still chooses the
preprocessing (mean, std, interpolation, resize mode), as the weights would.

open_clip is imported only when a model is built (``registry.py`` declares it
without importing this module)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ExtractError
from ..names.layers import closest
from .base import LoadedModel, ModelRequest, cached_hub_file, download_failed

HUB_WEIGHTS = "open_clip_pytorch_model.bin"  # OpenCLIP's file name where a tag names a hub repository only


class _MadeIn(logging.Filter):
    """Drops the records made by code under one directory."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = os.path.join(directory, "")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(self.directory)


@contextlib.contextmanager
def _open_clip_quiet() -> Iterator[None]:
    """Silence OpenCLIP's own log records while it builds a model: it reports its failures (and a
    random init) with ``logging.error``/``warning`` on the root logger, and the one line about them
    is ours to say. A logger's filter sees only records made on it, so the records of every other
    library still reach the root's handlers."""
    import open_clip

    quiet = _MadeIn(os.path.dirname(open_clip.__file__))
    root = logging.getLogger()
    root.addFilter(quiet)
    try:
        yield
    finally:
        root.removeFilter(quiet)


def _safe_alternatives(filename: str) -> list[str]:
    """The safetensors files OpenCLIP prefers to ``filename`` on the hub, in its order."""
    if filename == HUB_WEIGHTS:
        return ["open_clip_model.safetensors"]
    return [filename[:-4] + ".safetensors"] if filename.endswith((".bin", ".pth")) else []


def _cached_weights(arch: str, tag: str) -> str:
    """Offline, the file of a pretrained tag from the hub's cache: OpenCLIP downloads through the hub
    with no cache-only switch. A tag with URL weights only stays OpenCLIP's (its own cache, which
    fails at once without network). The tag's preprocessing is passed explicitly either way."""
    import open_clip

    config = open_clip.get_pretrained_cfg(arch, tag)
    if not config.get("hf_hub"):  # OpenCLIP prefers the hub where a tag names both
        return tag
    repo, filename = os.path.split(config["hf_hub"])
    filename = filename or HUB_WEIGHTS
    return cached_hub_file(repo, [*_safe_alternatives(filename), filename])


def _tag_preprocessing(arch: str, tag: str | None) -> dict[str, Any]:
    import open_clip

    if tag is None or Path(tag).is_file():
        return {}
    config = open_clip.get_pretrained_cfg(arch, tag)
    if not config:
        tags = open_clip.list_pretrained_tags_by_model(arch)
        raise ExtractError(
            f"--model open_clip:{arch}:{tag}: '{tag}' is neither a file nor a pretrained tag of {arch} "
            f"(tags: {', '.join(tags) or 'none'})"
        )
    keys = {"mean": "image_mean", "std": "image_std", "interpolation": "image_interpolation"}
    keys["resize_mode"] = "image_resize_mode"
    return {keys[k]: v for k, v in config.items() if k in keys and v is not None}


def build(spec: str, request: ModelRequest) -> LoadedModel:
    import open_clip

    arch, _, tag = spec.partition(":")
    if arch not in open_clip.list_models():
        raise ExtractError(
            f"unknown --model open_clip:{arch}; closest: {closest(arch, open_clip.list_models())} "
            "(open_clip.list_models() has all)"
        )
    if request.weights.lower() not in ("default", "none"):
        raise ExtractError(
            f"--weights {request.weights}: open_clip models take DEFAULT or none; "
            f"name the weights in the model instead: --model open_clip:{arch}:TAG_OR_FILE"
        )
    pretrained = tag or None
    load = request.load_weights and request.weights.lower() == "default"
    if load and pretrained is None:
        tags = open_clip.list_pretrained_tags_by_model(arch)
        raise ExtractError(
            f"--model open_clip:{arch} names no weights; use open_clip:{arch}:TAG (tags: {', '.join(tags) or 'none'}) "
            "or open_clip:ARCH:FILE, or --weights none for random init"
        )
    options = _tag_preprocessing(arch, pretrained)
    if request.image_size is not None:
        options["force_image_size"] = request.image_size
    try:
        weights = pretrained if load else None
        if weights is not None and request.hub_offline and not Path(weights).is_file():
            weights = _cached_weights(arch, weights)
        with _open_clip_quiet():
            model, _, preprocess = open_clip.create_model_and_transforms(arch, pretrained=weights, **options)
    except (OSError, RuntimeError) as e:
        if not load:
            raise
        raise download_failed(f"OpenCLIP weights {arch}:{pretrained}", e) from None
    visual = model.visual
    size = visual.image_size if isinstance(visual.image_size, tuple) else (visual.image_size, visual.image_size)
    if load:
        description = f"open_clip {arch}:{pretrained}"
    else:
        description = f"none (random init, seed {request.seed}" + (f"; preprocessing of {pretrained})" if tag else ")")
    return LoadedModel(visual, preprocess, (int(size[0]), int(size[1])), description)
