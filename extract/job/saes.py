"""``--sae LAYER=PATH``: the job's pretrained SAEs, loaded and matched to its layers before anything is
written (issue 32). Each is checked against its layer (``SaeEncoder.check``: width and hook name) and
becomes part of the job's identity (its weights' sha256), so that a resume with another SAE is refused.

Which layer an SAE is for: ``LAYER`` names one of ``--layers`` by the name the store gives it, or by any
other name of the same tensor (a TransformerLens hook name, ``blocks.1.hook_resid_post``, for the layer
given as ``transformer.h.1``). The SAE's own ``hook_name`` must name that tensor too: its name or
alias, or a TransformerLens hook name that resolves to it in this model."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..capture.moe import RouterCodes
from ..capture.sae import WEIGHTS, SaeEncoder, load_sae
from ..capture.setup import LayerSetup, TextLayerSetup
from ..errors import ExtractError
from ..names.layers import LayerRef


@dataclass
class JobSaes:
    """The layers stored with sparse codes, by the layer's stored name: the SAE of each ``--sae`` layer, and
    the routing of each ``BLOCK@router`` layer (``extract.capture.moe``); whether the SAE layers' raw rows
    are dropped (``--sae-only``: a router's logits are always kept)."""

    encoders: dict[str, SaeEncoder | RouterCodes]
    only: bool
    sha256: dict[str, str]  # each SAE's weights

    def records(self) -> dict[str, dict[str, Any]]:
        """What each ``latents/<layer>`` group records (``extract.store.latents.DESCRIPTION``)."""
        records: dict[str, dict[str, Any]] = {}
        for layer, e in self.encoders.items():
            common = {"d_sae": e.d_sae, "k": e.k, "architecture": e.architecture, "values_dtype": e.values_dtype}
            if isinstance(e, RouterCodes):
                records[layer] = {**common, "hook_name": e.router, "sae_path": None, "sae_sha256": None}
            else:
                records[layer] = {**common, "hook_name": e.hook_name, "sae_path": str(e.path),
                                  "sae_sha256": self.sha256[layer]}  # fmt: skip
        return records

    def identity(self) -> dict[str, Any]:
        """What decides the stored codes: each SAE's weights and k (a router's: the model's own), and
        whether the raw rows are kept."""
        layers = {
            layer: {"router": e.router, "k": e.k} if isinstance(e, RouterCodes) else {"sae_sha256": self.sha256[layer], "k": e.k}
            for layer, e in self.encoders.items()
        }  # fmt: skip
        return {"layers": layers, "only": self.only}

    def codes(self) -> dict[str, tuple[int, int, str]]:
        """Each layer's (k, d_sae, values dtype), as the writer takes them."""
        return {layer: (e.k, e.d_sae, e.values_dtype) for layer, e in self.encoders.items()}

    def row_bytes(self) -> int:
        """Bytes per row of the codes: an int32 index and a value per code."""
        return sum((4 + getattr(torch, e.values_dtype).itemsize) * e.k for e in self.encoders.values())

    def stored(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The layers stored raw: all but the SAE layers under ``--sae-only``."""
        return {name: shape for name, shape in shapes.items() if not (self.only and self._sae(name))}

    def _sae(self, name: str) -> bool:
        return isinstance(self.encoders.get(name), SaeEncoder)


def setup_saes(
    entries: list[str] | None,
    k: int,
    only: bool,
    refs: list[LayerRef],
    layers: LayerSetup,
    aliases: Mapping[str, LayerRef],
    device: torch.device,
) -> JobSaes | None:
    """Load each ``LAYER=PATH`` of ``entries`` and match it to its layer; None without ``--sae``."""
    if not entries:
        return None
    if not (isinstance(layers, TextLayerSetup) and layers.per_token):
        what = "a pooled (per document) text store" if isinstance(layers, TextLayerSetup) else "an image store"
        raise ExtractError(
            f"--sae encodes token rows, but this job writes {what}; use a text model with --pool none (or --pack)"
        )
    encoders, sha256 = {}, {}
    for entry in entries:
        name, _, path = entry.partition("=")
        ref = _layer(name, refs, aliases)
        # loaded on the host (safetensors refuses torch's "cpu:0"), then put where the rows are
        encoder = load_sae(path, k=None, device="cpu")
        if device.type != "cpu":
            encoder.to(device)
        if encoder.own_k is None:  # a top-k SAE keeps its own k
            encoder.k = k
        shape = layers.shapes[ref.name]
        encoder.check(ref, shape[0] if len(shape) == 1 else -1, alias_of=aliases.get)
        encoders[ref.name], sha256[ref.name] = encoder, _sha256(Path(path) / WEIGHTS)
    return JobSaes(encoders, only, sha256)


def _layer(name: str, refs: list[LayerRef], aliases: Mapping[str, LayerRef]) -> LayerRef:
    """The job's layer that ``--sae NAME=...`` names: by its stored name, its module, or an alias of it."""
    target = aliases.get(name)
    for ref in refs:
        if name in (ref.name, ref.target) or (target is not None and target.target == ref.target):
            return ref
    given = ", ".join(ref.name for ref in refs)
    raise ExtractError(f"--sae {name}=...: '{name}' is not one of --layers ({given}); add it to --layers")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()
