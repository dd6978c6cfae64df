"""``--model hf:ID_OR_DIR``: a transformers model from a ``save_pretrained`` directory or the
Hugging Face cache. Layers are its module names plus ``hidden_states.N``, numbered as
``output_hidden_states`` numbers them, each resolved to the module that produces it.

Text or vision, decided from the files before anything is loaded (``is_text_model``):

- a config with an image processor (``preprocessor_config.json``), or of a vision-only
  ``model_type`` (one transformers has an image processor and no tokenizer for), is a vision model:
  an ``AutoModel`` called with ``pixel_values=`` and preprocessed by its own ``AutoImageProcessor``
  (in the DataLoader workers, exactly as transformers applies it);
- any other config with tokenizer files (``tokenizer.json`` / ``tokenizer_config.json``) is a text
  model (``extract.models.hf_text``): its own ``AutoTokenizer``, and ``AutoModelForCausalLM`` for a
  causal LM, ``AutoModel`` (the encoder alone for T5-like encoder-decoders) for the others;
- any other config has no tokenizer, which is refused in one line.

A hub id is looked up in the cache (only there when the hub is offline); a directory or id without
a config goes the vision way, whose messages name what is missing.

transformers is imported only when a model is built (``registry.py`` declares it
without importing this module)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from ..errors import ExtractError
from . import hf_text
from .base import LoadedModel, ModelRequest
from .hf_hub import TOKENIZER_FILES, hidden_state_aliases, load_pretrained, model_file


class ProcessorTransform:
    """A PIL image -> the (3, H, W) ``pixel_values`` the image processor makes of it."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.processor(images=image, return_tensors="pt")["pixel_values"][0]

    def __repr__(self) -> str:
        settings = {k: v for k, v in self.processor.to_dict().items() if not k.startswith("_")}
        return f"{type(self.processor).__name__}({', '.join(f'{k}={v!r}' for k, v in sorted(settings.items()))})"

    def preprocessing_record(self) -> dict[str, Any]:
        p = self.processor
        size = _size_dict(getattr(p, "size", None)) if getattr(p, "do_resize", True) else None
        crop = _size_dict(getattr(p, "crop_size", None)) if getattr(p, "do_center_crop", False) else None
        normalize = getattr(p, "do_normalize", True)
        resample = getattr(p, "resample", None)
        interpolation = getattr(resample, "name", None) or {2: "bilinear", 3: "bicubic", 0: "nearest"}.get(resample)
        return {
            "mean": [float(v) for v in p.image_mean] if normalize and getattr(p, "image_mean", None) else None,
            "std": [float(v) for v in p.image_std] if normalize and getattr(p, "image_std", None) else None,
            "interpolation": str(interpolation).lower() if interpolation else None,
            "resize": size,
            "crop": [crop, crop] if isinstance(crop, int) else crop,
        }


def _size_dict(size: Any) -> int | list[int] | None:
    """transformers' size dicts in torchvision's convention: shorter side, or [height, width]."""
    if size is None:
        return None
    get = size.get if isinstance(size, dict) else lambda key: getattr(size, key, None)
    if get("height") and get("width"):
        return [int(get("height")), int(get("width"))]
    return int(get("shortest_edge")) if get("shortest_edge") else None


def _vision_only(model_type: Any) -> bool:
    """A model type transformers has an image processor for and no tokenizer (ViT, DINOv2, ConvNeXt...)."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    if model_type in TOKENIZER_MAPPING_NAMES:
        # decided without the image processors' mapping: importing it imports transformers' image utilities,
        # torchvision and torch._dynamo, 6% of a short text job, before its first forward
        return False
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    return model_type in IMAGE_PROCESSOR_MAPPING_NAMES


def _unreadable_config(name: str, path: Path, error: BaseException) -> ExtractError:
    """``config.json`` that is not a JSON object, in one line naming it (neither kind can load it)."""
    if isinstance(error, json.JSONDecodeError):
        why = f"not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
    elif isinstance(error, UnicodeDecodeError):
        why = f"not UTF-8 text (byte {error.start})"
    elif isinstance(error, OSError):
        why = f"unreadable ({error.strerror or error})"
    else:
        why = str(error)
    return ExtractError(
        f"--model hf:{name}: its config.json ({path}) is {why}; write it again with save_pretrained "
        "(or download the model again)"
    )


def is_text_model(name: str, hub_offline: bool) -> bool:
    """Whether ``hf:name`` is a text model (the rule is in the module docstring); a text config
    without a tokenizer is refused here, since neither kind could use it."""
    config_file = model_file(name, "config.json", hub_offline)
    if config_file is None:
        return False
    # An unreadable config is said here: taken for "not text", it sent a text model down the vision
    # way, which then asked for a preprocessor_config.json it never needed.
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _unreadable_config(name, config_file, e) from None
    if not isinstance(config, dict):
        raise _unreadable_config(name, config_file, ValueError(f"a JSON {type(config).__name__}, not an object"))
    if _vision_only(config.get("model_type")):
        return False
    if model_file(name, "preprocessor_config.json", hub_offline) is not None:
        return False
    if any(model_file(name, file, hub_offline) is not None for file in TOKENIZER_FILES):
        return True
    files = " or ".join(TOKENIZER_FILES)
    if Path(name).is_dir():
        raise ExtractError(
            f"--model hf:{name} has no tokenizer ({files}); save it there with tokenizer.save_pretrained({name})"
        )
    raise ExtractError(
        f"--model hf:{name} has no tokenizer ({files}) in the Hugging Face cache; save the model and its "
        "tokenizer with save_pretrained(DIR) and use hf:DIR"
    )


def check_tensor_parallel(name: str, weights: str, checkpoint: str | None, size: int) -> bool:
    """Whether ``hf:name`` is a text model (``--tensor-parallel`` applies to none other), refusing a
    ``--tensor-parallel size`` its config cannot take (``hf_text.check_tensor_parallel``); the config is
    all that is read."""
    from transformers import AutoConfig

    from .base import ModelRequest, hub_offline

    offline = hub_offline()
    if not is_text_model(name, offline):
        return False
    config = load_pretrained("the config", name, AutoConfig.from_pretrained, offline, hf_text.TEXT_PARTS)
    request = ModelRequest(weights, checkpoint, 0, None, checkpoint is None, hub_offline=offline)
    hf_text.check_tensor_parallel(name, config, request, size)
    return True


def _vision_tower(model: nn.Module) -> tuple[nn.Module, str]:
    """Vision-language models (CLIP, SigLIP) also want text; their image tower takes pixels alone."""
    parameters = inspect.signature(model.forward).parameters
    if "input_ids" in parameters and isinstance(getattr(model, "vision_model", None), nn.Module):
        return model.vision_model, " (its vision_model)"
    return model, ""


def build(name: str, request: ModelRequest) -> LoadedModel:
    if is_text_model(name, request.hub_offline):
        return hf_text.build(name, request)
    from transformers import AutoConfig, AutoImageProcessor, AutoModel

    if request.image_size is not None:
        raise ExtractError(
            f"--image-size does not apply to hf:{name}: its image processor decides the input size "
            "(edit preprocessor_config.json to change it)"
        )
    if request.weights.lower() not in ("default", "none"):
        raise ExtractError(f"--weights {request.weights}: hf models take DEFAULT (the saved weights) or none")
    offline = request.hub_offline
    processor = load_pretrained("the image processor", name, AutoImageProcessor.from_pretrained, offline)
    if request.load_weights and request.weights.lower() == "default":
        model = load_pretrained("the weights", name, AutoModel.from_pretrained, offline)
        description = f"hf:{name}"
    else:
        config = load_pretrained("the config", name, AutoConfig.from_pretrained, offline)
        model = AutoModel.from_config(config)
        description = f"none (random init, seed {request.seed}; config of hf:{name})"
    model, tower = _vision_tower(model.eval())
    preprocess = ProcessorTransform(processor)
    size = tuple(preprocess(Image.new("RGB", (256, 256), (128, 128, 128))).shape[1:])
    loaded = LoadedModel(model, preprocess, size, description + tower, input_name="pixel_values")  # type: ignore[arg-type]
    failures: list[str] = []
    loaded.aliases = hidden_state_aliases(model, loaded.example(1), failures=failures)
    loaded.alias_failure = failures[0] if failures else None
    return loaded
