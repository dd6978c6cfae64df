"""The GPU paths' logic, run where it can be emulated on the CPU (issue 49): the tensor-parallel stop flag
over a process group whose backend map has no CPU device (NCCL's), all_gather of unequal shards, the
nvjpeg decoder's EXIF routing and its placeholder for a bad image, and the GPU check refusing to pass
without CUDA. What needs a device is in tests/test_cuda*.py and benchmarks/gpu_check.sh."""

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.launches import free_port

# ---------------------------------------------------------------------------------------------------------
# spawned gloo ranks


def _ranks(world: int, target, *args) -> None:
    """``target(rank, world, *args)`` in ``world`` spawned processes joined in a process group; a failure in
    any of them fails the test with its traceback."""
    port = free_port()
    errors = mp.get_context("spawn").Manager().dict()
    mp.spawn(_rank, args=(world, port, errors, target, args), nprocs=world, join=True)
    assert not dict(errors), "\n".join(dict(errors).values())


def _rank(rank: int, world: int, port: int, errors, target, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        target(rank, world, *args)
    except BaseException:  # noqa: BLE001 - reported by the parent, with the rank
        errors[rank] = f"rank {rank}:\n{traceback.format_exc()}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop_flag_over_a_map_without_cpu(rank: int, world: int, which: str) -> None:
    from extract.job.dist import Mesh

    # NCCL's backend map is {cuda: nccl}: "cuda:gloo" gives gloo the same map, with no backend for CPU tensors
    dist.init_process_group("cuda:gloo", rank=rank, world_size=world)
    group = dist.group.WORLD if which == "default" else dist.new_group(list(range(world)))
    mesh = Mesh(0, 1, rank, world, group)
    assert mesh.agree_to_stop(None) is None
    assert mesh.agree_to_stop(15 if rank == world - 1 else None) == 15  # one rank's signal stops the group
    assert mesh.agree_to_stop(2 if rank == 0 else None) == 2


@pytest.mark.parametrize("which", ["default", "new_group"])
def test_the_tensor_parallel_stop_flag_works_over_nccls_backend_map(which):
    _ranks(2, _stop_flag_over_a_map_without_cpu, which)
