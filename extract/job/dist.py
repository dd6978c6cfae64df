"""The process group, from accelerate: one object for rank, world size, device and barriers."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

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


@dataclass(frozen=True)
class Mesh:
    """The job's processes as data parallel × tensor parallel: W processes in ``data_world`` groups of
    ``tensor_parallel`` consecutive ranks. A group is one data rank: the plan, the writer and the store see
    ``data_rank`` and ``data_world``, never the raw rank. ``group`` is the group's process group (None
    without tensor parallelism); ``meshes`` are the device meshes transformers loads the model over."""

    data_rank: int
    data_world: int
    tensor_rank: int = 0
    tensor_parallel: int = 1
    group: Any = None
    meshes: Any = None  # models.hf_text.TensorMeshes: the dense and the expert mesh
    stop_group: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The stop flag travels over a group that serves CPU tensors: on GPUs ``group`` is NCCL's, whose
        # backend map has no CPU device (a CPU tensor there is "No backend type associated with device type
        # cpu"), and a flag on the GPU would make every batch's ``.item()`` wait for the forwards queued
        # before it. So a gloo twin of the group, made by its own ranks alone (use_local_synchronization:
        # every group builds its mesh at the same point, but need not wait for the others).
        if self.group is None:
            return
        stop = self.group
        if torch.device("cpu") not in self.group._device_types:
            ranks = torch.distributed.get_process_group_ranks(self.group)
            stop = torch.distributed.new_group(ranks, backend="gloo", use_local_synchronization=True)
        object.__setattr__(self, "stop_group", stop)

    @property
    def writes(self) -> bool:
        """One rank of each group stages and writes; the others run the forward and write nothing."""
        return self.tensor_rank == 0

    def record(self) -> dict[str, int]:
        return {"data_parallel": self.data_world, "tensor_parallel": self.tensor_parallel}

    def agree_to_stop(self, signum: int | None) -> int | None:
        """The signal that stops this rank's group now, if any rank of it has one (``signum`` is this
        rank's): its ranks run each forward together, so one that stopped alone would leave the others
        waiting in the forward's collectives."""
        if self.group is None:
            return signum
        flag = torch.tensor([signum or 0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.stop_group)
        return int(flag.item()) or None


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

    from ..models.hf_text import TensorMeshes

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
