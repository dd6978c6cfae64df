"""``--model NAME``: torchvision's model registry, with the weights' own ``transforms()``."""

from __future__ import annotations

import urllib.error
from typing import Any

from torchvision.models import get_model, get_model_weights, list_models
from torchvision.transforms._presets import ImageClassification

from ..errors import ExtractError
from ..names.layers import closest
from .base import LoadedModel, ModelRequest, download_failed


def imagenet_preset(image_size: int | None) -> ImageClassification:
    """Resize round(S·256/224), center crop S, ImageNet mean/std: what torchvision's weights use."""
    crop = image_size or 224
    return ImageClassification(crop_size=crop, resize_size=round(crop * 256 / 224))


def _weights(name: str, weights: str) -> Any:
    if weights.lower() == "none":
        return None
    try:
        enum = get_model_weights(name)
    except (ValueError, KeyError):
        raise ExtractError(
            f"model '{name}' has no torchvision weights; use --weights none or --checkpoint PATH"
        ) from None
    key = weights.split(".")[-1]
    if key not in enum.__members__:
        raise ExtractError(
            f"unknown --weights '{weights}' for {name}; choose one of {', '.join(enum.__members__)}, or none"
        )
    return enum[key]


def build(name: str, request: ModelRequest) -> LoadedModel:
    available = list_models()
    if name not in available:
        raise ExtractError(
            f"unknown --model '{name}'; closest: {closest(name, available)} "
            "(or timm:NAME, hf:ID_OR_DIR, open_clip:ARCH, pkg.module:factory)"
        )
    weights = _weights(name, request.weights)
    try:
        model = get_model(name, weights=weights if request.load_weights else None)
    except (urllib.error.URLError, OSError, ConnectionError) as e:
        raise download_failed(f"weights {weights} for {name}", e) from None
    except RuntimeError as e:
        if "download" not in str(e).lower() and "url" not in str(e).lower():
            raise
        raise download_failed(f"weights {weights} for {name}", e) from None
    if weights is None:
        preprocess: Any = imagenet_preset(request.image_size)
        description = f"none (random init, seed {request.seed})"
    else:
        preprocess = weights.transforms()
        if request.image_size is not None:
            size = request.image_size
            preprocess = weights.transforms(crop_size=size, resize_size=round(size * 256 / 224))
        description = str(weights) if request.load_weights else f"none (architecture only; preprocessing of {weights})"
    crop = preprocess.crop_size[0]
    return LoadedModel(model, preprocess, (crop, crop), description)
