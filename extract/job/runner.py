"""One extraction job, top to bottom: spec → model and layers → data → plan → schema → store → loop →
finish. ``run`` reads as that list; each stage is one function below it."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..capture.hooks import Edit
from ..capture.layers import resolve_layers
from ..capture.moe import check_moe_layers
from ..capture.setup import LayerSetup, TextLayerSetup, list_layers, setup_layers, setup_text_layers
from ..capture.sharded import group_gather
from ..data import (
    LEGACY_SAVED_INDEX,
    SAVED_INDEX,
    DataOptions,
    Source,
    attach_decoding,
    open_dataset,
    reuses_index,
    saved_indexes,
)
from ..data.gpu_decode import GpuDecoder
from ..data.text import TextSource
from ..errors import ExtractError, InvalidRequestError
from ..models import LoadedModel, build_model, check_tensor_parallel, library_versions
from ..models.hf_text import TextModel, input_device
from ..names import Action, Kind, ModelKind
from ..names.layers import LayerRef
from ..processes import Mesh, Processes
from ..store.chunks import Plan
from ..store.indexes import saved_index
from ..store.life import StoreLife
from ..store.location import Location
from ..store.schema import JobParts
from ..store.store import FeatureStore
from .dist import start_processes
from .image_loop import ImageStage, image_loop
from .interrupt import PeerStopped, StopRequests
from .launcher import watch_launcher
from .memory import keep_freed_memory
from .plan import MAX_CHUNK_SIZE, MAX_TOKEN_CHUNK_SIZE, assign, default_chunk_size
from .progress import JobProgress
from .routing import setup_routing, with_routing
from .saes import JobSaes, setup_saes
from .spec import JobSpec, batching
from .text_stage import TextJob, TextStage, prepare_text, text_loop

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
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
    kind: Kind = Kind.IMAGES  # what a row is
    truncation: dict[str, int] | None = None  # text: documents truncated and tokens dropped, when tokenized now
    compressor: str = "none"  # the store's (--compressor, or its kind's default)

    @property
    def rows_per_second(self) -> float:
        """Rows of the store's kind (images, documents or tokens) per second."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def images_per_second(self) -> float:
        """The rate under its first name, whatever the rows are (readers of older summaries ask for it)."""
        return self.rows_per_second

    @property
    def compression_ratio(self) -> float:
        """The features' bytes in memory over their bytes stored: the compressor's gain, less what it costs
        to store the metadata and the last chunk whole (zarr writes its padding too)."""
        return self.raw_bytes / self.bytes_stored if self.bytes_stored else 0.0

    def record(self) -> dict[str, Any]:
        """The summary the store keeps in its attributes."""
        return {
            "samples": self.samples,
            "seconds": round(self.seconds, 3),
            "rows_per_second": round(self.rows_per_second, 2),
            "unit": self.kind.rows,  # what a row is: samples, documents or tokens
            "images_per_second": round(self.rows_per_second, 2),  # the same rate, kept for older readers
            "bytes_stored": self.bytes_stored,
            "compression_ratio": round(self.compression_ratio, 3),
            "compressor": self.compressor,
            "invalid_samples": self.invalid,
            **({"truncation": self.truncation} if self.truncation is not None else {}),
        }

    def line(self) -> str:
        what = "documents" if self.kind.text else "images"
        skipped = f"; {self.invalid} bad {what} skipped (valid=False)" if self.invalid else ""
        rows, unit = self.kind.rows, self.kind.unit
        return (
            f"extract: {self.samples} {rows} in {self.seconds:.1f} s ({self.rows_per_second:.1f} {unit}/s); "
            f"{_count(self.chunks_written, 'chunk')} written, {self.chunks_reused} reused; "
            f"{self.bytes_stored / 2**20:.1f} MiB stored{self._compression()}{skipped}"
        )

    def _compression(self) -> str:
        """What the compressor gained, said as what it measures; nothing without a compressor, where the
        ratio (below 1: the padded last chunk and the metadata) was read as a compression that made it worse."""
        if self.compressor == "none" or not self.bytes_stored:
            return ", uncompressed" if self.compressor == "none" else ""
        return f" with {self.compressor}, {self.compression_ratio:.2f}x less than the features' size in memory"


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST[precision])


def print_layers(spec: JobSpec, out: Log = print) -> None:
    """Every module (and alias) with its class, output shape for a batch B, and layout; builds the
    architecture only, so nothing is downloaded. Text models run B sequences of T tokens (and 2T,
    which tells the token axis for the layouts)."""
    loaded = build_model(spec.model, spec.weights, None, spec.seed, spec.image_size, load_weights=False)
    model = loaded.model
    rows = list_layers(
        model, lambda x: loaded.call(model, x), loaded.example(2), loaded.example(2, scale=2),
        loaded.aliases, loaded.layout_hints,
    )  # fmt: skip
    if loaded.kind is ModelKind.TEXT:
        tokens = loaded.example(1)["input_ids"].shape[1]
        shown = f"a batch of B sequences of T tokens (T = {tokens} here)"
        out(f"# {spec.model}: output shapes for {shown}; layout where 3-D or 4-D")
    else:
        height, width = loaded.input_size
        out(f"# {spec.model}: output shapes for a batch of B images of 3x{height}x{width}; layout where 3-D or 4-D")
    name_width = max(len(row[0]) for row in rows)
    cls_width = max(len(row[1]) for row in rows)
    shape_width = max(len(row[2]) for row in rows)
    for name, cls, shape, layout in rows:
        out(f"{name:<{name_width}}  {cls:<{cls_width}}  {shape:<{shape_width}}  {layout}".rstrip())


@dataclass
class _Model:
    """Stage 1: the model on its device, with its layers resolved, validated and set up."""

    loaded: LoadedModel
    module: nn.Module
    refs: list[LayerRef]
    layers: LayerSetup
    preprocessing: dict[str, Any]  # the record of the model's own transform
    precision: str
    autocast: contextlib.AbstractContextManager[Any]
    memory_format: torch.memory_format
    saes: JobSaes | None = None  # --sae: the SAE of each layer given one


@dataclass
class _Data:
    """Stage 2: the data listed once, and how its images are decoded."""

    dataset: Source
    gpu_decoder: GpuDecoder | None = None
    notes: list[str] = field(default_factory=list)  # logged by rank 0 before the loop


@dataclass
class _Job:
    """What every rank has agreed on before the loop starts: the stages' results and the store's attributes."""

    spec: JobSpec
    processes: Processes  # this process among the job's: its data rank, whether it writes
    model: _Model
    data: _Data
    plan: Plan
    attrs: dict[str, Any]
    text: TextJob | None = None

    @property
    def kind(self) -> Kind:
        return Kind.IMAGES if self.text is None else self.text.kind

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The layers stored raw (``features/<layer>``): every layer, but those --sae-only keeps as codes."""
        shapes, saes = self.model.layers.shapes, self.model.saes
        return shapes if saes is None else saes.stored(shapes)

    @property
    def identity(self) -> dict[str, Any]:
        return self.attrs["identity"]

    @property
    def sample_bytes(self) -> int:
        raw = sum(math.prod(shape) for shape in self.shapes.values()) * getattr(torch, self.spec.dtype).itemsize
        return raw + (self.model.saes.row_bytes() if self.model.saes is not None else 0)


def _prepare(spec: JobSpec, processes: Processes, existing: Mapping[str, Any] | None) -> _Job:
    """Model, data, layers and plan: everything that can be refused is checked here, before writing."""
    mesh = processes.mesh
    _check_device_map(spec)
    # the data is listed before the model is built: a bad file or label is said in seconds, not after
    # the weights have loaded (the model's transform is given to the images afterwards)
    data = _data(spec, processes, existing)
    loaded, precision = _load_model(spec, processes.device, mesh)
    # a wrong name (or an alias this model has no tensor for): refused before the forward
    refs = resolve_layers(loaded.model, spec.layers, loaded.aliases, loaded.absent_aliases, loaded.alias_failure)
    check_moe_layers(loaded.model, refs)  # an expert's own output has no row per token
    # the kinds before the layers are run: text for a vision model (or images for a text one) is refused as
    # that, not as whatever the example forward of a layer chosen for the other kind returns
    _attach_model(spec, processes, data, loaded)
    model = _set_up_layers(spec, processes.device, loaded, refs, precision, mesh)
    routing = setup_routing(loaded.model, refs, model.layers)
    saes = setup_saes(spec.sae, spec.sae_k, spec.sae_only, refs, model.layers, loaded.aliases, processes.device)
    model.saes = with_routing(saes, routing)
    text = None
    if isinstance(data.dataset, TextSource):
        assert isinstance(model.layers, TextLayerSetup)
        assert isinstance(model.loaded, TextModel)
        text = prepare_text(spec, processes, existing, model.loaded, model.layers, data.dataset, data.notes)
    # the default depends on the kind of store, known from here; the identity and the store get the name
    spec = dataclasses.replace(spec, compressor=spec.store_compressor(text.kind if text else Kind.IMAGES, existing))
    rows = len(data.dataset) if text is None else text.rows
    plan = _plan(spec, mesh, existing, rows, model.layers.shapes, tokens=text is not None and text.per_token)
    attrs = _schema(spec, model, data, plan, text, mesh).attributes()
    return _Job(spec, processes, model, data, plan, attrs, text)


def _check_device_map(spec: JobSpec) -> None:
    """``--device-map auto`` gives one process every GPU of its node: a second process on the node would
    place a second copy on the same GPUs."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if spec.device_map is not None and local > 1:
        raise InvalidRequestError(
            f"--device-map {spec.device_map} spreads the model over every GPU of a process, but {local} processes "
            "run on this node; launch one process per node (accelerate launch --num_processes = the number of nodes)"
        )


def _load_model(spec: JobSpec, device: torch.device, mesh: Mesh) -> tuple[LoadedModel, str]:
    """The model as its source builds it (under tensor parallelism, this rank's shards of it), and the
    precision it computes in."""
    precision = spec.precision or ("bf16" if device.type == "cuda" else "fp32")
    loaded = build_model(
        spec.model, spec.weights, spec.checkpoint, spec.seed, spec.image_size, precision=precision,
        device_map=spec.device_map, tensor_parallel=mesh.meshes,
    )  # fmt: skip
    if spec.device_map is not None and loaded.kind is not ModelKind.TEXT:
        raise InvalidRequestError(
            f"--device-map applies to hf: text models; --model {spec.model} is not one (drop --device-map)"
        )
    if mesh.tensor_parallel > 1 and loaded.kind is not ModelKind.TEXT:
        raise InvalidRequestError(
            f"--tensor-parallel applies to hf: text models (transformers' own plans); --model {spec.model} is not "
            "one (drop --tensor-parallel: each process holds the whole model)"
        )
    return loaded, precision


def _set_up_layers(
    spec: JobSpec, device: torch.device, loaded: LoadedModel, refs: list[LayerRef], precision: str, mesh: Mesh
) -> _Model:
    """The model on its device, with the layers ``refs`` set up by an example forward."""
    if loaded.kind is ModelKind.TEXT:  # its weights are loaded in the precision's dtype: no autocast over fp32 weights
        autocast = contextlib.nullcontext()
        # a dispatched model stays where accelerate put it, a tensor-parallel one where its plan put its
        # shards; it takes its inputs on its embeddings' device
        placed = spec.device_map is not None or mesh.tensor_parallel > 1
        module = loaded.model if placed else loaded.model.to(device)
        device = input_device(module)
        example = {name: value.to(device) for name, value in loaded.example(2, device).items()}
        gather = group_gather(module, refs, mesh.group, mesh.tensor_parallel) if mesh.group is not None else None
        text_layers = setup_text_layers(
            loaded, module, refs, spec.pool, example, autocast, loaded.model_pooling, dtype=getattr(torch, spec.dtype),
            gather=gather,
        )
        return _Model(
            loaded, module, refs, text_layers, loaded.preprocessing, precision, autocast, torch.contiguous_format
        )
    autocast = _autocast(device, precision)
    memory_format = torch.channels_last if spec.channels_last else torch.contiguous_format
    module = loaded.model.to(device, memory_format=memory_format)
    example = loaded.example(2, device).to(memory_format=memory_format)
    layers = setup_layers(loaded, module, refs, spec.pool, spec.layout, example, autocast, getattr(torch, spec.dtype))
    return _Model(loaded, module, refs, layers, loaded.preprocessing, precision, autocast, memory_format)


def _data(spec: JobSpec, processes: Processes, existing: Mapping[str, Any] | None) -> _Data:
    """The data source, listed once (or read from the index kept with the store being resumed)."""
    options = _data_options(spec)
    identity = (existing or {}).get("identity")
    reuse = not spec.overwrite and reuses_index(identity, spec.data, options)
    index = saved_index(spec.location, SAVED_INDEX, legacy=LEGACY_SAVED_INDEX) if reuse else None
    recorded = identity.get("data") if identity and not spec.overwrite else None
    dataset = open_dataset(spec.data, options, ranks=processes, saved_index=index, recorded=recorded)
    data = _Data(dataset)
    if index is not None:
        data.notes.append(f"extract: using the shard index kept in {spec.out} (no rescan)")
    return data


def _data_options(spec: JobSpec) -> DataOptions:
    return DataOptions(
        spec.image_key, spec.label_key, spec.decode, spec.exif_transpose, text_key=spec.text_key,
        skip_bad=spec.skip_bad_images,
    )  # fmt: skip


def _attach_model(spec: JobSpec, processes: Processes, data: _Data, loaded: LoadedModel) -> None:
    """The data meets the model: the kinds must agree, and images get the model's own transform."""
    side = max(loaded.input_size)
    _check_kinds(spec, loaded.kind, isinstance(data.dataset, TextSource))
    dataset = attach_decoding(
        data.dataset, loaded.preprocess, side, _data_options(spec), preprocessing=loaded.preprocessing
    )
    if spec.decode == "nvjpeg":
        device = processes.device
        # the model's (H, W): a bad image's placeholder must stack with the others
        data.gpu_decoder = GpuDecoder(
            dataset.decoding, loaded.preprocessing, device, loaded.input_size, dataset.describe
        )
        data.notes.append(
            f"extract: --decode nvjpeg: JPEGs decoded on {device.type} in batches; transform: {data.gpu_decoder.how}"
        )


def _check_kinds(spec: JobSpec, model_kind: ModelKind, text_data: bool) -> None:
    """A text model needs text and a vision model images: said before anything is tokenized or written."""
    if model_kind is ModelKind.TEXT and not text_data:
        raise InvalidRequestError(
            f"--model {spec.model} is a text model, but --data {spec.data} holds images; "
            "give it text (text:GLOB of .jsonl, .txt or .parquet, or an hf: dataset with a text column)"
        )
    if model_kind is not ModelKind.TEXT and text_data:
        raise InvalidRequestError(
            f"--data {spec.data} holds text, but --model {spec.model} is a vision model; "
            "use a text model (hf:DIR with a tokenizer) or image data"
        )


def _plan(
    spec: JobSpec,
    mesh: Mesh,
    existing: Mapping[str, Any] | None,
    num_samples: int,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    tokens: bool = False,
) -> Plan:
    """Without ``--chunk-size`` a store being resumed keeps its chunk size: the default depends on the
    number of processes, which may differ from the first run's. ``tokens``: rows are tokens, smaller
    than images, so a chunk holds more of them."""
    largest = max(math.prod(shape) for shape in shapes.values()) * getattr(torch, spec.dtype).itemsize
    resumed = existing.get("chunk_size") if existing and not spec.overwrite else None
    most = MAX_TOKEN_CHUNK_SIZE if tokens else MAX_CHUNK_SIZE
    chunk_size = spec.chunk_size or resumed or default_chunk_size(num_samples, largest, mesh.data_world, most)
    return Plan(num_samples, chunk_size)


def _schema(
    spec: JobSpec, model: _Model, data: _Data, plan: Plan, text: TextJob | None = None, mesh: Mesh | None = None
) -> JobParts:
    """The job's parts as the store's schema takes them: plain values, no model or data source."""
    loaded, layers = model.loaded, model.layers
    text_parts = None
    if text is not None:
        text_parts = {
            "kind": text.kind,
            "tokenization": text.record,
            "num_documents": text.num_documents,
            "num_tokens": text.num_tokens,
            "pack": None if text.corpus.pack is None else text.corpus.pack.record(),
        }
    return JobParts(
        text=text_parts,
        options=spec.to_dict(), data=data.dataset.spec, weights=loaded.weights,
        checkpoint_sha256=loaded.checkpoint_sha256,
        source=loaded.source, preprocess=repr(loaded.preprocess), preprocessing=model.preprocessing,
        layers=[ref.name for ref in model.refs], resolved_layers={ref.name: ref.target for ref in model.refs},
        shapes=layers.shapes if model.saes is None else model.saes.stored(layers.shapes), pools=layers.pools,
        layouts=layers.stored_layouts(), data_listing_sha256=data.dataset.listing_sha256(),
        model_pooling=layers.model_pooling.record() if isinstance(layers, TextLayerSetup) and layers.model_pooling else None,
        classes=data.dataset.classes, num_samples=plan.num_samples, chunk_size=plan.chunk_size,
        precision=model.precision, versions=library_versions(loaded.source),
        image_root=None if data.dataset.image_root is None else str(data.dataset.image_root),
        saes=None if model.saes is None else model.saes.identity(),
        tensor_parallel=1 if mesh is None else mesh.tensor_parallel,
        batching=batching(spec.to_dict(), text=text is not None),
    )  # fmt: skip


def run(spec: JobSpec, *, edit: Mapping[str, Edit] | None = None, log: Log | None = None) -> Summary:
    """Extract ``spec.layers`` for every sample of ``spec.data`` into the store at ``spec.out``."""
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    spec.validate()
    with StopRequests() as stop:  # before the slow start-up: a signal from here on stops cleanly
        watch_launcher()
        # a --tensor-parallel that does not fit: refused before the lock
        processes = start_processes(spec.timeout, spec.tensor_parallel)
        if processes.tensor_parallel > 1:
            _check_tensor_parallel(spec, processes)
        if processes.device.type == "cpu":  # before the model and data allocate anything
            keep_freed_memory()
        with StoreLife(spec.location, processes, log) as life:  # --out is ours before anything is prepared
            job = _prepare(spec, processes, life.existing)
            action = life.decide(job.identity, job.attrs["fingerprint"], spec.overwrite, _predated(job, life.existing))
            if action is Action.COMPLETE:
                return _already_complete(job, log)
            _announce(job, log)
            store = life.open(action, lambda writer: _create(job, life.location, writer))
            pending, shares = _share(job, life, store, resume=action is Action.RESUME, log=log)
            summary = _extract(job, store, pending, shares[processes.data_rank], edit, stop, life.check_lock)
            life.finish(summary.record())
    if processes.is_main_process:
        log(summary.line())
    return summary


def _predated(job: _Job, existing: Mapping[str, Any] | None) -> dict[str, Any]:
    """The batching of a store made before its identity recorded it, as its own ``job`` record (the options
    of the run that made it) gives it; this run's for a store without one (made through the API)."""
    identity = (existing or {}).get("identity")
    now = batching(job.spec.to_dict(), text=job.text is not None)
    if identity is None or all(key in identity for key in now):
        return {}
    record = existing.get("job") if existing is not None else None
    made = now if not isinstance(record, Mapping) else batching(record, text=job.text is not None)
    return {key: value for key, value in made.items() if key not in identity}


def _check_tensor_parallel(spec: JobSpec, processes: Processes) -> None:
    """What the model's name and config refuse under ``--tensor-parallel``, said before the data, the
    tokenizer and any other output. Every rank decides alike, then they meet: a rank that exited first
    had the launcher stop rank 0 (SIGTERM) before it printed the line, which then read "interrupted"."""
    refusal = None
    try:
        check_tensor_parallel(spec.model, spec.weights, spec.checkpoint, processes.tensor_parallel)
    except ExtractError as e:
        refusal = e
    processes.wait_for_everyone()
    if refusal is not None:
        raise refusal


def _already_complete(job: _Job, log: Log) -> Summary:
    if job.processes.is_main_process:
        log(f"extract: {job.spec.out} is already complete for this job; nothing to do")
    return Summary(0, 0.0, 0, job.plan.num_chunks, 0, 0)


def _announce(job: _Job, log: Log) -> None:
    """Rank 0 says what the user should know before the work starts."""
    if not job.processes.is_main_process:
        return
    if job.data.dataset.notice is not None:
        log(f"extract: NOTE --data {job.spec.data}: {job.data.dataset.notice}")
    for note in job.data.notes:
        log(note)


def _create(job: _Job, out: Location, writer: str) -> FeatureStore:
    """The new store at ``out`` (``--out`` with links resolved), its ``writer`` the lock's token from the
    first instant (``store/fence.py``)."""
    plan, spec, text = job.plan, job.spec, job.text
    kind, arrays = (Kind.IMAGES, None) if text is None else (text.kind, text.arrays())
    return FeatureStore.create(
        out, shapes=job.shapes, num_samples=plan.num_samples, chunk_size=plan.chunk_size,
        dtype=spec.dtype, compressor=spec.compressor, overwrite=spec.overwrite, attrs={**job.attrs, "writer": writer},
        layouts=job.model.layers.stored_layouts(), keys=_keys(job.data.dataset),
        indexes={} if text is not None else saved_indexes(job.data.dataset), kind=kind, text=arrays,
        latents=None if job.model.saes is None else job.model.saes.records(),
    )  # fmt: skip


def _keys(dataset: Source | TextSource) -> Sequence[str]:
    """The keys to write: a text corpus's made as they are written (millions of documents)."""
    return dataset.lazy_keys() if isinstance(dataset, TextSource) else dataset.keys()


def _share(
    job: _Job, life: StoreLife, store: FeatureStore, *, resume: bool, log: Log
) -> tuple[list[int], list[list[int]]]:
    """The chunks still to write and each rank's share of them, recorded as this run in the store."""
    main, plan = job.processes.is_main_process, job.plan
    pending = store.pending_chunks()
    if main and resume and job.kind is not Kind.TOKENS:  # keys are written at creation: restore those of chunks to redo
        store.creation.rewrite_keys(pending, job.data.dataset.keys())
    if main and resume and job.text is not None and job.text.rewrite:  # surveyed again: the store's were damaged
        store.creation.rewrite(job.text.arrays(), _keys(job.data.dataset), job.text.rewrite)
    shares = assign(pending, job.processes.data_world)  # a tensor-parallel group is one data rank
    hosts = job.processes.gather((socket.gethostname(), parameter_bytes(job.model.module)))
    life.begin_run(
        [len(share) for share in shares], [host for host, _ in hosts], job.processes.record(), [size for _, size in hosts]
    )
    if main and resume:
        log(
            f"extract: resuming {job.spec.out}: {plan.num_chunks - len(pending)} of {plan.num_chunks} chunks already done"
        )
    if main:
        log(_plan_line(job, pending, [size for _, size in hosts]))
    return pending, shares


def parameter_bytes(module: nn.Module) -> int:
    """The bytes of the parameters this process holds: under tensor parallelism, its shards alone."""
    return sum(
        (p.to_local() if hasattr(p, "to_local") else p).nbytes for p in module.parameters()  # a DTensor's shard
    )


def _plan_line(job: _Job, pending: list[int], held: Sequence[int] = ()) -> str:
    """What is about to happen, in one line: the layers as stored, the rows (samples, documents or
    tokens), the chunks, the processes and the store's size before compression; under tensor parallelism,
    the parameter bytes each rank of the first group holds (``held``, per process), which show the split."""
    plan, processes = job.plan, job.processes.num_processes
    layers = ", ".join(f"{name} {tuple(shape)}" for name, shape in job.shapes.items())
    todo = f", {len(pending)} to write" if len(pending) != plan.num_chunks else ""
    mesh = job.processes.mesh
    groups = f" as {mesh.data_world} x {mesh.tensor_parallel} (data x tensor parallel)" if mesh.tensor_parallel > 1 else ""
    if groups and held:
        groups += f", parameters per rank {' / '.join(f'{size / 2**20:.1f}' for size in held[: mesh.tensor_parallel])} MiB"
    return (
        f"extract: {layers} as {job.spec.dtype}; {plan.num_samples} {job.kind.rows} in {_count(plan.num_chunks, 'chunk')} of "
        f"{plan.chunk_size}{todo}; {_count(processes, 'process', 'processes')}{groups}; "
        f"{plan.num_samples * job.sample_bytes / 2**20:.1f} MiB before compression"
    )


def _count(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _extract(
    job: _Job,
    store: FeatureStore,
    pending: list[int],
    share: list[int],
    edit: Mapping[str, Edit] | None,
    stop: StopRequests,
    held: Callable[[], None],
) -> Summary:
    """This rank's share through the loop, then the barrier; the summary of the whole run. ``held()``
    raises once the lock is lost."""
    processes, plan = job.processes, job.plan
    main = processes.is_main_process
    progress = JobProgress(store, plan, pending, enabled=main, own=share, unit=job.kind.unit)
    started = time.time()
    try:
        if job.text is None:
            image_loop(_image_stage(job), store, share, edit, stop, progress.advance, held)
        else:
            text_loop(_text_stage(job, job.text), store, share, edit, stop, progress.advance, held)
    except ExtractError as e:  # met in this rank's own chunks: only this rank can say it
        e.alone = True
        raise
    finally:
        progress.close()
    try:
        processes.wait_for_everyone()
    except Exception as e:  # noqa: BLE001 - gloo/NCCL: a peer left; this rank's chunks are written
        raise PeerStopped(e) from None
    return Summary(
        samples=plan.samples_in(pending),
        seconds=time.time() - started,
        chunks_written=len(pending),
        chunks_reused=plan.num_chunks - len(pending),
        bytes_stored=store.stored_bytes() if main else 0,
        raw_bytes=plan.num_samples * job.sample_bytes,
        invalid=int((~store.array("valid")[:]).sum()) if main else 0,
        kind=job.kind,
        truncation=None if job.text is None else job.text.truncation(),
        compressor=job.spec.compressor or "none",
    )


def _image_stage(job: _Job) -> ImageStage:
    """What the image loop reads of the job."""
    spec, model = job.spec, job.model
    return ImageStage(
        loaded=model.loaded, module=model.module, refs=model.refs, layers=model.layers, autocast=model.autocast,
        memory_format=model.memory_format, device=job.processes.device, dataset=job.data.dataset,
        gpu_decoder=job.data.gpu_decoder, plan=job.plan, shapes=job.shapes, dtype=getattr(torch, spec.dtype),
        batch_size=spec.batch_size, num_workers=spec.num_workers, writer_threads=spec.writer_threads,
        truncate=spec.truncate, skip_bad_images=spec.skip_bad_images,
    )  # fmt: skip


def _text_stage(job: _Job, text: TextJob) -> TextStage:
    """What the text loop reads of the job."""
    spec, model, dataset = job.spec, job.model, job.data.dataset
    assert isinstance(model.loaded, TextModel) and isinstance(model.layers, TextLayerSetup)
    assert isinstance(dataset, TextSource)
    return TextStage(
        text=text, dataset=dataset, loaded=model.loaded, module=model.module, refs=model.refs, layers=model.layers,
        saes=model.saes, plan=job.plan, shapes=job.shapes, row_bytes=job.sample_bytes, processes=job.processes,
        dtype=getattr(torch, spec.dtype), writer_threads=spec.writer_threads, truncate=spec.truncate,
    )  # fmt: skip
