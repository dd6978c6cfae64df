"""What a process may use of its machine: CPUs for loaders and writer threads, and what the writer saw."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import torch
from tqdm import tqdm


def _cpus_per_process() -> int:
    """This machine's CPUs shared among the processes launched on it."""
    return max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def default_workers() -> int:
    return min(8, _cpus_per_process())


def default_writer_threads(device: torch.device) -> int:
    """2 on CPU, where encoding competes with the forward for the cores (benchmarks/RESULTS.md: more
    threads gained nothing there); on a GPU up to 8, half this process's CPUs: one zstd-1 thread
    encodes ~0.3 GB/s, and full ResNet-50 layer3 maps at GPU speed are over 1 GB/s."""
    return 2 if device.type != "cuda" else min(8, max(2, _cpus_per_process() // 2))


def warn_infinite(infinite: Mapping[str, int]) -> None:
    """The infinities the writer stored: the model's own (a cast that would make one stops the job)."""
    for layer, count in infinite.items():
        if count:
            tqdm.write(
                f"extract: WARNING layer '{layer}': {count} values were inf in the model's own output, stored as "
                "computed (not by the cast to --dtype)",
                file=sys.stderr,
            )
