"""The process group, from accelerate: one object for rank, world size, device and barriers."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from accelerate import PartialState
from accelerate.utils import InitProcessGroupKwargs

from ..errors import ExtractError


def process_state(timeout: float = 1800.0) -> PartialState:
    """Accelerate's state, built so that CPU-only multi-process launches get gloo and real ranks.

    Without ``cpu=True`` on a machine with no CUDA, ``accelerate launch --multi_gpu`` starts
    processes that each believe they are rank 0 of 1 and would all write every chunk.
    ``timeout`` bounds every barrier, so a rank that died cannot leave the others waiting forever.
    """
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=timeout)).to_kwargs()
    state = PartialState(cpu=not torch.cuda.is_available(), **group)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and state.num_processes != launched:
        raise ExtractError(
            f"the launcher started {launched} processes but this one sees a world of {state.num_processes}; "
            "on CPU launch with `accelerate launch --multi_gpu --num_processes N`"
        )
    return state
