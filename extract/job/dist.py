"""The process group, from accelerate: one object for rank, world size, device and barriers."""

from __future__ import annotations

import errno
import os
from datetime import timedelta

import torch
from accelerate import PartialState
from accelerate.utils import InitProcessGroupKwargs

from ..errors import ExtractError, ProcessGroupError


def process_state(timeout: float = 1800.0) -> PartialState:
    """Accelerate's state, built so that CPU-only multi-process launches get gloo and real ranks.

    Without ``cpu=True`` on a machine with no CUDA, ``accelerate launch --multi_gpu`` starts
    processes that each believe they are rank 0 of 1 and would all write every chunk.
    ``timeout`` bounds every barrier, so a rank that died cannot leave the others waiting forever.
    """
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=timeout)).to_kwargs()
    try:
        state = PartialState(cpu=not torch.cuda.is_available(), **group)
    except (RuntimeError, OSError) as e:  # torch's DistError (store, network, gloo) is a RuntimeError
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            raise
        raise _not_connected(e) from None
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and state.num_processes != launched:
        raise ExtractError(
            f"the launcher started {launched} processes but this one sees a world of {state.num_processes}; "
            "on CPU launch with `accelerate launch --multi_gpu --num_processes N`"
        )
    return state


def _not_connected(error: BaseException) -> ProcessGroupError:
    """A reset, refused or timed-out rendezvous: most often another job, or processes left over from one,
    on the same port, which then meet (or refuse) this job's ranks. A rank that hosts the rendezvous (rank
    0 where no launcher's agent hosts it: SLURM's srun, ranks started by hand) and finds the port taken
    knows the cause for sure (torch's DistNetworkError names EADDRINUSE), and says so."""
    cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
    port = os.environ.get("MASTER_PORT", "29500")
    if "EADDRINUSE" in cause or getattr(error, "errno", None) == errno.EADDRINUSE:
        return ProcessGroupError(
            f"MASTER_PORT {port} is already in use on this host (EADDRINUSE): another job, or a process left over "
            "from one, listens there; launch with a free --main_process_port (torchrun: --master_port)"
        )
    return ProcessGroupError(
        f"the processes of this job could not connect to each other ({cause[:200]}); another job, or processes "
        f"left over from one, may be using MASTER_PORT {port}: stop them, or launch with a free "
        "--main_process_port (torchrun: --master_port)"
    )
