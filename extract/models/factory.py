"""``--model pkg.module:factory`` or ``path/file.py:factory``: a function of no arguments returning
an ``nn.Module``, or ``(module, preprocess)`` so that a custom model brings its own transform.
Without one, the model gets torchvision's ImageNet classification preset (recorded in the store)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import ExtractError
from .base import LoadedModel, ModelRequest
from .torchvision import imagenet_preset


def _load(spec: str) -> Callable[[], Any]:
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
    except ExtractError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise ExtractError(f"--model {spec}: importing '{target}' raised {e.__class__.__name__}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ExtractError(f"--model {spec}: '{target}' has no callable '{attr}'")
    return factory


def _required_arguments(factory: Callable[..., Any]) -> list[str]:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: just call them
        return []
    return [
        p.name
        for p in parameters
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def build(spec: str, request: ModelRequest) -> LoadedModel:
    factory = _load(spec)
    if required := _required_arguments(factory):
        raise ExtractError(
            f"--model {spec}: the factory needs arguments ({', '.join(required)}); "
            "wrap it in a function of no arguments that fills them in"
        )
    try:
        made = factory()
    except Exception as e:  # noqa: BLE001 - whatever the user's code raises, say so in one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise ExtractError(f"--model {spec}: the factory raised {e.__class__.__name__}: {first}") from None
    model, preprocess = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(model, nn.Module):
        raise ExtractError(
            f"--model {spec} returned a {type(made).__name__}, not an nn.Module or (nn.Module, preprocess)"
        )
    if preprocess is None:
        preprocess = imagenet_preset(request.image_size)
        size = preprocess.crop_size[0]
        return LoadedModel(model, preprocess, (size, size), "factory")
    if not callable(preprocess):
        raise ExtractError(f"--model {spec}: the preprocess it returned ({type(preprocess).__name__}) is not callable")
    if request.image_size is not None:
        raise ExtractError(
            f"--model {spec} brings its own preprocessing, which --image-size cannot change; drop --image-size"
        )
    return LoadedModel(model, preprocess, _output_size(spec, preprocess), "factory (its own preprocessing)")


def _output_size(spec: str, preprocess: Callable[[Any], Any]) -> tuple[int, int]:
    """The input size the model gets: what the transform makes of a square image."""
    from PIL import Image

    try:
        pixels = preprocess(Image.new("RGB", (256, 256), (128, 128, 128)))
    except Exception as e:  # noqa: BLE001
        raise ExtractError(
            f"--model {spec}: its preprocess failed on a PIL image ({e.__class__.__name__}: {e}); "
            "it must map a PIL RGB image to a (3, H, W) tensor"
        ) from None
    if getattr(pixels, "ndim", None) != 3:
        raise ExtractError(
            f"--model {spec}: its preprocess gave {type(pixels).__name__} {list(getattr(pixels, 'shape', []))}, "
            "not a (3, H, W) tensor"
        )
    return int(pixels.shape[1]), int(pixels.shape[2])
