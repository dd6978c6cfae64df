"""``--model timm:NAME[.TAG]``: any ``timm.list_models()`` architecture, with timm's own eval
transform (``resolve_model_data_config`` + ``create_transform``). The model's default pretrained
config decides the transform whatever the weights (random init and checkpoints included).

timm is imported only when a model is built (``registry.py`` declares it
without importing this module)."""

from __future__ import annotations

from typing import Any

from ..errors import ExtractError
from ..names.layers import closest
from .base import LoadedModel, ModelRequest, cached_hub_file, download_failed

HUB_WEIGHTS = "pytorch_model.bin"  # timm's default file name on the hub


def _safe_alternatives(filename: str) -> list[str]:
    """The safetensors files timm prefers to ``filename`` on the hub, in its order."""
    if filename.endswith(".safetensors"):
        return []
    if filename == HUB_WEIGHTS:
        return ["model.safetensors"]
    if filename == "open_clip_pytorch_model.bin":
        return ["open_clip_model.safetensors"]
    return [filename.removesuffix(".bin") + ".safetensors"] if filename.endswith(".bin") else []


def _cached_weights(name: str) -> dict[str, Any]:
    """Offline, the pretrained config's hub weights as a file from the hub's cache, for
    ``pretrained_cfg_overlay``: timm downloads through the hub with no cache-only switch. Weights
    timm takes from a URL stay timm's (torch.hub's cache, which fails at once without network)."""
    import timm.models

    config = timm.models.get_pretrained_cfg(name)
    if config is None or not config.hf_hub_id:
        return {}
    repo, _, revision = config.hf_hub_id.partition("@")
    filename = config.hf_hub_filename or HUB_WEIGHTS
    path = cached_hub_file(repo, [*_safe_alternatives(filename), filename], revision or None)
    # what timm does with the hub's file: model.load_pretrained for custom_load "hf", else a state_dict
    return {"file": path, "custom_load": config.custom_load == "hf"}


def _create(name: str, pretrained: bool, image_size: int | None, hub_offline: bool) -> Any:
    import timm

    try:
        overlay = _cached_weights(name) if pretrained and hub_offline else {}
        if image_size is not None:
            try:  # models with a fixed input size (ViTs, Swin) are built for the new size, as timm does
                return timm.create_model(
                    name, pretrained=pretrained, img_size=image_size, pretrained_cfg_overlay=overlay
                )
            except TypeError as e:
                if "img_size" not in str(e):
                    raise
        return timm.create_model(name, pretrained=pretrained, pretrained_cfg_overlay=overlay)
    except RuntimeError as e:
        if "pretrained tag" in str(e):
            raise ExtractError(f"--model timm:{name}: {e} (timm.list_pretrained('{name.split('.')[0]}*'))") from None
        if not pretrained:
            raise
        raise download_failed(f"timm's pretrained weights for {name}", e) from None
    except OSError as e:  # huggingface_hub's errors offline (LocalEntryNotFoundError, ...) are OSErrors
        raise download_failed(f"timm's pretrained weights for {name}", e) from None


def build(name: str, request: ModelRequest) -> LoadedModel:
    import timm
    from timm.data import create_transform, resolve_model_data_config

    if not timm.is_model(name):
        raise ExtractError(
            f"unknown --model timm:{name}; closest: {closest(name, timm.list_models())} (timm.list_models() has all)"
        )
    if request.weights.lower() not in ("default", "none"):
        raise ExtractError(
            f"--weights {request.weights}: timm models take DEFAULT or none; name the weights by tag instead, "
            f"e.g. --model timm:{name.split('.')[0]}.TAG (timm.list_pretrained())"
        )
    pretrained = request.load_weights and request.weights.lower() == "default"
    model = _create(name, pretrained, request.image_size, request.hub_offline)
    args = {"img_size": request.image_size} if request.image_size is not None else None
    config = resolve_model_data_config(model, args=args)
    preprocess = create_transform(**config, is_training=False)
    tag = model.pretrained_cfg.get("tag")
    full_name = f"{name.split('.')[0]}.{tag}" if tag else name
    if pretrained:
        description = f"timm pretrained {full_name}"
    else:
        description = f"none (random init, seed {request.seed}; preprocessing of {full_name})"
    hints = {}
    if getattr(model, "output_fmt", None) == "NHWC":  # e.g. Swin: its stages compute in (B, H, W, C)
        hints = {info["module"]: "NHWC" for info in getattr(model, "feature_info", []) if "module" in info}
    _, height, width = config["input_size"]
    return LoadedModel(model, preprocess, (height, width), description, layout_hints=hints)
