"""The job's processes as one object (``Processes``): accelerate's state, which knows the launch (rank,
world, device, the process group), and the mesh over it (``Mesh``: data parallel × tensor parallel),
which knows what each process does. Everything below the runner asks it: the data's listing splits its
work over every process, the store's life cycle decides on the main process and broadcasts, the loops
ask whether this process writes. ``job/dist.py`` builds it at the start of a job.

A module of its own, low in the flow, so that data/, models/ and the store may type against it (they
import it for annotations only). torch and accelerate are imported where they are used: importing this
module costs nothing, and the store's modules stay light to import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch
    from accelerate import PartialState
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")


@dataclass(frozen=True)
class TensorMeshes:
    """The device meshes a tensor-parallel group loads its model over, named as transformers names them:
    ``dense`` (pp, dp_replicate, fsdp, tp) and ``expert`` (pp, dp_replicate, efsdp, ep); ``size`` ranks per
    group. ``dense["tp"]`` is this rank's group."""

    dense: DeviceMesh
    expert: DeviceMesh
    size: int
    experts: bool = False  # the model's experts are split over ``expert["ep"]`` (set by the model's loader)


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
    group: ProcessGroup | None = None
    meshes: TensorMeshes | None = None  # the dense and the expert mesh
    stop_group: ProcessGroup | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The stop flag travels over a group that serves CPU tensors: on GPUs ``group`` is NCCL's, whose
        # backend map has no CPU device (a CPU tensor there is "No backend type associated with device type
        # cpu"), and a flag on the GPU would make every batch's ``.item()`` wait for the forwards queued
        # before it. So a gloo twin of the group, made by its own ranks alone (use_local_synchronization:
        # every group builds its mesh at the same point, but need not wait for the others).
        if self.group is None:
            return
        import torch

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
        import torch

        flag = torch.tensor([signum or 0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.stop_group)
        return int(flag.item()) or None


class Processes:
    """This process among the job's: accelerate's ``state`` and the ``mesh`` over it.

    The raw ``process_index`` and ``num_processes`` (and ``is_main_process``) are accelerate's, under
    accelerate's names: work that every process shares alike (listing the data, surveying a corpus, the
    store's life cycle) splits over them. What a process extracts and writes goes by the mesh:
    ``data_rank`` of ``data_world``, and ``writes``."""

    def __init__(self, state: PartialState, mesh: Mesh | None = None) -> None:
        self.state = state
        self.mesh = mesh if mesh is not None else Mesh(state.process_index, state.num_processes)

    def __repr__(self) -> str:
        return f"Processes(rank {self.process_index} of {self.num_processes}, {self.mesh})"

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def data_rank(self) -> int:
        return self.mesh.data_rank

    @property
    def data_world(self) -> int:
        return self.mesh.data_world

    @property
    def tensor_rank(self) -> int:
        return self.mesh.tensor_rank

    @property
    def tensor_parallel(self) -> int:
        return self.mesh.tensor_parallel

    @property
    def group(self) -> ProcessGroup | None:
        return self.mesh.group

    @property
    def writes(self) -> bool:
        """Whether this process stages and writes its group's rows (one per tensor-parallel group)."""
        return self.mesh.writes

    def wait_for_everyone(self) -> None:
        """The barrier of every process of the job."""
        self.state.wait_for_everyone()

    def broadcast(self, value: T, from_process: int = 0) -> T:
        """``from_process``'s ``value`` (a picklable object), on every process."""
        if self.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        box = [value]
        broadcast_object_list(box, from_process=from_process)
        return box[0]

    def gather(self, value: T) -> list[T]:
        """Every process's ``value`` (a picklable object), in rank order, on every process."""
        if self.num_processes == 1:
            return [value]
        from accelerate.utils import gather_object

        return gather_object([value])

    def agree_to_stop(self, signum: int | None) -> int | None:
        """The signal that stops this process's tensor-parallel group (``Mesh.agree_to_stop``)."""
        return self.mesh.agree_to_stop(signum)

    def record(self) -> dict[str, Any]:
        return self.mesh.record()
