"""``BLOCK@router`` layers of a job: each mixture-of-experts block's routing, stored per token (logits as
the layer's rows, the top-k experts and weights as its codes; ``extract.capture.moe``). Set up after the
set-up forward, which told each router layer's packed width, and joined to the job's ``--sae`` codes."""

from __future__ import annotations

from torch import nn

from ..capture.moe import RouterCodes, router_codes
from ..capture.setup import LayerSetup, TextLayerSetup
from ..errors import ExtractError
from ..names.layers import LayerRef
from .saes import JobSaes


def setup_routing(model: nn.Module, refs: list[LayerRef], layers: LayerSetup) -> dict[str, RouterCodes]:
    """Each router layer's ``RouterCodes``; its stored rows become its logits (E per token)."""
    routers = [ref for ref in refs if ref.router]
    if routers and not (isinstance(layers, TextLayerSetup) and layers.per_token):
        raise ExtractError(
            f"layer '{routers[0].name}' is each token's routing: store it per token (--pool none, or --pack), "
            "or drop it to pool the other layers"
        )
    codes = {}
    for ref in routers:
        codes[ref.name] = router_codes(model, ref, layers.shapes[ref.name][0])
        layers.shapes[ref.name] = (codes[ref.name].d_sae,)
    return codes


def with_routing(saes: JobSaes | None, routing: dict[str, RouterCodes]) -> JobSaes | None:
    """The job's codes: its SAEs' and its routers'; an SAE given for a router layer is refused."""
    if not routing:
        return saes
    if saes is None:
        return JobSaes(dict(routing), only=False, sha256={})
    if both := sorted(set(saes.encoders) & set(routing)):
        raise ExtractError(
            f"--sae {both[0]}=...: '{both[0]}' is a router's routing, stored with its experts and weights already; "
            "give the SAE for the block's output or input"
        )
    return JobSaes({**saes.encoders, **routing}, saes.only, saes.sha256)
