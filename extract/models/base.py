"""What every model source is (its declaration), what it returns, and what is common to all of them
(checkpoints, errors, the record of the preprocessing, reading the Hugging Face hub's cache offline)."""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..errors import ExtractError
from ..names import ModelKind
from ..names.layers import LayerRef

if TYPE_CHECKING:
    from ..processes import TensorMeshes

Transform = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class ModelRequest:
    """The options of the job a source needs. ``load_weights`` is False where nothing may be loaded
    or downloaded: ``--list-layers``, and with ``--checkpoint`` (its file gives the weights; the
    named weights still choose the preprocessing)."""

    weights: str
    checkpoint: str | None
    seed: int
    image_size: int | None
    load_weights: bool
    hub_offline: bool = False  # the Hugging Face hub is not reachable: read its cache only (see hub_offline())
    precision: str | None = None  # fp32 | bf16 | fp16: the dtype text models load their weights in (None: fp32)
    device_map: str | None = None  # "auto": a text model spread over the process's GPUs (accelerate big-model dispatch)
    tensor_parallel: TensorMeshes | None = None  # a text model split over its group with transformers' plan

    @property
    def random_init(self) -> bool:
        return self.weights.lower() == "none" or not self.load_weights


@dataclass
class LoadedModel:
    """A model in eval mode with its own preprocessing.

    ``preprocess`` maps a PIL image to a (3, H, W) float tensor and runs in DataLoader workers;
    ``input_name`` is the keyword the model takes its pixels by (``pixel_values`` for transformers),
    ``None`` for a positional argument. ``aliases`` are extra layer names (``hidden_states.N``,
    TransformerLens's ``blocks.N.hook_resid_pre``), ``absent_aliases`` the names of that kind this
    model has no tensor for, with why (``--layers`` says it in one line), ``alias_failure`` the model's
    own error where the forward that finds them failed (such a name is refused with it), and
    ``layout_hints`` map module names to the layout (``NHWC``...) of their outputs where the source
    knows it and the shapes cannot tell (see ``extract.capture.layout``). ``kind`` says what it
    takes: ``ModelKind.IMAGE`` here, ``ModelKind.TEXT`` for ``extract.models.hf_text.TextModel``.
    """

    kind: ClassVar[ModelKind] = ModelKind.IMAGE

    model: nn.Module
    preprocess: Transform
    input_size: tuple[int, int]
    weights: str
    source: str = ""
    checkpoint_sha256: str | None = None
    aliases: dict[str, LayerRef] = field(default_factory=dict)
    absent_aliases: dict[str, str] = field(default_factory=dict)
    alias_failure: str | None = None  # the model's error where the forward that finds the aliases failed
    input_name: str | None = None
    layout_hints: dict[str, str] = field(default_factory=dict)

    def call(self, module: Callable[..., Any], pixels: torch.Tensor) -> Any:
        """Run ``module`` (the model, or a capture's forward) on a batch the way this source expects."""
        return module(**{self.input_name: pixels}) if self.input_name else module(pixels)

    def example(self, batch: int = 2, device: torch.device | str = "cpu", scale: int = 1) -> torch.Tensor:
        height, width = self.input_size
        return torch.zeros(batch, 3, height * scale, width * scale, device=device)

    @property
    def preprocessing(self) -> dict[str, Any]:
        return {"source": self.source, **preprocessing_record(self.preprocess)}


Builder = Callable[[str, ModelRequest], LoadedModel]


_PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def _interpolation(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, int):
        return _PIL_RESAMPLE.get(value, str(value))
    return str(getattr(value, "value", value)).lower()


def _floats(values: Any) -> list[float] | None:
    return None if values is None else [round(float(v), 8) for v in values]


def _size(value: Any) -> int | list[int] | None:
    """torchvision's convention: one number is the shorter side, two are (height, width)."""
    if value is None:
        return None
    if isinstance(value, int):
        return value
    values = [int(v) for v in value]
    return values[0] if len(values) == 1 else values


def preprocessing_record(preprocess: Any) -> dict[str, Any]:
    """What the preprocessing does, for the store's attributes and for readers: its repr, plus
    mean, std, interpolation, resize (shorter side, or [h, w]) and crop ([h, w]) where it says."""
    from torchvision import transforms
    from torchvision.transforms._presets import ImageClassification

    record: dict[str, Any] = {"repr": repr(preprocess), "mean": None, "std": None}
    record.update(interpolation=None, resize=None, crop=None)
    if hasattr(preprocess, "preprocessing_record"):
        record.update(preprocess.preprocessing_record())
    elif isinstance(preprocess, ImageClassification):
        record.update(
            mean=_floats(preprocess.mean),
            std=_floats(preprocess.std),
            interpolation=_interpolation(preprocess.interpolation),
            resize=_size(preprocess.resize_size),
            crop=_size(preprocess.crop_size),
        )
    elif isinstance(preprocess, transforms.Compose):
        for step in preprocess.transforms:
            if isinstance(step, transforms.Resize):
                record.update(resize=_size(step.size), interpolation=_interpolation(step.interpolation))
            elif isinstance(step, transforms.CenterCrop):
                record["crop"] = _size(step.size)
            elif isinstance(step, transforms.Normalize):
                record.update(mean=_floats(step.mean), std=_floats(step.std))
    if isinstance(record["crop"], int):
        record["crop"] = [record["crop"], record["crop"]]
    return record


def download_failed(
    what: str, error: BaseException, fix: str = "use --weights none (random init) or --checkpoint PATH"
) -> ExtractError:
    first = (str(error).strip().splitlines() or [""])[0]
    return ExtractError(f"could not load {what} ({error.__class__.__name__}: {first}); without network {fix}")


def load_checkpoint(model: nn.Module, checkpoint: str | Path) -> str:
    """Load a state_dict (safely: ``weights_only=True``) into ``model``; returns the file's sha256."""
    path = Path(checkpoint)
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


def hub_offline() -> bool:
    """Whether the Hugging Face hub (timm, transformers and OpenCLIP download through it) is to be
    read from its cache only: ``HF_HUB_OFFLINE`` says so, or its endpoint's name does not resolve
    (the hub would retry for most of a minute before using its cache). Behind a proxy the name need
    not resolve here, so nothing is decided then. Sources pass ``local_files_only=True`` where this
    holds; nothing of the hub's own settings is changed."""
    try:
        import huggingface_hub.constants as hub
    except ImportError:
        return False
    if hub.HF_HUB_OFFLINE:
        return True
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    try:
        socket.getaddrinfo(urllib.parse.urlparse(hub.ENDPOINT).hostname or "", 443)
    except OSError:
        return True
    return False


def cached_hub_file(repo_id: str, filenames: Sequence[str], revision: str | None = None) -> str:
    """The first of ``filenames`` (in order of preference) that the Hugging Face cache holds for
    ``repo_id``, found without the network; raises the hub's ``LocalEntryNotFoundError`` (an
    ``OSError``) for the last one when none is there."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    *preferred, last = filenames
    for filename in preferred:
        try:
            return huggingface_hub.hf_hub_download(repo_id, filename, revision=revision, local_files_only=True)
        except LocalEntryNotFoundError:
            continue
    return huggingface_hub.hf_hub_download(repo_id, last, revision=revision, local_files_only=True)
