"""Build the model, its weights and its preprocessing from ``--model``, ``--weights``, ``--checkpoint``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import pickle
import sys
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn
from torchvision.models import get_model, get_model_weights, list_models
from torchvision.transforms._presets import ImageClassification

from .errors import ExtractError
from .layers import closest


@dataclass
class LoadedModel:
    model: nn.Module
    preprocess: Callable[[Any], torch.Tensor]
    input_size: int
    weights: str
    checkpoint_sha256: str | None


def imagenet_preset(image_size: int | None) -> ImageClassification:
    """Resize round(S·256/224), center crop S, ImageNet mean/std: what torchvision's weights use."""
    crop = image_size or 224
    return ImageClassification(crop_size=crop, resize_size=round(crop * 256 / 224))


def _factory(spec: str) -> Callable[[], nn.Module]:
    target, _, attr = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise ExtractError(f"--model {spec}: file {target} does not exist")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
            sys.modules[path.stem] = module
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(target)
    except ImportError as e:
        raise ExtractError(f"--model {spec}: cannot import '{target}' ({e}); is it on PYTHONPATH?") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ExtractError(f"--model {spec}: '{target}' has no callable '{attr}'")
    return factory


def _torchvision_weights(name: str, weights: str) -> Any:
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


def _download_failed(name: str, weights: Any, error: BaseException) -> ExtractError:
    return ExtractError(
        f"could not download weights {weights} for {name} ({error.__class__.__name__}: {error}); "
        "without network use --weights none (random init) or --checkpoint PATH"
    )


def build_model(name: str, weights: str, checkpoint: str | None, seed: int, image_size: int | None) -> LoadedModel:
    """The model in eval mode on the CPU, with its preprocessing and a description of its weights."""
    torch.manual_seed(seed)
    if ":" in name:
        model = _factory(name)()
        if not isinstance(model, nn.Module):
            raise ExtractError(f"--model {name} returned a {type(model).__name__}, not an nn.Module")
        preprocess, description = imagenet_preset(image_size), "factory"
    else:
        available = list_models()
        if name not in available:
            raise ExtractError(f"unknown --model '{name}'; closest: {closest(name, available)} (or pkg.module:factory)")
        weight_enum = _torchvision_weights(name, weights)
        download = weight_enum if checkpoint is None else None
        try:
            model = get_model(name, weights=download)
        except (urllib.error.URLError, OSError, ConnectionError) as e:
            raise _download_failed(name, weight_enum, e) from None
        except RuntimeError as e:
            if "download" not in str(e).lower() and "url" not in str(e).lower():
                raise
            raise _download_failed(name, weight_enum, e) from None
        if weight_enum is None:
            preprocess, description = imagenet_preset(image_size), f"none (random init, seed {seed})"
        else:
            preprocess = weight_enum.transforms()
            if image_size is not None:
                preprocess = weight_enum.transforms(crop_size=image_size, resize_size=round(image_size * 256 / 224))
            description = str(weight_enum)
    digest = None
    if checkpoint is not None:
        digest = load_checkpoint(model, Path(checkpoint))
        description = f"checkpoint {checkpoint}"
    crop = getattr(preprocess, "crop_size", [image_size or 224])
    return LoadedModel(model.eval(), preprocess, int(crop[0]), description, digest)


def load_checkpoint(model: nn.Module, path: Path) -> str:
    """Load a state_dict (safely: ``weights_only=True``) into ``model``; returns the file's sha256."""
    if not path.is_file():
        raise ExtractError(f"--checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ExtractError(
            f"--checkpoint {path} needs unpickling arbitrary objects, which is refused; "
            "save model.state_dict() with torch.save instead"
        ) from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise ExtractError(
            f"--checkpoint {path} is not a torch checkpoint ({e.__class__.__name__}); save model.state_dict()"
        ) from None
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ExtractError(f"--checkpoint {path} is not a state_dict (a dict of tensors); save model.state_dict()")
    if state and all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[1:2] or [str(e)]
        raise ExtractError(f"--checkpoint {path} does not fit this model: {first[0].strip()}") from None
    if result.missing_keys or result.unexpected_keys:
        raise ExtractError(
            f"--checkpoint {path} does not fit this model: missing keys {result.missing_keys[:3]}"
            f"{'...' if len(result.missing_keys) > 3 else ''}, unexpected keys {result.unexpected_keys[:3]}"
            f"{'...' if len(result.unexpected_keys) > 3 else ''}"
        )
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    import zarr

    from . import __version__

    return {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "zarr": zarr.__version__,
        "extract": __version__,
    }
