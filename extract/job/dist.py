"""The job's processes, started: accelerate's state (``process_state``) and the mesh over it (``job_mesh``),
as the one object everything below the runner takes (``extract.processes.Processes``)."""

from __future__ import annotations

import errno
import os
from datetime import timedelta

import torch
from accelerate import PartialState
from accelerate.utils import InitProcessGroupKwargs

from ..errors import ExtractError, ProcessGroupError
from ..processes import Mesh, Processes, TensorMeshes

__all__ = ["Mesh", "Processes", "job_mesh", "process_state", "start_processes"]


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


def job_mesh(state: PartialState, tensor_parallel: int | None) -> Mesh:
    """The mesh of ``--tensor-parallel N`` over this launch, refused in one line where N does not divide the
    processes of each node (a group never spans nodes: its collectives run on every layer)."""
    size = tensor_parallel or 1
    world, rank = state.num_processes, state.process_index
    if size == 1:
        return Mesh(rank, world)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local % size or world % size:
        raise ExtractError(
            f"--tensor-parallel {size} does not divide the {local} processes of this node (of {world} in all); "
            f"launch a multiple of {size} processes per node, or give a --tensor-parallel that divides {local}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    device = state.device.type
    data = world // size
    # transformers' own mesh names: its loader shards over "tp", and "dp_replicate" is data parallel; an MoE
    # model's experts are split over "ep", the same ranks as "tp" (ep_size == tp_size: one group shares a batch)
    dense = init_device_mesh(device, (1, data, 1, size), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    expert = init_device_mesh(device, (1, data, 1, size), mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    tensor = dense["tp"]
    return Mesh(
        rank // size, data, tensor.get_local_rank(), size, tensor.get_group(), TensorMeshes(dense, expert, size)
    )


def start_processes(timeout: float, tensor_parallel: int | None) -> Processes:
    """This launch's processes, with the mesh of ``--tensor-parallel`` (refused where it does not fit)."""
    state = process_state(timeout)
    return Processes(state, job_mesh(state, tensor_parallel))
