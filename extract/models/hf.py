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

transformers is imported only when a model is built (see ``ModelSource``)."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from ..capture import Capture, LayerRef
from ..errors import ExtractError
from .base import LoadedModel, ModelRequest, ModelSource, download_failed


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


# what ``from_pretrained`` reads from a save_pretrained directory, per part: each group, one of its names
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
NEEDED_FILES = {
    "the image processor": (("preprocessor_config.json",),),
    "the config": (("config.json",),),
    "the weights": (("config.json",), WEIGHT_FILES),
    "the tokenizer": (("tokenizer.json", "tokenizer_config.json"),),
}
TOKENIZER_FILES = NEEDED_FILES["the tokenizer"][0]


def _model_file(name: str, filename: str, hub_offline: bool) -> Path | None:
    """``filename`` of the model ``name`` where it is: in the directory, in the Hugging Face cache,
    or (where the hub can be reached) downloaded; ``None`` where it is not."""
    if Path(name).is_dir():
        return Path(name, filename) if Path(name, filename).is_file() else None
    if Path(name).exists() or not _is_repo_id(name):
        return None
    import huggingface_hub

    cached = huggingface_hub.try_to_load_from_cache(name, filename)
    if isinstance(cached, str):
        return Path(cached)
    if hub_offline or cached is not None:  # not None: the cache knows the repo has no such file
        return None
    try:
        return Path(huggingface_hub.hf_hub_download(name, filename))
    except Exception:  # noqa: BLE001 - absent or unreachable: the loaders that follow say which, in one line
        return None


def _vision_only(model_type: Any) -> bool:
    """A model type transformers has an image processor for and no tokenizer (ViT, DINOv2, ConvNeXt...)."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    return model_type in IMAGE_PROCESSOR_MAPPING_NAMES and model_type not in TOKENIZER_MAPPING_NAMES


def is_text_model(name: str, hub_offline: bool) -> bool:
    """Whether ``hf:name`` is a text model (the rule is in the module docstring); a text config
    without a tokenizer is refused here, since neither kind could use it."""
    config_file = _model_file(name, "config.json", hub_offline)
    if config_file is None:
        return False
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # the vision loaders name the unreadable file
    if not isinstance(config, dict) or _vision_only(config.get("model_type")):
        return False
    if _model_file(name, "preprocessor_config.json", hub_offline) is not None:
        return False
    if any(_model_file(name, file, hub_offline) is not None for file in TOKENIZER_FILES):
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


IMAGE_PARTS = "model and image processor"  # what a save_pretrained directory must hold, for messages


def _load(what: str, name: str, load: Any, hub_offline: bool, parts: str = IMAGE_PARTS) -> Any:
    """``load`` (a ``from_pretrained``) from a directory, else from the Hugging Face cache, else,
    where the hub can be reached, from the hub. ``parts`` say what the directory holds, for messages."""
    if Path(name).is_dir():
        return _load_directory(what, name, load, parts)
    if Path(name).exists() or not _is_repo_id(name):
        raise ExtractError(
            f"--model hf:{name}: {name} is not a directory (nor a Hugging Face repo id, ORG/NAME); "
            f"use hf:DIR, a directory written by save_pretrained ({parts})"
        )
    try:
        return load(name, local_files_only=True)
    except OSError as e:
        if hub_offline:
            raise _not_found(what, name, e, parts) from None
    try:
        return load(name)
    except (OSError, ValueError) as e:
        raise _not_found(what, name, e, parts) from None


def _load_directory(what: str, name: str, load: Any, parts: str = IMAGE_PARTS) -> Any:
    """transformers' own message for an incomplete directory speaks of the hub; this one names the file."""
    for names in NEEDED_FILES[what]:
        if not any(Path(name, file).is_file() for file in names):
            raise ExtractError(
                f"--model hf:{name}: the directory has no {' or '.join(names)}, so {what} cannot be loaded; "
                f"write it there with save_pretrained ({parts})"
            )
    try:
        return load(name)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ExtractError(f"--model hf:{name}: cannot load {what} from it ({e.__class__.__name__}: {first})") from None


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _not_found(what: str, name: str, error: BaseException, parts: str = IMAGE_PARTS) -> ExtractError:
    return download_failed(
        f"{what} of hf:{name} (not a local directory, not in the Hugging Face cache)",
        error,
        f"use hf:DIR, a directory written by save_pretrained ({parts})",
    )


def _vision_tower(model: nn.Module) -> tuple[nn.Module, str]:
    """Vision-language models (CLIP, SigLIP) also want text; their image tower takes pixels alone."""
    parameters = inspect.signature(model.forward).parameters
    if "input_ids" in parameters and isinstance(getattr(model, "vision_model", None), nn.Module):
        return model.vision_model, " (its vision_model)"
    return model, ""


def _same_tensor(output: Any, state: torch.Tensor) -> bool:
    """``output`` is ``state``, or a view of the same memory with the same shape (GPT-2 returns
    ``ln_f(x).view(shape)`` as its last hidden state): either way it holds the same values."""
    if output is state:
        return True
    return (
        isinstance(output, torch.Tensor)
        and output.numel() > 0
        and output.data_ptr() == state.data_ptr()
        and output.shape == state.shape
        and output.stride() == state.stride()
        and output.dtype == state.dtype
    )


def _pixels(module: Callable[..., Any], pixels: torch.Tensor) -> Any:
    return module(pixel_values=pixels)


def hidden_state_aliases(
    model: nn.Module, example: Any, call: Callable[[Callable[..., Any], Any], Any] = _pixels
) -> dict[str, LayerRef]:
    """``hidden_states.N`` -> the module whose output is that hidden state, found by identity (or
    the same memory, see ``_same_tensor``) in one forward of ``example`` with
    ``output_hidden_states=True``; ``call(module, example)`` runs a module the way the source does
    (``pixel_values=`` for vision, ``**inputs`` for text). When several modules return it, the
    outermost (it finishes last), so that a change it makes after its children return is captured too."""
    try:
        with Capture(model, retain="reference") as cap, torch.inference_mode():
            result = call(functools.partial(model, output_hidden_states=True), example)
    except Exception:  # noqa: BLE001 - a model without hidden states just has no aliases
        return {}
    fired = cap.seen
    aliases = {}
    for number, state in enumerate(getattr(result, "hidden_states", None) or ()):
        tensors = [LayerRef(name) for name, out in fired if _same_tensor(out, state)]
        firsts = [
            LayerRef(name, 0)
            for name, out in fired
            if isinstance(out, (tuple, list)) and out and _same_tensor(out[0], state)
        ]
        if found := (tensors or firsts):
            alias = f"hidden_states.{number}"
            aliases[alias] = LayerRef(found[-1].module, found[-1].selector, alias=alias)
    return aliases


def build(name: str, request: ModelRequest) -> LoadedModel:
    if is_text_model(name, request.hub_offline):
        from . import hf_text  # imported here: it builds on this module's loaders

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
    processor = _load("the image processor", name, AutoImageProcessor.from_pretrained, offline)
    if request.load_weights and request.weights.lower() == "default":
        model = _load("the weights", name, AutoModel.from_pretrained, offline)
        description = f"hf:{name}"
    else:
        config = _load("the config", name, AutoConfig.from_pretrained, offline)
        model = AutoModel.from_config(config)
        description = f"none (random init, seed {request.seed}; config of hf:{name})"
    model, tower = _vision_tower(model.eval())
    preprocess = ProcessorTransform(processor)
    size = tuple(preprocess(Image.new("RGB", (256, 256), (128, 128, 128))).shape[1:])
    loaded = LoadedModel(model, preprocess, size, description + tower, input_name="pixel_values")  # type: ignore[arg-type]
    loaded.aliases = hidden_state_aliases(model, loaded.example(1))
    return loaded


SOURCE = ModelSource(
    "hf", usage="hf:ID_OR_DIR", example="hf:facebook/dinov2-small", build=build, library="transformers", extra="hf"
)
