"""What both ``hf:`` sources (vision, ``extract.models.hf``; text, ``extract.models.hf_text``) share:
where a model's files are (a ``save_pretrained`` directory, the Hugging Face cache, the hub), loading a
part of it with messages that name the missing file, the ``hidden_states.N`` aliases found in one
forward, and TransformerLens's hook names (text; the table is ``extract.capture.lens``). A module of its own, so that neither source imports the other's loaders.

transformers and huggingface_hub are imported only when a model is built."""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..capture import Capture
from ..capture.lens import lens_aliases
from ..capture.setup import model_failed
from ..errors import ExtractError
from ..names.layers import LayerRef
from .base import download_failed

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


def model_file(name: str, filename: str, hub_offline: bool) -> Path | None:
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


IMAGE_PARTS = "model and image processor"  # what a save_pretrained directory must hold, for messages


def load_pretrained(what: str, name: str, load: Any, hub_offline: bool, parts: str = IMAGE_PARTS) -> Any:
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
    except Exception as e:
        if not _unreadable_weights(e):
            raise
        raise _damaged_in_cache(name, e) from None
    try:
        return load(name)
    except (OSError, ValueError) as e:
        raise _not_found(what, name, e, parts) from None
    except Exception as e:
        if not _unreadable_weights(e):
            raise
        raise _damaged_in_cache(name, e) from None


def _damaged_in_cache(name: str, error: BaseException) -> ExtractError:
    """A weights file of a hub model, in the Hugging Face cache, that cannot be read (a download cut short)."""
    first = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, pickle.UnpicklingError):
        first = "not a checkpoint torch.load can read"
    return ExtractError(
        f"--model hf:{name}: its weights in the Hugging Face cache cannot be read ({error.__class__.__name__}: "
        f"{first}): the download was cut short or damaged; remove it from the cache (hf cache rm model/{name}) "
        "and run again"
    )


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
    except Exception as e:
        if not _unreadable_weights(e):
            raise
        raise _damaged_weights(name, e) from None


def _unreadable_weights(error: BaseException) -> bool:
    """Whether ``error`` is a weights file that cannot be read: safetensors' header check, or
    ``torch.load`` on a ``.bin`` that is not a whole checkpoint (cut short, or not one at all)."""
    if type(error).__module__.startswith("safetensors"):  # SafetensorError, from its Rust extension
        return True
    return isinstance(error, pickle.UnpicklingError) or (
        isinstance(error, RuntimeError) and "PytorchStreamReader" in str(error)
    )


def _damaged_weights(name: str, error: BaseException) -> ExtractError:
    """One line naming the weights file that cannot be read. transformers' own exceptions say neither
    which file (a sharded model has many) nor the fix, and torch's suggests ``weights_only=False``,
    which would not help a file cut short and would run whatever a damaged pickle holds."""
    files = sorted(p.name for p in Path(name).iterdir() if p.suffix in (".safetensors", ".bin"))
    culprit = next(
        (file for file in files if file.endswith(".safetensors") and not _safetensors_readable(Path(name, file))), None
    )
    where = culprit or " or ".join(files) or "its weights file"
    first = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, pickle.UnpicklingError):  # torch's text is advice to load unsafely, not the cause
        first = "not a checkpoint torch.load can read"
    return ExtractError(
        f"--model hf:{name}: {where} cannot be read ({error.__class__.__name__}: {first}): it is truncated or "
        "damaged; write the model there again with save_pretrained (or download it again)"
    )


def _safetensors_readable(path: Path) -> bool:
    """Whether safetensors opens ``path``: it checks the header and that the tensors cover the file
    exactly, reading no tensor, so a file cut short or of random bytes fails here at once."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            return True
    except Exception:  # noqa: BLE001 - any failure is the answer: not readable
        return False


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
    model: nn.Module,
    example: Any,
    call: Callable[[Callable[..., Any], Any], Any] = _pixels,
    failures: list[str] | None = None,
) -> dict[str, LayerRef]:
    """``hidden_states.N`` -> the module whose output is that hidden state, found by identity (or
    the same memory, see ``_same_tensor``) in one forward of ``example`` with
    ``output_hidden_states=True``; ``call(module, example)`` runs a module the way the source does
    (``pixel_values=`` for vision, ``**inputs`` for text). When several modules return it, the
    outermost (it finishes last), so that a change it makes after its children return is captured too.
    Where the forward fails, there are none, and the model's error in one line is added to ``failures``."""
    try:
        with Capture(model, retain="reference") as cap, torch.inference_mode():
            result = call(functools.partial(model, output_hidden_states=True), example)
    except Exception as e:  # noqa: BLE001 - a model without hidden states just has no aliases
        _failed(failures, example, e)
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


def transformer_lens_aliases(
    model: nn.Module,
    config: Any,
    example: Any,
    call: Callable[[Callable[..., Any], Any], Any],
    failures: list[str] | None = None,
) -> tuple[dict[str, LayerRef], dict[str, str]]:
    """TransformerLens's hook names of a causal LM -> the tensors they are, and the names it has no
    tensor for -> why (``extract.capture.lens.lens_aliases``), decided by one forward of ``example``
    under ``Capture``; none where that forward fails (added to ``failures`` as ``hidden_state_aliases``)."""

    def shapes_of(refs: list[LayerRef]) -> dict[str, list[Any]]:
        with Capture(model, refs, retain="shape") as cap, torch.inference_mode():
            call(model, example)
        return cap.by_module()

    try:
        return lens_aliases(model, config, shapes_of)
    except Exception as e:  # noqa: BLE001 - a model that cannot run here just has no such names
        _failed(failures, example, e)
        return {}, {}


def _failed(failures: list[str] | None, example: Any, error: BaseException) -> None:
    """Keep the model's own error for the names its forward would have found: asked for, such a name
    is refused with it (``resolve_layers``), not as a module the model lacks."""
    if failures is not None and not failures:
        failures.append(str(model_failed(example, error)))
