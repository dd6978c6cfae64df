"""One extraction job, top to bottom: spec → model/data → layers → store → loop → finish."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from ..capture.hooks import Capture, Edit
from ..capture.layers import LayerRef, list_layers, resolve_layers
from ..capture.setup import LayerSetup, setup_layers
from ..capture.staging import HostStaging
from ..data import DataOptions, Source, build_dataset, keep_index, kept_index
from ..data.gpu_decode import GpuDecoder, collate_encoded
from ..errors import ExtractError
from ..models import LoadedModel, build_model, library_versions
from ..store.store import FeatureStore, codecs
from ..store.writer import ChunkWriter
from .dist import process_state
from .interrupt import Interrupted, LoaderWorkerSignals, PeerStopped, StopRequests, watch_parent
from .lifecycle import StoreLife
from .memory import keep_freed_memory
from .plan import ChunkBatchSampler, Plan, assign, default_chunk_size
from .progress import JobProgress
from .spec import JobSpec, fingerprint

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOP_LEVEL = ("model", "weights", "preprocessing", "num_samples", "chunk_size", "dtype", "precision", "pool")
Log = Callable[[str], None]


@dataclass
class Summary:
    samples: int
    seconds: float
    chunks_written: int
    chunks_reused: int
    bytes_stored: int
    raw_bytes: int
    invalid: int = 0

    @property
    def images_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.bytes_stored if self.bytes_stored else 0.0

    def record(self) -> dict[str, Any]:
        """The summary the store keeps in its attributes."""
        return {
            "samples": self.samples,
            "seconds": round(self.seconds, 3),
            "images_per_second": round(self.images_per_second, 2),
            "bytes_stored": self.bytes_stored,
            "compression_ratio": round(self.compression_ratio, 3),
            "invalid_samples": self.invalid,
        }

    def line(self) -> str:
        skipped = f"; {self.invalid} bad images skipped (valid=False)" if self.invalid else ""
        return (
            f"extract: {self.samples} samples in {self.seconds:.1f} s ({self.images_per_second:.1f} img/s); "
            f"{self.chunks_written} chunks written, {self.chunks_reused} reused; "
            f"{self.bytes_stored / 2**20:.1f} MiB stored, compression {self.compression_ratio:.2f}x{skipped}"
        )


def _autocast(device: torch.device, precision: str) -> Any:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST[precision])


def _cpus_per_process() -> int:
    """This machine's CPUs shared among the processes launched on it."""
    return max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _default_workers() -> int:
    return min(8, _cpus_per_process())


def default_writer_threads(device: torch.device) -> int:
    """2 on CPU, where encoding competes with the forward for the cores (benchmarks/RESULTS.md: more
    threads gained nothing there); on a GPU up to 8, half this process's CPUs: one zstd-1 thread
    encodes ~0.3 GB/s, and full ResNet-50 layer3 maps at GPU speed are over 1 GB/s."""
    return 2 if device.type != "cuda" else min(8, max(2, _cpus_per_process() // 2))


def print_layers(spec: JobSpec, out: Log = print) -> None:
    """Every module (and alias) with its class, output shape for a batch B, and layout; builds the
    architecture only, so nothing is downloaded."""
    loaded = build_model(spec.model, spec.weights, None, spec.seed, spec.image_size, load_weights=False)
    model = loaded.model
    rows = list_layers(
        model, lambda x: loaded.call(model, x), loaded.example(2), loaded.example(2, scale=2),
        loaded.aliases, loaded.layout_hints,
    )  # fmt: skip
    height, width = loaded.input_size
    out(f"# {spec.model}: output shapes for a batch of B images of 3x{height}x{width}; layout where 3-D or 4-D")
    name_width = max(len(row[0]) for row in rows)
    cls_width = max(len(row[1]) for row in rows)
    shape_width = max(len(row[2]) for row in rows)
    for name, cls, shape, layout in rows:
        out(f"{name:<{name_width}}  {cls:<{cls_width}}  {shape:<{shape_width}}  {layout}".rstrip())


@dataclass
class _Job:
    """What every rank has agreed on before the loop starts."""

    spec: JobSpec
    state: PartialState
    model: nn.Module
    refs: list[LayerRef]
    loaded: LoadedModel
    layers: LayerSetup
    dataset: Source
    shapes: dict[str, tuple[int, ...]]
    plan: Plan
    identity: dict[str, Any]
    attrs: dict[str, Any]
    autocast: Any
    memory_format: torch.memory_format
    gpu_decoder: GpuDecoder | None = None
    notes: list[str] = field(default_factory=list)  # logged by rank 0 before the loop

    @property
    def sample_bytes(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes.values()) * getattr(torch, self.spec.dtype).itemsize


def _prepare(spec: JobSpec, state: PartialState, existing: Mapping[str, Any] | None) -> _Job:
    """Model, data, layers and plan: everything that can be refused is checked here, before writing.

    Without ``--chunk-size`` a store being resumed keeps its chunk size: the default depends on the
    number of processes, which may differ from the first run's."""
    device = state.device
    precision = spec.precision or ("bf16" if device.type == "cuda" else "fp32")
    autocast = _autocast(device, precision)
    codecs(spec.compressor)
    loaded = build_model(spec.model, spec.weights, spec.checkpoint, spec.seed, spec.image_size)
    memory_format = torch.channels_last if spec.channels_last else torch.contiguous_format
    model = loaded.model.to(device, memory_format=memory_format)
    refs = resolve_layers(model, spec.layers, loaded.aliases)
    example = loaded.example(2, device).to(memory_format=memory_format)
    layers = setup_layers(loaded, model, refs, spec.pool, spec.layout, example, autocast)
    shapes = layers.shapes
    options = DataOptions(spec.image_key, spec.label_key, spec.decode, spec.exif_transpose)
    preprocessing = loaded.preprocessing
    kept = None if spec.overwrite else kept_index(Path(spec.out), (existing or {}).get("identity"), spec.data, options)
    side = max(loaded.input_size)
    dataset = build_dataset(
        spec.data, loaded.preprocess, side, options, preprocessing=preprocessing, ranks=state, saved_index=kept
    )
    notes = [f"extract: using the shard index kept in {spec.out} (no rescan)"] if kept is not None else []
    gpu_decoder = None
    if spec.decode == "nvjpeg":
        gpu_decoder = GpuDecoder(dataset.decoding, preprocessing, device, side, dataset.describe)
        notes.append(
            f"extract: --decode nvjpeg: JPEGs decoded on {device.type} in batches; transform: {gpu_decoder.how}"
        )

    num_samples = len(dataset)
    largest = max(math.prod(shape) for shape in shapes.values()) * getattr(torch, spec.dtype).itemsize
    kept = existing.get("chunk_size") if existing and not spec.overwrite else None
    chunk_size = spec.chunk_size or kept or default_chunk_size(num_samples, largest, state.num_processes)
    plan = Plan(num_samples, chunk_size)
    identity = {
        "model": spec.model,
        "weights": loaded.weights,
        "checkpoint_sha256": loaded.checkpoint_sha256,
        "layers": [ref.name for ref in refs],
        "data": spec.data,
        "data_listing_sha256": dataset.listing_sha256(),
        "image_key": spec.image_key,
        "label_key": spec.label_key,
        "decode": spec.decode,
        "exif_transpose": spec.exif_transpose,
        "num_samples": num_samples,
        "pool": spec.pool if isinstance(spec.pool, str) else list(spec.pool),
        "dtype": spec.dtype,
        "precision": precision,
        "chunk_size": plan.chunk_size,
        "compressor": spec.compressor,
        "preprocessing": repr(loaded.preprocess),
    }
    if spec.layout:
        identity["layout"] = list(spec.layout)
    attrs = {
        "status": "running",
        "fingerprint": fingerprint(identity),
        "identity": identity,
        "job": spec.to_dict(),
        # the identity's fields a reader most often wants, at the top level
        **{key: identity[key] for key in TOP_LEVEL},
        "source": loaded.source,
        "preprocessing": preprocessing,
        "pools": layers.pools,
        "layouts": layers.stored_layouts(),
        "dataset": spec.data,
        **({"image_root": str(dataset.image_root)} if dataset.image_root is not None else {}),
        "classes": dataset.classes,
        "layers": list(shapes),
        "feature_shapes": {name: list(shape) for name, shape in shapes.items()},
        "versions": library_versions(loaded.source),
        "runs": [],
    }
    return _Job(
        spec, state, model, refs, loaded, layers, dataset, shapes, plan, identity, attrs, autocast, memory_format,
        gpu_decoder, notes,
    )  # fmt: skip


def _loop(
    job: _Job, store: FeatureStore, chunks: list[int], edit: Mapping[str, Edit] | None, stop: StopRequests
) -> None:
    """Forward this rank's chunks under the capture and hand them to the writer.

    Raises ``Interrupted`` after a signal, and ``ExtractError`` naming an undecodable image, each
    after writing the chunks already complete.
    """
    spec, device = job.spec, job.state.device
    workers = LoaderWorkerSignals()
    loader = DataLoader(
        job.dataset,
        batch_sampler=ChunkBatchSampler(job.plan, chunks, spec.batch_size),
        num_workers=spec.num_workers if spec.num_workers is not None else _default_workers(),
        pin_memory=device.type == "cuda",
        collate_fn=collate_encoded if job.gpu_decoder is not None else None,
        worker_init_fn=workers,
    )
    staging = HostStaging(job.shapes, spec.batch_size, getattr(torch, spec.dtype), device)
    threads = spec.writer_threads or default_writer_threads(device)
    writer = ChunkWriter(store, staging, job.plan, job.shapes, threads=threads)
    bad_image = None
    batches = None
    stop.defer()  # from here a signal ends the loop after the batch, and what is done is written
    try:
        with (
            Capture(
                job.model, job.refs, reduce=job.layers.reduce, stop=spec.truncate, edit=edit, sink=staging.stage
            ) as cap,
            torch.inference_mode(),
            job.autocast,
        ):
            batches = iter(loader)
            while stop.signum is None:
                try:
                    images, labels, indices, errors = next(batches)
                except StopIteration:
                    break
                except Exception:
                    if stop.signum is not None:  # DataLoader workers died of the same signal
                        break
                    raise
                if job.gpu_decoder is not None:  # --decode nvjpeg: the workers sent JPEG bytes
                    images, errors = job.gpu_decoder(images, indices, errors)
                valid = np.array([not error for error in errors])
                if not (valid.all() or spec.skip_bad_images):
                    bad_image = next(error for error in errors if error)
                    break
                slot = staging.acquire(writer.check)
                job.loaded.call(cap.forward, images.to(device, non_blocking=True, memory_format=job.memory_format))
                staging.seal(slot)
                writer.submit(slot, indices, labels, valid)
        writer.close(complete=stop.signum is None and bad_image is None)
    except BaseException:
        writer.abort()
        raise
    finally:  # on every way out: the workers go now, not at exit, where multiprocessing joins them
        workers.release()
        del batches  # the last reference: torch's iterator shuts its workers down as it is freed
    for layer, count in writer.overflow.items():
        if count:
            tqdm.write(
                f"extract: WARNING layer '{layer}': {count} values beyond the float16 range were stored as inf; "
                "use --dtype float32 to keep them",
                file=sys.stderr,
            )
    if stop.signum is not None:
        raise Interrupted(stop.signum, writer.chunks_written)
    if bad_image is not None:
        raise ExtractError(
            f"cannot decode image {bad_image}; fix or remove it, or pass --skip-bad-images "
            f"({writer.chunks_written} chunks written; a rerun resumes)"
        )


def run(spec: JobSpec, *, edit: Mapping[str, Edit] | None = None, log: Log | None = None) -> Summary:
    """Extract ``spec.layers`` for every sample of ``spec.data`` into the store at ``spec.out``."""
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    spec.validate()
    with StopRequests() as stop:  # before the slow start-up: a signal from here on stops cleanly
        watch_parent()
        state = process_state(spec.timeout)
        if state.device.type == "cpu":  # before the model and data allocate anything
            keep_freed_memory()
        main = state.is_main_process
        with StoreLife(Path(spec.out), state, log) as life:  # --out is ours before anything is prepared
            job = _prepare(spec, state, life.existing)
            plan = job.plan
            action = life.decide(job.identity, job.attrs["fingerprint"], spec.overwrite)
            if action == "complete":
                if main:
                    log(f"extract: {spec.out} is already complete for this job; nothing to do")
                return Summary(0, 0.0, 0, plan.num_chunks, 0, 0)
            if main:
                if job.dataset.notice is not None:
                    log(f"extract: NOTE --data {spec.data}: {job.dataset.notice}")
                for note in job.notes:
                    log(note)
            store = life.open(action, lambda: _create(job))
            pending = store.pending_chunks()
            if main and action == "resume":  # keys are written at creation: restore those of chunks to redo
                store.write_keys(pending, job.dataset.keys())
            shares = assign(pending, state.num_processes)
            life.begin_run([len(share) for share in shares], gather_object([socket.gethostname()]))
            if main and action == "resume":
                log(
                    f"extract: resuming {spec.out}: {plan.num_chunks - len(pending)} of {plan.num_chunks} chunks already done"
                )

            progress = JobProgress(Path(spec.out), plan, pending, enabled=main)
            started = time.time()
            try:
                _loop(job, store, shares[state.process_index], edit, stop)
            finally:
                progress.close()
            try:
                state.wait_for_everyone()
            except Exception as e:  # noqa: BLE001 - gloo/NCCL: a peer left; this rank's chunks are written
                raise PeerStopped(e) from None
            summary = Summary(
                samples=plan.samples_in(pending),
                seconds=time.time() - started,
                chunks_written=len(pending),
                chunks_reused=plan.num_chunks - len(pending),
                bytes_stored=store.stored_bytes() if main else 0,
                raw_bytes=plan.num_samples * job.sample_bytes,
                invalid=int((~store.array("valid")[:]).sum()) if main else 0,
            )
            life.finish(summary.record())
    if main:
        log(summary.line())
    return summary


def _create(job: _Job) -> FeatureStore:
    plan, spec = job.plan, job.spec
    return FeatureStore.create(
        Path(spec.out), shapes=job.shapes, num_samples=plan.num_samples, chunk_size=plan.chunk_size,
        dtype=spec.dtype, compressor=spec.compressor, overwrite=spec.overwrite, attrs=job.attrs,
        layouts=job.layers.stored_layouts(), keys=job.dataset.keys(), after=lambda path: keep_index(path, job.dataset),
    )  # fmt: skip
