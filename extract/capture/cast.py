"""The cast of a captured layer to the storage dtype, checked: never an inf the model did not compute.

float16 holds |x| up to 65504, and a value from 65520 up becomes inf when cast (the "massive
activations" of large language models reach that). ``finite_peak`` is a batch's largest finite |x|,
computed where the batch is (on a GPU: on its stream, no synchronization; the staging pool copies it
to the host with the batch); ``check`` raises ``CastOverflowError`` when the cast would turn it into
inf. The model's own inf and NaN are left out of the peak: they are stored as computed, and counted
apart (the writer's ``infinite``, the statistics' ``infinite``), never blamed on the cast.
"""

from __future__ import annotations

import torch

from ..errors import CastOverflowError

# what a store can hold instead, in the order a fix is suggested (2 bytes a value first)
WIDER = ("bfloat16", "float32")


def narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting ``source`` values to ``target`` can overflow (float32 to float16 or bfloat16;
    bfloat16 to float16): only then is a batch checked."""
    return source.is_floating_point and torch.finfo(target).max < torch.finfo(source).max


def finite_peak(value: torch.Tensor) -> torch.Tensor:
    """The largest finite |x| of ``value`` (0 for none), a float32 scalar on ``value``'s device.

    On the CPU one pass, ``aminmax`` (as fast as the cast's copy; abs, nan_to_num and amax take 5x
    that), unless the batch holds the model's own inf or NaN; on a GPU the three passes always (no
    synchronization to ask which, and they cost microseconds at its bandwidth)."""
    value = value.detach()
    if value.device.type == "cpu":
        low, high = torch.aminmax(value)
        peak = torch.maximum(low.abs(), high.abs())
        if bool(torch.isfinite(peak)):  # no synchronization to pay on the CPU
            return peak.float()
    return torch.nan_to_num_(value.abs(), nan=0.0, posinf=0.0).amax().float()


def overflows(peak: float, dtype: torch.dtype | str) -> bool:
    """Whether ``peak`` becomes inf when cast to ``dtype`` (with the cast's own rounding)."""
    target = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return bool(torch.isinf(torch.tensor(peak, dtype=torch.float64).to(target)))


def check(layer: str, peak: float, dtype: torch.dtype, where: str) -> None:
    """Raise ``CastOverflowError`` if storing ``layer``, whose largest finite |x| is ``peak`` (seen
    ``where``), as ``dtype`` would make an inf."""
    if not overflows(peak, dtype):
        return
    name = str(dtype).removeprefix("torch.")
    fits = [other for other in WIDER if other != name and not overflows(peak, other)]
    fix = " or ".join(f"--dtype {other}" for other in fits) or "a model whose values fit float32"
    raise CastOverflowError(
        f"layer '{layer}' reaches |x| = {peak:.4g} {where}, beyond {name}'s largest value "
        f"({torch.finfo(dtype).max:.6g}): stored as {name} it would be inf; rerun with {fix} "
        f"(and --overwrite if --out already holds this job's {name} store: a store resumes only in its own dtype)"
    )


def check_batch(layer: str, value: torch.Tensor, dtype: torch.dtype | None, where: str) -> None:
    """``check`` a whole captured ``value`` now (it synchronizes: for the set-up forward, not the loop)."""
    if dtype is not None and value.numel() and narrows(value.dtype, dtype):
        check(layer, float(finite_peak(value)), dtype, where)
