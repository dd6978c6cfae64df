"""An SAE's saved files checked without loading them (issue 47): ``--sae LAYER=PATH`` is refused in one
line, when the job's options are checked and before any model loads or any store or lock exists, where
the directory is not what ``SAE.save_model`` writes or contradicts itself. Nothing here imports torch
or sae_lens: the config is JSON, and a safetensors file is an 8-byte little-endian header length, a JSON
header naming each tensor's dtype, shape and byte range, then the bytes (safetensors' own format).

What is checked: both files are there; ``cfg.json`` is a JSON object with positive integers ``d_in`` and
``d_sae`` and, where it asks one, a ``k`` from 1 to ``d_sae`` (sae_lens's top-k would fail inside the
job, or keep nothing); the weights' header parses, its byte ranges cover the file exactly (a torn or
padded file is named), and the encoder's and decoder's shapes are the config's."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import SaeInvalidError, SaeNotFoundError

CFG = "cfg.json"  # sae_lens.constants.SAE_CFG_FILENAME
WEIGHTS = "sae_weights.safetensors"  # sae_lens.constants.SAE_WEIGHTS_FILENAME
MAX_HEADER = 100_000_000  # safetensors' own limit on the header's length
# the tensors whose shapes the config decides, where an architecture has them (sae_lens's names)
SHAPES = {"W_enc": ("d_in", "d_sae"), "W_dec": ("d_sae", "d_in"), "b_enc": ("d_sae",), "b_dec": ("d_in",)}


def check_saved_sae(path: str | Path) -> dict[str, Any]:
    """The config of the SAE saved in directory ``path``, once its files are checked (see the module);
    raises ``SaeNotFoundError`` (a file missing) or ``SaeInvalidError`` (one line naming the file)."""
    path = Path(path)
    for name in (CFG, WEIGHTS):
        if not (path / name).is_file():
            what = "no such directory" if not path.is_dir() else f"it has no {name}"
            raise SaeNotFoundError(
                f"--sae {path} is not an SAE saved by SAELens ({what}); give a directory with {CFG} and {WEIGHTS}"
            )
    cfg = _config(path)
    _check_weights(path, cfg)
    return cfg


def _config(path: Path) -> dict[str, Any]:
    where = f"its {CFG}"
    try:
        cfg = json.loads((path / CFG).read_bytes())
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise SaeInvalidError(f"--sae {path}: {where} is not JSON ({_first_line(e)}); save the SAE again") from None
    if not isinstance(cfg, dict):
        raise SaeInvalidError(f"--sae {path}: {where} holds {type(cfg).__name__}, not a config; save the SAE again")
    for key in ("d_in", "d_sae"):
        if not _positive_int(cfg.get(key)):
            raise SaeInvalidError(
                f"--sae {path}: {where} has {key}={cfg.get(key)!r}, not a positive integer; save the SAE again"
            )
    k = cfg.get("k")
    # a number (sae_lens's batch top-k trains with a float k): the codes kept per token are int(k)
    if k is not None and not (type(k) in (int, float) and 1 <= k <= cfg["d_sae"]):
        raise SaeInvalidError(
            f"--sae {path}: {where} asks k={k!r} codes per token of d_sae={cfg['d_sae']} latents; a top-k SAE keeps "
            f"1 to d_sae codes: give an SAE whose k is in that range"
        )
    return cfg


def _check_weights(path: Path, cfg: Mapping[str, Any]) -> None:
    where = f"its {WEIGHTS}"
    size = (path / WEIGHTS).stat().st_size
    with (path / WEIGHTS).open("rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or not 0 < length <= min(MAX_HEADER, size - 8):
            raise SaeInvalidError(f"--sae {path}: {where} is not safetensors (or is torn: {size} bytes); save the SAE again")
        try:
            header = json.loads(f.read(length))
            tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
            ends = [int(entry["data_offsets"][1]) for entry in tensors.values()]
            shapes = {name: [int(n) for n in entry["shape"]] for name, entry in tensors.items()}
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise SaeInvalidError(
                f"--sae {path}: {where} has no readable safetensors header ({_first_line(e)}); save the SAE again"
            ) from None
    data = size - 8 - length
    if data != max(ends, default=0):
        torn = "torn" if data < max(ends, default=0) else "longer than its tensors"
        raise SaeInvalidError(
            f"--sae {path}: {where} is {torn}: its header says {max(ends, default=0)} bytes of tensors, the file holds "
            f"{data}; copy or save the SAE again"
        )
    for name, dims in SHAPES.items():
        want = [cfg[dim] for dim in dims]
        if name in shapes and shapes[name] != want:
            said = " x ".join(f"{dim}={cfg[dim]}" for dim in dims)
            raise SaeInvalidError(
                f"--sae {path}: {where} holds {name} of shape {tuple(shapes[name])}, but its {CFG} says {said}; "
                "the two files are of different SAEs"
            )


def _positive_int(value: Any) -> bool:
    return type(value) is int and value > 0  # noqa: E721 - a JSON true is no width


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
