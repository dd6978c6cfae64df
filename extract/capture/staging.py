"""Moving captured activations off the compute path into a fixed pool of host buffers.

A slot holds one batch of every layer. The pool is allocated once (pinning is expensive and the
caching host allocator rounds blocks up to a power of two) and slots are reused only after the
writer has consumed them, so a slow writer makes the forward loop wait instead of growing memory.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from ..names.latents import indices_path, values_path
from . import cast
from .block_stats import BlockStats, block_stats, stored_rows

if TYPE_CHECKING:
    from .moe import RouterCodes
    from .sae import LatentStats, SaeEncoder

_Stats = TypeVar("_Stats", "LatentStats", BlockStats)


class Slot:
    """Host buffers for one batch; ``events`` mark the end of its device-to-host copies (CUDA), one per
    device the batch's layers came from. ``peaks`` hold each layer's largest finite |x| before the cast
    to the storage dtype, for the layers in ``checked`` (those whose cast can overflow)."""

    def __init__(self, buffers: dict[str, torch.Tensor], peaks: dict[str, torch.Tensor]) -> None:
        self.buffers = buffers
        self.peaks = peaks
        # --sae: per layer, the statistics (on the device) of the batch's rows of each chunk
        self.latent_stats: dict[str, dict[int, LatentStats]] = {}
        # --sae on CUDA: pinned host copies of those statistics, by (layer, segment), allocated once and reused
        self.stats_buffers: dict[tuple[str, str, int], dict[str, torch.Tensor]] = {}
        # per layer, the statistics (on the device) of the whole blocks of each chunk's rows of the batch
        self.block_stats: dict[str, dict[int, BlockStats]] = {}
        self.checked: set[str] = set()
        self.events: dict[torch.device, torch.cuda.Event] = {}  # reused batch after batch
        self.sources: set[torch.device] = set()  # the devices this batch copied from


class HostStaging:
    """A pool of ``slots`` host buffers of ``batch_size`` rows per layer, in the storage dtype.

    On CUDA the copies run on a side stream of the layer's own device (a model dispatched with
    ``--device-map`` has layers on several GPUs): the copy waits for that device's compute stream up
    to the hook, the source is a fresh tensor (cast and made contiguous on the compute stream, so a
    later in-place op in the forward cannot race the copy) kept alive with ``record_stream``, and the
    slot's events are what the writer waits on. Elsewhere ``stage`` is a plain synchronous copy.

    A cast that can overflow (float32 or bfloat16 to float16) is checked without a synchronization: the
    batch's largest finite |x| is computed on its stream and copied with it, and ``ready`` (the writer's wait,
    before it reads the slot) raises ``CastOverflowError`` where the cast made an inf (``cast.py``).

    ``encoders`` (``--sae``): a layer with one is encoded on its device before any copy (``sae.py``); its
    codes are staged as buffers ``latents/<layer>/indices`` and ``values``, and the statistics of the rows
    of each chunk of the batch (``segments``, (chunk, first, end) runs the loop sets before each forward)
    are kept on the device in the slot's ``latent_stats``. A layer in ``encoders`` but not in ``shapes``
    (``--sae-only``) has no raw buffer: only its codes leave the device.
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        batch_size: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 4,
        encoders: Mapping[str, SaeEncoder | RouterCodes] | None = None,
        stats: Mapping[str, int | None] | None = None,
        chunk_size: int | None = None,
        device_stats: bool | None = None,
    ) -> None:
        self.encoders = dict(encoders or {})
        self.stats = dict(stats or {}) if chunk_size else {}
        self.chunk_size = chunk_size or 0
        self.device_stats = (device.type == "cuda") if device_stats is None else device_stats
        self.rows: np.ndarray | None = None  # the batch's row indices (ascending), for the statistics
        self.segments: list[tuple[int, int, int]] = []
        self.dtype = dtype
        self.device = device
        self.cuda = device.type == "cuda"
        # the device this rank's threads work on: ``device`` may carry no index ("cuda")
        self._home = (device.index if device.index is not None else torch.cuda.current_device()) if self.cuda else None
        self._owner = threading.get_ident()
        self.copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.num_slots = slots
        self.current: Slot | None = None
        self._free: queue.Queue[Slot] = queue.Queue()
        for _ in range(slots):
            buffers = {
                name: torch.empty((batch_size, *shape), dtype=dtype, pin_memory=self.cuda)
                for name, shape in shapes.items()
            }
            for layer, encoder in self.encoders.items():
                values_dtype = getattr(torch, encoder.values_dtype)
                for path, code_dtype in ((indices_path(layer), torch.int32), (values_path(layer), values_dtype)):
                    buffers[path] = torch.empty((batch_size, encoder.k), dtype=code_dtype, pin_memory=self.cuda)
            peaks = {name: torch.zeros((), dtype=torch.float32, pin_memory=self.cuda) for name in shapes}
            self._free.put(Slot(buffers, peaks))

    def acquire(self, check: Callable[[], None] = lambda: None) -> Slot:
        """A free slot, made the one ``stage`` fills; waits while all are in use (backpressure),
        calling ``check`` (which may raise) meanwhile."""
        while True:
            check()
            try:
                self.current = self._free.get(timeout=0.1)
                self.current.sources.clear()
                self.current.checked.clear()
                self.current.latent_stats.clear()
                self.current.block_stats.clear()
                return self.current
            except queue.Empty:
                continue

    def release(self, slot: Slot) -> None:
        self._free.put(slot)

    def stage(self, name: str, value: torch.Tensor) -> None:
        """Copy one layer's batch into the current slot (and its codes, with an SAE); the capture hook's sink."""
        slot = self.current
        assert slot is not None, "acquire() a slot before the forward"
        if name in self.encoders:
            self._encode(slot, name, value)
            if name not in slot.buffers:  # --sae-only
                return
            value = self.encoders[name].raw(value)  # a router's packed rows: its logits
        target = slot.buffers[name][: value.shape[0]]
        peak = cast.finite_peak(value) if value.numel() and cast.narrows(value.dtype, self.dtype) else None
        if peak is not None:
            slot.checked.add(name)
        computed = self.device_stats and name in self.stats and self.rows is not None and value.numel()
        if value.device.type != "cuda":
            target.copy_(value)
            if peak is not None:
                slot.peaks[name].copy_(peak)
            if computed:
                self._block_stats(slot, name, target)
            return
        source = value.device
        stream = self.copy_streams.get(source)
        if stream is None:
            stream = self.copy_streams[source] = torch.cuda.Stream(source)
        fresh = value.to(dtype=self.dtype, memory_format=torch.contiguous_format, copy=True)
        if computed:  # on the compute stream, from the values as stored; the writer reads them after ``ready``
            self._block_stats(slot, name, fresh)
        stream.wait_stream(torch.cuda.current_stream(source))
        with torch.cuda.stream(stream):
            target.copy_(fresh, non_blocking=True)
            if peak is not None:
                slot.peaks[name].copy_(peak, non_blocking=True)
        fresh.record_stream(stream)
        if peak is not None:
            peak.record_stream(stream)
        slot.sources.add(source)

    def _block_stats(self, slot: Slot, name: str, stored: torch.Tensor) -> None:
        """The statistics of the whole blocks of each chunk's contiguous rows of the batch (``stored``: its
        values in the storage dtype); rows that are not contiguous in their chunk are left to the host."""
        rows, axis = np.asarray(self.rows, dtype=np.int64), self.stats[name]
        if len(rows) != len(stored):  # rows that are not the batch's samples one for one: the host's to do
            return
        parts = slot.block_stats.setdefault(name, {})
        positions = 1 if axis is None else math.prod(stored.shape[1:]) // stored.shape[axis]
        chunks = rows // self.chunk_size
        starts = np.flatnonzero(np.diff(chunks, prepend=-1)).tolist()
        for first, end in zip(starts, [*starts[1:], len(rows)], strict=True):
            if int(rows[end - 1]) - int(rows[first]) != end - first - 1:
                continue
            offset = int(rows[first]) - int(chunks[first]) * self.chunk_size
            part = block_stats(stored_rows(stored[first:end], axis), offset * positions)
            if part is not None:
                parts[int(chunks[first])] = self._copy_stats(slot, ("blocks", name, len(parts)), part)

    def _encode(self, slot: Slot, name: str, value: torch.Tensor) -> None:
        """The layer's codes, each chunk's rows of the batch with their own statistics (a batch may straddle
        chunks), then copied to the slot as the raw rows are."""
        encoder = self.encoders[name]
        rows = value.to(getattr(torch, encoder.dtype))
        indices = torch.empty((len(rows), encoder.k), dtype=torch.int32, device=rows.device)
        values = torch.empty((len(rows), encoder.k), dtype=getattr(torch, encoder.values_dtype), device=rows.device)
        stats = slot.latent_stats.setdefault(name, {})
        for segment, (chunk, first, end) in enumerate(self.segments):
            on_device = encoder.new_stats(rows.device)
            codes = encoder.encode(rows[first:end], on_device)
            indices[first:end], values[first:end] = codes.indices, codes.values
            stats[chunk] = self._copy_stats(slot, ("latents", name, segment), on_device)
        self._copy(slot, indices_path(name), indices)
        self._copy(slot, values_path(name), values)

    def _copy_stats(self, slot: Slot, key: tuple[str, str, int], stats: _Stats) -> _Stats:
        """On CUDA, statistics (a dataclass of device tensors: ``LatentStats``, ``BlockStats``) copied with the
        slot's rows into pinned host tensors, allocated once per ``key`` and reused while their shapes hold: the
        writer reads them after the slot's event, where a ``.cpu()`` of device tensors on its thread would wait
        for whatever forward is queued by then (and make that thread a context on the current device)."""
        tensors = {f.name: value for f in fields(stats) if isinstance(value := getattr(stats, f.name), torch.Tensor)}
        if next(iter(tensors.values())).device.type != "cuda":
            return stats
        host = slot.stats_buffers.get(key)
        if host is None or any(
            host[name].shape != value.shape or host[name].dtype != value.dtype for name, value in tensors.items()
        ):
            with torch.inference_mode(False):  # like the pool: buffers, not inference tensors
                host = slot.stats_buffers[key] = {
                    name: torch.empty(value.shape, dtype=value.dtype, pin_memory=True) for name, value in tensors.items()
                }
        for name, value in tensors.items():
            self._copy_into(slot, host[name], value)
        return replace(stats, **host)

    def _copy(self, slot: Slot, path: str, value: torch.Tensor) -> None:
        """A fresh device tensor (nothing in the forward touches it) into buffer ``path``."""
        self._copy_into(slot, slot.buffers[path][: value.shape[0]], value)

    def _copy_into(self, slot: Slot, target: torch.Tensor, value: torch.Tensor) -> None:
        if value.device.type != "cuda":
            target.copy_(value)
            return
        source = value.device
        stream = self.copy_streams.get(source)
        if stream is None:
            stream = self.copy_streams[source] = torch.cuda.Stream(source)
        stream.wait_stream(torch.cuda.current_stream(source))
        with torch.cuda.stream(stream):
            target.copy_(value, non_blocking=True)
        value.record_stream(stream)
        slot.sources.add(source)

    def seal(self, slot: Slot) -> None:
        """Mark the end of the batch's copies; the writer waits on this before reading the slot."""
        for source in slot.sources:
            event = slot.events.get(source)
            if event is None:
                event = slot.events[source] = torch.cuda.Event(blocking=True)  # the writer sleeps, not spins
            event.record(self.copy_streams[source])

    @staticmethod
    def wait(slot: Slot) -> None:
        for source in slot.sources:
            # under the event's device: a thread that never chose one (the writer's) would otherwise have the
            # CUDA runtime make it a context on GPU 0, a few hundred MB there for every rank
            with torch.cuda.device(source):
                slot.events[source].synchronize()

    def ready(self, slot: Slot) -> None:
        """``wait`` for the slot's copies, then raise ``CastOverflowError`` if the cast made an inf of a value."""
        if self._home is not None and threading.get_ident() != self._owner:
            # the writer's thread: whatever CUDA call it makes later (a pinned block freed, an event) is on
            # this rank's GPU, never GPU 0 (a thread starts on device 0)
            torch.cuda.set_device(self._home)
        self.wait(slot)
        for name in sorted(slot.checked):
            cast.check(name, float(slot.peaks[name]), self.dtype, "in a batch of the data")
