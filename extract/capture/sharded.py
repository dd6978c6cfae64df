"""What a hook sees in a tensor-parallel model, made whole before it is staged.

Under transformers' tensor-parallel plan (``model._tp_plan``: module pattern -> style) a column-parallel
projection's output and a row-parallel projection's input (``o_proj@input``, the attention's per-head
output; ``down_proj@input``, the MLP's hidden activation) hold this rank's slice of the last dimension;
everything the plan reduces (a decoder layer's output, the residual stream, a norm, a row-parallel
output) is the same on every rank of the group. ``GroupGather`` gathers each sharded layer over the
group in rank order, so that the stored row is the 1-process row, and makes a ``DTensor`` whole by its
own placements. ``check`` proves the plan's reading on the set-up forward: a gathered layer must come out
at its module's full width, and every other layer must be equal on all ranks of the group (a module the
plan does not name but that computes on a slice, such as an activation between the projections, is
refused in one line that names it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ExtractError
from ..names.layers import LayerRef

# styles whose module's output is this rank's slice of the last dimension, in rank order
SHARDED_OUTPUTS = ("colwise", "unit_colwise")
# styles whose module's input is this rank's slice of the last dimension, in rank order
SHARDED_INPUTS = ("rowwise", "unit_rowwise")
# styles over a fused weight (gate and up in one matrix): the slices of the parts interleave
PACKED = ("packed_colwise", "packed_rowwise")


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "full_tensor")


@dataclass
class GroupGather:
    """The layers of a tensor-parallel model that are sharded over its group, and the gather of each.

    ``sharded`` maps a stored layer's name to the full width its module gives on one device."""

    group: Any  # torch.distributed ProcessGroup
    size: int
    sharded: dict[str, int] = field(default_factory=dict)
    styles: dict[str, str] = field(default_factory=dict)  # the plan's style of each layer's module, where named
    widths: dict[str, list[int]] = field(default_factory=dict)  # each rank's slice width, once per layer

    def __call__(self, name: str, value: torch.Tensor) -> torch.Tensor:
        if _is_dtensor(value):
            return value.full_tensor()
        if name not in self.sharded:
            return value
        widths = self.widths.get(name)
        if widths is None:
            # A slice's width is fixed by the plan (heads or features split as evenly as they go, so not
            # always equally), and all_gather needs equal shapes: learn every rank's width on the first batch,
            # then pad each slice to the widest and cut the padding off.
            mine = torch.tensor([value.shape[-1]], dtype=torch.int64, device=value.device)
            every = [torch.empty_like(mine) for _ in range(self.size)]
            torch.distributed.all_gather(every, mine, group=self.group)
            widths = self.widths[name] = [int(w) for w in torch.cat(every).tolist()]
        widest = max(widths)
        value = value.contiguous()
        if value.shape[-1] < widest:
            value = torch.nn.functional.pad(value, (0, widest - value.shape[-1]))
        parts = [torch.empty_like(value) for _ in range(self.size)]
        torch.distributed.all_gather(parts, value, group=self.group)
        if min(widths) == widest:
            return torch.cat(parts, dim=-1)
        return torch.cat([part[..., :width] for part, width in zip(parts, widths, strict=True)], dim=-1)

    def check(self, outputs: Mapping[str, torch.Tensor]) -> None:
        """On the set-up forward's captured (gathered) outputs: a sharded layer is at its full width, and
        every other is the same on each rank of the group; refused in one line otherwise."""
        for name, value in outputs.items():
            if name in self.sharded:
                width = self.sharded[name]
                if value.shape[-1] != width:
                    raise ExtractError(
                        f"layer '{name}' is sharded over the tensor-parallel group ({self.styles[name]}), but its "
                        f"{self.size} slices join to width {value.shape[-1]}, not the module's {width} (heads or "
                        "features repeated or uneven over the group); capture the module's output after its "
                        "reduction, or use a --tensor-parallel that divides its heads"
                    )
                continue
            parts = [torch.empty_like(value) for _ in range(self.size)]
            torch.distributed.all_gather(parts, value.contiguous(), group=self.group)
            if not all(torch.allclose(part, parts[0], rtol=1e-4, atol=1e-6) for part in parts[1:]):
                raise ExtractError(
                    f"layer '{name}' differs across the ranks of a tensor-parallel group: its module computes on "
                    "each rank's slice, and transformers' plan does not name it, so its slices cannot be put in "
                    "order; capture a projection the plan shards (such as mlp.down_proj@input for the MLP's "
                    "hidden activation, self_attn.o_proj@input for the heads) or a layer's output"
                )


def group_gather(model: nn.Module, refs: Sequence[LayerRef], group: Any, size: int) -> GroupGather:
    """Which of ``refs`` the model's tensor-parallel plan shards, read from ``model._tp_plan``; a layer
    over a packed (fused) weight is refused in one line."""
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    plan: Mapping[str, str] = getattr(model, "_tp_plan", None) or {}
    modules = dict(model.named_modules())
    gather = GroupGather(group, size)
    for ref in refs:
        style = plan.get(replace_layer_number_by_wildcard(ref.module)) or plan.get(ref.module)
        if style is None:
            continue
        gather.styles[ref.name] = style
        module = modules[ref.module]
        if style in PACKED:
            raise ExtractError(
                f"layer '{ref.name}': module {ref.module} is split over the tensor-parallel group as a packed "
                f"weight ({style}): each rank holds a slice of every projection fused in it, which do not join in "
                "order; capture the module's input or the layer's output, or run without --tensor-parallel"
            )
        if not ref.input and style in SHARDED_OUTPUTS:
            gather.sharded[ref.name] = int(module.out_features)  # type: ignore[arg-type]
        elif ref.input and style in SHARDED_INPUTS:
            gather.sharded[ref.name] = int(module.in_features)  # type: ignore[arg-type]
    return gather
