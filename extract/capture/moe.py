"""Mixture-of-experts routing, captured per token (``BLOCK@router``).

A transformers MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) flattens its input to (B*T, H) and
hands it to its router (``block.gate``, a ``...TopKRouter``), which returns ``(logits, weights, experts)``:
the logits over the E experts (what ``output_router_logits=True`` collects), and each token's top-k
experts with their weights, as the block then uses them (softmax, top-k, renormalized where the model
says so). ``BLOCK@router`` keeps all three, computed by the model itself, never again here:

- the logits are the layer's rows, ``features/BLOCK@router`` (E per token);
- the experts and weights are stored sparse as SAE codes are, ``latents/BLOCK@router/indices`` (int32
  expert ids) and ``values`` (float32 weights), with each chunk's per-expert statistics (tokens routed to
  each expert, the weight they got): the load of every expert.

The hook packs the three into one float32 tensor (B, T, E + 2k), so that the text loop's token selection
and the tensor-parallel checks treat it as any other layer; ``RouterCodes`` unpacks it at staging.

An expert's own output sees only the tokens routed to it, so it has no row per token: it is refused
(``check_moe_layers``), naming the block's output and its routing as the per-token alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ExtractError
from ..names.layers import ROUTER_SUFFIX, LayerRef
from .sae import LatentStats, SparseCodes

ROUTER_CHILDREN = ("gate", "router")  # what transformers' MoE blocks call their router
EXPERTS_CHILD = "experts"
ARCHITECTURE = "router"  # what ``latents/BLOCK@router`` records as its architecture


def _router_child(module: nn.Module) -> str | None:
    """The name of ``module``'s router child (a ``...TopKRouter`` called ``gate`` or ``router``), if any.
    Some families call theirs a ``...Gate`` (HunYuan-MoE): one with its own ``num_experts`` and ``top_k``
    is a top-k router too, where a plain ``nn.Linear`` gate (logits only) is not."""
    for child in ROUTER_CHILDREN:
        sub = getattr(module, child, None)
        if not isinstance(sub, nn.Module):
            continue
        kind = type(sub).__name__.lower()
        if "router" in kind:
            return child
        if kind.endswith("gate") and all(isinstance(getattr(sub, a, None), int) for a in ("num_experts", "top_k")):
            return child
    return None


def router_name(model: nn.Module, block: str) -> str:
    """The router of MoE block ``block`` (``model.layers.0.mlp`` -> ``model.layers.0.mlp.gate``); refused
    in one line where ``block`` has none."""
    child = _router_child(model.get_submodule(block))
    if child is not None:
        return f"{block}.{child}"
    blocks = moe_blocks(model)
    hint = f"; its MoE blocks are e.g. {blocks[0]}{ROUTER_SUFFIX}" if blocks else "; this model has no MoE block"
    raise ExtractError(
        f"layer '{block}{ROUTER_SUFFIX}': {block} is not a mixture-of-experts block (no router child "
        f"{' or '.join(ROUTER_CHILDREN)}){hint}"
    )


def moe_blocks(model: nn.Module) -> list[str]:
    """The model's MoE blocks: the modules with a router child."""
    return [name for name, module in model.named_modules() if _router_child(module) is not None]


def check_moe_layers(model: nn.Module, refs: Sequence[LayerRef]) -> None:
    """Refuse in one line a layer inside an MoE block's experts: an expert computes only on the tokens
    routed to it (and the fused experts module on a flattened (B*T, H) batch), so it has no row per token."""
    blocks = moe_blocks(model)
    for ref in refs:
        for block in blocks:
            experts = f"{block}.{EXPERTS_CHILD}"
            if ref.module == experts or ref.module.startswith(experts + "."):
                raise ExtractError(
                    f"layer '{ref.name}' is inside the experts of mixture-of-experts block {block}: an expert "
                    "sees only the tokens routed to it, so it has no row per token; capture the block's output "
                    f"'{block}' (one row per token) or its routing '{block}{ROUTER_SUFFIX}' (each token's experts "
                    "and weights)"
                )


def pack_routing(output: Any, lead: torch.Size, name: str) -> torch.Tensor:
    """The router's ``(logits, weights, experts)`` over the block's flattened tokens, as one float32
    tensor (*lead, E + 2k): logits, then weights, then expert ids (exact in float32: ids < 2**24)."""
    if not (isinstance(output, (tuple, list)) and len(output) == 3 and all(map(torch.is_tensor, output))):
        kind = type(output).__name__
        raise ExtractError(
            f"layer '{name}': the router returns a {kind}, not (logits, weights, experts) as transformers' "
            "top-k routers do; capture the block's output instead"
        )
    logits, weights, experts = output
    parts = [logits.float(), weights.float(), experts.float()]
    return torch.cat([part.reshape(*lead, part.shape[-1]) for part in parts], dim=-1)


@dataclass
class RouterCodes:
    """What staging needs to unpack a router layer (``HostStaging``'s ``encoders``, as an SAE's): the
    logits are the layer's raw rows, the experts and weights its codes. ``d_sae`` is the number of
    experts; ``k`` the experts per token."""

    router: str  # the router module's name
    d_sae: int
    k: int
    dtype: str = "float32"  # what the packed rows are read as
    values_dtype: str = "float32"  # routing weights: kept as the router gives them
    architecture: str = ARCHITECTURE

    def new_stats(self, device: torch.device | str = "cpu") -> LatentStats:
        return LatentStats.zeros(self.d_sae, device)

    def raw(self, packed: torch.Tensor) -> torch.Tensor:
        """The logits: the layer's stored rows."""
        return packed[..., : self.d_sae]

    def encode(self, packed: torch.Tensor, stats: LatentStats | None = None) -> SparseCodes:
        """The experts (int32) and their weights of packed rows (rows, E + 2k); ``stats`` counts each
        expert's tokens and weight."""
        weights = packed[:, self.d_sae : self.d_sae + self.k].contiguous()
        experts = packed[:, self.d_sae + self.k :].to(torch.int32)
        if stats is not None:
            dense = torch.zeros((len(packed), self.d_sae), dtype=torch.float32, device=packed.device)
            dense.scatter_(1, experts.long(), weights)
            stats.update(dense, weights, self.k)
        return SparseCodes(experts, weights)


def router_codes(model: nn.Module, ref: LayerRef, packed_width: int) -> RouterCodes:
    """``RouterCodes`` of ``ref`` from its set-up forward's packed width (E + 2k) and its router's experts."""
    name = router_name(model, ref.module)
    router = model.get_submodule(name)
    experts = getattr(router, "num_experts", None)
    k = getattr(router, "top_k", None)
    if not isinstance(experts, int) or not isinstance(k, int) or experts + 2 * k != packed_width:
        raise ExtractError(
            f"layer '{ref.name}': its router's output (width {packed_width}) is not E logits and k experts with "
            f"their weights (num_experts={experts}, top_k={k}); capture the block's output instead"
        )
    return RouterCodes(name, experts, k)
