"""The loop of an image job: a rank's chunks through a DataLoader, the model under the capture, and
the writer. A chunk's batches never take another chunk's samples (``ChunkBatchSampler``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from ..capture.hooks import Capture, Edit
from ..capture.setup import LayerSetup
from ..capture.staging import HostStaging
from ..data.gpu_decode import GpuDecoder, collate_encoded
from ..data.source import Source
from ..errors import ExtractError
from ..models import LoadedModel
from ..names.layers import LayerRef
from ..store.chunks import Plan
from ..store.store import FeatureStore
from ..store.writer import ChunkWriter
from .interrupt import Interrupted, LoaderWorkerSignals, StopRequests
from .plan import ChunkBatchSampler
from .resources import default_workers, default_writer_threads, warn_infinite


@dataclass(frozen=True)
class ImageStage:
    """What the image loop reads, and nothing more: the runner builds it from the job it prepared.

    The model (``loaded``, its ``module`` on ``device`` with the layers ``refs`` set up as ``layers``,
    run under ``autocast`` on inputs in ``memory_format``), the data (``dataset``, decoded on the device by
    ``gpu_decoder`` under ``--decode nvjpeg``), the ``plan`` and the ``shapes`` stored per layer, and the
    options of the job's spec the loop acts on."""

    loaded: LoadedModel
    module: nn.Module
    refs: Sequence[LayerRef]
    layers: LayerSetup
    autocast: AbstractContextManager[Any]
    memory_format: torch.memory_format
    device: torch.device
    dataset: Source
    gpu_decoder: GpuDecoder | None
    plan: Plan
    shapes: Mapping[str, tuple[int, ...]]
    dtype: torch.dtype  # the storage dtype (--dtype)
    batch_size: int
    num_workers: int | None  # None: default_workers()
    writer_threads: int | None  # None: default_writer_threads(device)
    truncate: bool  # the forward stops after the last requested layer
    skip_bad_images: bool


def _loader(stage: ImageStage, chunks: list[int], workers: LoaderWorkerSignals) -> DataLoader:
    return DataLoader(
        stage.dataset,
        batch_sampler=ChunkBatchSampler(stage.plan, chunks, stage.batch_size),
        num_workers=stage.num_workers if stage.num_workers is not None else default_workers(),
        pin_memory=stage.device.type == "cuda",
        collate_fn=collate_encoded if stage.gpu_decoder is not None else None,
        worker_init_fn=workers,
    )


def image_loop(
    stage: ImageStage,
    store: FeatureStore,
    chunks: list[int],
    edit: Mapping[str, Edit] | None,
    stop: StopRequests,
    forwarded: Callable[[int], None] = lambda samples: None,
    held: Callable[[], None] = lambda: None,
) -> None:
    """Forward this rank's chunks under the capture and hand them to the writer; ``forwarded(n)`` after
    each batch of n samples; ``held()`` before each batch, which raises once the lock is lost (a holder
    continued after a pause stops at once, not at its next chunk).

    Raises ``Interrupted`` after a signal, and ``ExtractError`` naming an undecodable image, each
    after writing the chunks already complete.
    """
    device = stage.device
    workers = LoaderWorkerSignals()
    loader = _loader(stage, chunks, workers)
    staging = HostStaging(
        stage.shapes, stage.batch_size, stage.dtype, device, stats=store.stats_axes(), chunk_size=stage.plan.chunk_size
    )
    threads = stage.writer_threads or default_writer_threads(device)
    writer = ChunkWriter(store, staging, stage.plan, stage.shapes, threads=threads)
    stop.defer()  # from here a signal ends the loop after the batch, and what is done is written
    try:
        with (
            Capture(
                stage.module, stage.refs, reduce=stage.layers.reduce, stop=stage.truncate, edit=edit,
                sink=staging.stage,
            ) as cap,
            torch.inference_mode(),
            stage.autocast,
        ):  # fmt: skip
            bad_image = _forward(stage, loader, cap, staging, writer, stop, forwarded, held)
        writer.close(complete=stop.signum is None and bad_image is None)
    except BaseException:
        writer.abort()
        raise
    finally:  # on every way out: the workers go now, not at exit, where multiprocessing joins them
        workers.release()
    warn_infinite(writer.infinite)
    if stop.signum is not None:
        raise Interrupted(stop.signum, writer.chunks_written)
    if bad_image is not None:
        raise ExtractError(
            f"cannot decode image {bad_image}; rerun with --skip-bad-images to resume and record it invalid "
            f"(valid=False), or remove it and rerun with --overwrite ({writer.chunks_written} chunks written)"
        )


def _forward(
    stage: ImageStage,
    loader: DataLoader,
    cap: Capture,
    staging: HostStaging,
    writer: ChunkWriter,
    stop: StopRequests,
    forwarded: Callable[[int], None],
    held: Callable[[], None],
) -> str | None:
    """Every batch through the model into the writer, until the data ends or a signal arrives; the
    first undecodable image stops it (returned) unless ``--skip-bad-images``."""
    device, decoder = stage.device, stage.gpu_decoder
    batches = iter(loader)
    try:
        while stop.signum is None:
            held()
            try:
                images, labels, indices, errors = next(batches)
            except StopIteration:
                break
            except Exception:
                if stop.signum is not None:  # DataLoader workers died of the same signal
                    break
                raise
            if decoder is not None:  # --decode nvjpeg: the workers sent JPEG bytes
                images, errors = decoder(images, indices, errors)
            valid = np.array([not error for error in errors])
            if not (valid.all() or stage.skip_bad_images):
                return next(error for error in errors if error)
            slot = staging.acquire(writer.check)
            staging.rows = indices.numpy()  # a GPU computes each chunk's statistics of the batch's rows
            stage.loaded.call(cap.forward, images.to(device, non_blocking=True, memory_format=stage.memory_format))
            staging.seal(slot)
            writer.submit(slot, indices, labels, valid)
            forwarded(len(indices))
        return None
    finally:  # the last reference, also from a traceback's frame: torch's iterator stops its workers as it is freed
        del batches
