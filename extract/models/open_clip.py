"""``--model open_clip:ARCH[:PRETRAINED]``: the image tower (``model.visual``) of an OpenCLIP model
with OpenCLIP's own eval preprocess. PRETRAINED is a tag (``laion2b_s34b_b79k``; from the cache or
downloaded) or a local checkpoint file. With ``--weights none`` a tag still chooses the
preprocessing (mean, std, interpolation, resize mode), as the weights would."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import open_clip

from ..capture.layers import closest
from ..errors import ExtractError
from .base import LoadedModel, ModelRequest, download_failed


def _tag_preprocessing(arch: str, tag: str | None) -> dict[str, Any]:
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
    logging.disable(logging.ERROR)  # OpenCLIP logs its failures on the root logger: one line is ours to say
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(
            arch, pretrained=pretrained if load else None, **options
        )
    except (OSError, RuntimeError) as e:
        if not load:
            raise
        raise download_failed(f"OpenCLIP weights {arch}:{pretrained}", e) from None
    finally:
        logging.disable(logging.NOTSET)
    visual = model.visual
    size = visual.image_size if isinstance(visual.image_size, tuple) else (visual.image_size, visual.image_size)
    if load:
        description = f"open_clip {arch}:{pretrained}"
    else:
        description = f"none (random init, seed {request.seed}" + (f"; preprocessing of {pretrained})" if tag else ")")
    return LoadedModel(visual, preprocess, (int(size[0]), int(size[1])), description)
