"""Moving captured activations off the compute path into a fixed pool of host buffers.

A slot holds one batch of every layer. The pool is allocated once (pinning is expensive and the
caching host allocator rounds blocks up to a power of two) and slots are reused only after the
writer has consumed them, so a slow writer makes the forward loop wait instead of growing memory.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping

import torch


class Slot:
    """Host buffers for one batch; ``event`` marks the end of its device-to-host copies (CUDA)."""

    def __init__(self, buffers: dict[str, torch.Tensor], cuda: bool) -> None:
        self.buffers = buffers
        self.event = torch.cuda.Event(blocking=True) if cuda else None  # the writer sleeps, not spins


class HostStaging:
    """A pool of ``slots`` host buffers of ``batch_size`` rows per layer, in the storage dtype.

    On CUDA the copies run on a side stream: the copy waits for the compute stream up to the hook,
    the source is a fresh tensor (cast and made contiguous on the compute stream, so a later
    in-place op in the forward cannot race the copy) kept alive with ``record_stream``, and the
    slot's event is what the writer waits on. Elsewhere ``stage`` is a plain synchronous copy.
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        batch_size: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 4,
    ) -> None:
        self.dtype = dtype
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.num_slots = slots
        self.current: Slot | None = None
        self._free: queue.Queue[Slot] = queue.Queue()
        for _ in range(slots):
            buffers = {
                name: torch.empty((batch_size, *shape), dtype=dtype, pin_memory=self.cuda)
                for name, shape in shapes.items()
            }
            self._free.put(Slot(buffers, self.cuda))

    def acquire(self, check: Callable[[], None] = lambda: None) -> Slot:
        """A free slot, made the one ``stage`` fills; waits while all are in use (backpressure),
        calling ``check`` (which may raise) meanwhile."""
        while True:
            check()
            try:
                self.current = self._free.get(timeout=0.1)
                return self.current
            except queue.Empty:
                continue

    def release(self, slot: Slot) -> None:
        self._free.put(slot)

    def stage(self, name: str, value: torch.Tensor) -> None:
        """Copy one layer's batch into the current slot; the capture hook's sink."""
        slot = self.current
        assert slot is not None, "acquire() a slot before the forward"
        target = slot.buffers[name][: value.shape[0]]
        if self.copy_stream is None:
            target.copy_(value)
            return
        fresh = value.to(dtype=self.dtype, memory_format=torch.contiguous_format, copy=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            target.copy_(fresh, non_blocking=True)
        fresh.record_stream(self.copy_stream)

    def seal(self, slot: Slot) -> None:
        """Mark the end of the batch's copies; the writer waits on this before reading the slot."""
        if slot.event is not None:
            slot.event.record(self.copy_stream)

    @staticmethod
    def wait(slot: Slot) -> None:
        if slot.event is not None:
            slot.event.synchronize()
