"""The job: every option of a run, declared once (``option(...)``, ``extract.names.options``, as every
command's options are) with its flag, help, reference text, default and check,
and validated in one place (the identity that ties a store to it is the store's schema:
``extract.store.schema``). The command line (``extract.cli.extract.build_parser``) and the flag reference
(``extract.cli.reference``: docs/cli.md and the README's table) are derived from this declaration."""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from ..errors import ExtractError
from ..names import COMPRESSORS, DECODES
from ..names.options import Check, Option, declared_options, flag_of, option
from ..store.location import Location, parse

DTYPES = ("float16", "bfloat16", "float32")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICE_MAPS = ("auto",)
MAX_TIMEOUT = 7 * 24 * 3600  # a barrier waited on for longer than a week is a hang, not a slow peer
SEEDS = range(-(2**63), 2**64)  # what torch.manual_seed takes
# --compressor when it is not given, by the kind of store (benchmarks/codecs.py; RESULTS.md, "Codecs"): a
# text model's activations (per token or pooled per document) compress 1.08x with zstd-1, which costs 2.7x
# the CPU to write and 2-3x to read; image maps after a ReLU compress 1.95x. A resumed store keeps its own.
DEFAULT_COMPRESSORS = {"images": "zstd", "documents": "none", "tokens": "none"}
TOKENS_PER_SEQUENCE = 128  # --tokens-per-batch's default: --batch-size sequences of this many tokens
# The options that never change a stored bit, and why; every other option is in the store's identity (as
# itself or as what it resolves to: ``batching``, ``extract.store.schema.JobParts.identity``), so that a
# resume cannot mix two values of it in one store. tests/test_identity.py holds every option to one side.
OUTSIDE_IDENTITY = {
    "out": "where the store is, not what it holds",
    "num_workers": "DataLoader workers load the samples the plan names, in its order",
    "truncate": "the forward stops after the last requested layer, whose output is already taken",
    "overwrite": "whether to start afresh, not what is computed",
    "writer_threads": "threads writing the chunks the loop computed",
    "skip_bad_images": "a sample is stored or the job stops; a stored one has the same bits either way",
    "timeout": "how long a barrier waits",
    # like the device itself (never recorded: a resume on another GPU is allowed), a layer accelerate offloads
    # to the CPU would run other kernels; on GPUs each layer runs whole on one, as without the dispatch
    "device_map": "each layer runs whole on one GPU, with the kernels and shapes it has without the dispatch",
}


def _at_least_one(flag: str, value: int) -> None:
    if value < 1:
        raise ExtractError(f"{flag} must be at least 1, got {value}")


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise ExtractError(f"{flag} must be a positive integer, got {value}")


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(flag: str, value: str) -> None:
        if value not in choices:
            raise ExtractError(f"unknown {flag} '{value}'; choose one of {', '.join(choices)}")

    return check


def _device_map(flag: str, value: str) -> None:
    if value not in DEVICE_MAPS:
        raise ExtractError(
            f"unknown {flag} '{value}'; choose {', '.join(DEVICE_MAPS)} (accelerate's big-model dispatch)"
        )


def _workers(flag: str, value: int) -> None:
    if value < 0:
        raise ExtractError(f"{flag} must be 0 or more, got {value}")


def _timeout(flag: str, value: float) -> None:
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT):
        raise ExtractError(f"{flag} must be positive seconds, at most {MAX_TIMEOUT} (a week), got {value}")


def _seed(flag: str, value: int) -> None:
    if value not in SEEDS:
        raise ExtractError(f"{flag} must be between -2**63 and 2**64 - 1 (torch's range), got {value}")


def _sae(flag: str, value: list[str]) -> None:
    for entry in value:
        layer, _, path = entry.partition("=")
        if not layer or not path:
            raise ExtractError(f"{flag} {entry}: give LAYER=PATH (the layer, then the SAE's directory)")
    layers = [entry.partition("=")[0] for entry in value]
    if len(set(layers)) != len(layers):
        raise ExtractError(f"{flag} gives layer {max(layers, key=layers.count)} twice; give one SAE per layer")
    from ..capture.sae_files import check_saved_sae  # reads two small files: when a job is checked, not for --help

    for entry in value:  # a torn or contradictory SAE: refused before any model loads or any store exists
        check_saved_sae(entry.partition("=")[2])


def _compressor(flag: str, value: str) -> None:
    from ..store.schema import codecs  # zarr: loaded when a job is checked, not for --help

    codecs(value)  # an unknown one is refused by name


def _check_out(flag: str, out: str) -> None:
    """``--out`` names a store of its own: the current directory, or one above it, would be taken over
    (and ``--overwrite`` would delete it)."""
    if not out.strip():
        raise ExtractError("--out is empty; name the store to write, e.g. features.zarr")
    if parse(out).remote:  # a malformed store URL is one line now, before any compute
        return
    here, path = Path.cwd().resolve(), Path(out).resolve()
    if path == here or path in here.parents:
        where = "the current directory" if path == here else f"a directory above the current one ({here})"
        raise ExtractError(f"--out {out} is {where}; name a store inside it, e.g. --out features.zarr")


# The help texts that list a registry's entries import it when asked (see ``Text``).
def _model_help() -> str:
    from ..models.registry import model_kinds

    return model_kinds()


def _data_help() -> str:
    from ..data.registry import data_kinds

    return data_kinds()


def _pool_help() -> str:
    from ..names import MODEL_POOL, POOL_CHOICES, TEXT_POOLS

    return (
        f"images: {' | '.join(POOL_CHOICES)}; text: none (a row per token), {' | '.join(TEXT_POOLS)} "
        f"(a row per document, over its real tokens) or {MODEL_POOL} (its sentence-transformers pooling and "
        "normalization); none is the full map, every token; for every layer or per layer: "
        "--pool layer3=avg layer4=none (later entries override earlier ones)"
    )


def _layout_help() -> str:
    from ..names.layout import Layout

    return f"{' | '.join(Layout)} for layers whose layout --list-layers cannot tell (pooling needs it)"


def _default_compressors() -> str:
    return ", ".join(f"{kind} {name}" for kind, name in DEFAULT_COMPRESSORS.items())


@dataclass
class JobSpec:
    """Every option of a run. A field's name is its TOML job-file key; its ``option`` metadata is its flag
    (``--name`` with dashes unless it says otherwise), help, reference text and check. The flag's kind
    follows the type: a boolean is a switch, a list takes one or more values, int and float are parsed."""

    model: str = field(
        default="resnet50",
        metadata=option(
            help=_model_help,
            reference="a model source (see [Model sources](#model-sources)): a `torchvision.models.get_model` "
            "name (default `resnet50`), `timm:NAME[.TAG]`, `hf:ID_OR_DIR`, `open_clip:ARCH[:TAG_OR_FILE]`, or "
            "`pkg.module:factory` / `path/file.py:factory`",
        ),
    )
    weights: str = field(
        default="DEFAULT",
        metadata=option(
            help="torchvision weights name, DEFAULT (the source's pretrained weights), or none (random init)",
            reference="`DEFAULT` (default: the source's pretrained weights), `none` (random init seeded by "
            "`--seed`, default 0), or a torchvision weights name (`IMAGENET1K_V2`). Offline, a download fails at "
            "once with a one-line message that suggests `--weights none` or `--checkpoint`",
        ),
    )
    checkpoint: str | None = field(
        default=None,
        metadata=option(
            metavar="PATH",
            help="state_dict file loaded with weights_only=True",
            reference='a `state_dict` loaded with `torch.load(weights_only=True)` (a `{"state_dict": ...}` / '
            '`{"model": ...}` wrapper and a DDP `module.` prefix are accepted); missing or unexpected keys are '
            "an error. With a checkpoint nothing is downloaded; the named weights only choose the preprocessing",
        ),
    )
    layers: list[str] = field(
        default_factory=list,
        metadata=option(
            metavar="L",
            help="module names, globs (layer*), name:0 / name:key, or name@input",
            reference="names from `named_modules()`, globs (`layer*`, `blocks.*`: `*` stays within one dotted "
            "segment), `name:0` / `name:key` for one element of a tuple or dict output, `name@input` for what the "
            "module receives (its first positional argument, else its `hidden_states=`), and for `hf:` models "
            "`hidden_states.N` (numbered as `output_hidden_states`: 0 is the embeddings' output; negative N "
            "counts from the end) and, for GPT-2, Llama, Mistral, Qwen2, Gemma, Gemma 2 and GPT-NeoX causal LMs, "
            "TransformerLens's hook names (`blocks.N.hook_resid_pre`, ...; see docs/language-models.md). "
            "Required, unless `--list-layers`",
        ),
    )
    data: str = field(
        default="synthetic:512",
        metadata=option(
            metavar="SPEC",
            help=_data_help,
            reference="one of the sources in [Data sources](#data-sources) (default `synthetic:512`)",
        ),
    )
    out: str = field(
        default="features.zarr",
        metadata=option(
            metavar="PATH",
            check=_check_out,
            help="the zarr store to write",
            reference="the store (default `features.zarr`): a path, or an object-store URL",
        ),
    )
    batch_size: int = field(
        default=64,
        metadata=option(check=_at_least_one, help="images per forward"),
    )
    num_workers: int | None = field(
        default=None,
        metadata=option(
            check=_workers,
            help="DataLoader workers per process",
            reference="DataLoader workers per process (default: CPUs / processes, at most 8)",
        ),
    )
    image_size: int | None = field(
        default=None,
        metadata=option(
            metavar="S",
            check=_positive,
            help="crop size S (resize round(S*256/224))",
            reference="the model's input size S, changed the way its source does (torchvision: crop S, resize "
            "round(S·256/224); timm: crop S, resize S / crop_pct; OpenCLIP: `force_image_size`)",
        ),
    )
    pool: str | list[str] = field(
        default="none",
        metadata=option(
            metavar="P",
            help=_pool_help,
            reference="`none` (default, the full map), `avg` / `max` over H,W of a map, `avg:K` adaptive "
            "average to K×K, `cls` (token 0) / `mean` (token mean) of (B,T,D). Text models (one row per "
            "document, over the real tokens): `mean`, `max`, `first`, `last`, or `model`, the model's own "
            "sentence-transformers pooling and normalization (see "
            "[Text models](#text-models-per-token-and-per-document-activations)). One value for every layer, "
            "or per layer: `--pool cls pooler=none`, `--pool layer3=avg layer4=none` (`LAYER=P`, globs "
            "allowed; later entries override earlier ones)",
        ),
    )
    layout: list[str] | None = field(
        default=None,
        metadata=option(
            metavar="LAYER=L",
            help=_layout_help,
            reference="the layout (`NCHW`, `NHWC`, `NLC`, `NCL`) of a layer whose layout cannot be told (see "
            "[Layouts](#layouts)); only pooling needs it",
        ),
    )
    sae: list[str] | None = field(
        default=None,
        metadata=option(
            metavar="LAYER=PATH",
            check=_sae,
            help="text, per token: encode LAYER's rows with the SAE saved by SAELens in directory PATH, on the "
            "device, and store its top-k codes sparse (latents/LAYER); one LAYER=PATH per SAE",
            reference="encode a layer's token rows with a pretrained sparse autoencoder (a directory saved by "
            "SAELens, loaded by `sae_lens`: `pip install 'extract[sae]'`) on the device, inside the capture, and "
            "store each token's `--sae-k` largest codes sparse (`latents/LAYER/indices` and `values`) with "
            "per-chunk latent statistics (`stats/latents/LAYER`; see the store format and docs/sae-latents.md). "
            "LAYER is one of `--layers`, by the name it is given there or another name of the same tensor (a "
            "TransformerLens hook name such as `blocks.1.hook_resid_post`); the SAE's `d_in` must be the layer's "
            "width and its `hook_name` must name the same tensor. Token stores only (per token or `--pack`)",
        ),
    )
    sae_k: int = field(
        default=64,
        metadata=option(
            metavar="K",
            check=_positive,
            help="--sae: codes kept per token; a top-k SAE keeps its own k",
        ),
    )
    sae_only: bool = field(
        default=False,
        metadata=option(
            help="--sae: store only the codes of the SAE layers, not their raw rows",
            reference="with `--sae`: the layers given an SAE keep only their codes (no `features/LAYER`); the other "
            "layers are stored as usual",
        ),
    )
    dtype: str = field(
        default="float16",
        metadata=option(
            check=_one_of(DTYPES),
            help=f"storage dtype: {' | '.join(DTYPES)} (a value float16 would store as inf "
            "stops the job: use bfloat16); storage only: the model computes in --precision",
            reference="storage `float16` (default), `bfloat16` or `float32`. A value beyond float16's range "
            "(|x| from 65520, as the massive activations of large language models) stops the job in one line "
            "naming the layer and its largest |x|, rather than storing inf: `bfloat16` holds float32's range in "
            "2 bytes (8 bits of precision to float16's 11). The storage dtype is not the compute dtype: "
            "`--precision` is (`hf:` text models load their weights in it, bf16 by default on CUDA, whose "
            "outputs `--dtype bfloat16` stores exactly). zarr has no bfloat16: such a layer is stored as its "
            "`uint16` bits, read back as `torch.bfloat16` or float32 (see the store format)",
        ),
    )
    precision: str | None = field(
        default=None,
        metadata=option(
            check=_one_of(PRECISIONS),
            help=f"compute precision: {' | '.join(PRECISIONS)} (default fp32 on CPU, bf16 on CUDA)",
            reference="compute `fp32` / `bf16` / `fp16` through autocast (default fp32 on CPU, bf16 on CUDA); "
            "`hf:` text models load their weights in that dtype instead (no fp32 copy). `fp32` on a GPU runs "
            "under torch's defaults, which the job leaves as they are: cuDNN convolutions in TF32 "
            "(`torch.backends.cudnn.allow_tf32`, on), matmuls in full fp32 (`torch.backends.cuda.matmul.allow_tf32`, "
            "off); set them before `extract.run` for other behaviour. `benchmarks/gpu_check.sh` records how far "
            "that fp32 lies from the CPU's",
        ),
    )
    chunk_size: int | None = field(
        default=None,
        metadata=option(
            check=_positive,
            help="samples per chunk (default: about 16 MiB per chunk)",
            reference="samples per chunk (default: a power of two giving about 16 MiB per chunk for the "
            "largest layer, at most 1024, and small enough that every process gets work, K ≥ 4 × processes, "
            "with at least 16 chunks from 256 samples up; a resumed store keeps its chunk size)",
        ),
    )
    # None: DEFAULT_COMPRESSORS for the kind of store (``store_compressor``)
    compressor: str | None = field(
        default=None,
        metadata=option(
            check=_compressor,
            help=lambda: (
                f"{' | '.join(COMPRESSORS)} (default by the kind of store: {_default_compressors()}; "
                "a resumed store keeps its own)"
            ),
            reference="`zstd` (level 1), `blosc` (lz4, byte shuffle), `bitshuffle` (blosc lz4, bit shuffle), "
            "`none`; every object keeps its crc32c either way. Default by the kind of store: `zstd` for "
            "images, `none` for token and document stores (a text model's activations compress only 1.08x, "
            "and zstd costs 2.7x the CPU to write and 2-3x to read them: "
            "[benchmarks/RESULTS.md](benchmarks/RESULTS.md#codecs-for-activation-stores)); a resumed store "
            "keeps the compressor it was made with",
        ),
    )
    truncate: bool = field(
        default=True,
        metadata=option(
            flag="--no-truncate",
            help="run the whole forward even after the last requested layer",
            reference="run the whole forward even after the last requested layer (the stored features are "
            "identical either way)",
        ),
    )
    overwrite: bool = field(
        default=False,
        metadata=option(
            help="replace a store of a different job",
            reference="start the store at `--out` afresh: replace another job's store, or recompute this one "
            "(never touches anything that is not an extract store). The old store is moved aside before it is "
            "deleted, so an interrupted overwrite leaves the old store or nothing",
        ),
    )
    seed: int = field(
        default=0,
        metadata=option(check=_seed, help="seed for random init, with --weights none"),
    )
    channels_last: bool = field(
        default=False,
        metadata=option(
            help="run the model in channels_last",
            reference="run the model in channels_last (faster convolutions on GPUs)",
        ),
    )
    writer_threads: int | None = field(
        default=None,
        metadata=option(
            check=_at_least_one,
            help="threads encoding and writing chunks (default 2 on CPU, up to 8 on GPU)",
            reference="threads encoding and writing chunks (default 2 on CPU; on a GPU half the process's "
            "share of CPUs, 2 to 8)",
        ),
    )
    skip_bad_images: bool = field(
        default=False,
        metadata=option(
            help="record undecodable images, or unreadable documents, as invalid (valid=False) instead of stopping",
            reference="record undecodable images, or unreadable documents, as invalid (`valid=False`, NaN "
            "features) instead of stopping at the first one",
        ),
    )
    image_key: str | None = field(
        default=None,
        metadata=option(
            metavar="K",
            help="wds: image extension; parquet/hf: image column (default: detected)",
            reference="which member (tar shards: an extension such as `png`) or column (Parquet, Hugging Face) "
            "holds the image (default: detected, see [Data sources](#data-sources))",
        ),
    )
    label_key: str | None = field(
        default=None,
        metadata=option(
            metavar="K",
            help="wds: label extension (default cls); parquet/hf: column (label); text: field or column "
            "(integers, or jsonl strings: class names)",
            reference="which member (tar shards: an extension, default `cls`) or column (Parquet, Hugging Face: "
            "default `label`) holds the label; text: a field or column of integers, or of jsonl strings "
            "(class names)",
        ),
    )
    text_key: str | None = field(
        default=None,
        metadata=option(metavar="K", help="text: the field or column that holds the text (default text)"),
    )
    context_length: int | None = field(
        default=None,
        metadata=option(
            metavar="T",
            check=_positive,
            help="text: tokens kept per document, longer ones truncated (default: a sentence-transformers model's "
            "max_seq_length, else the model's positions, at most 2048)",
        ),
    )
    pack: int | None = field(
        default=None,
        metadata=option(
            metavar="T",
            check=_positive,
            help="text: concatenate the documents (separated by EOS, or BOS where the model starts sequences with "
            "it) into contexts of exactly T tokens, each starting with BOS; the last short context is dropped",
        ),
    )
    device_map: str | None = field(
        default=None,
        metadata=option(
            metavar="auto",
            check=_device_map,
            help="text: spread a model too large for one GPU over every GPU this process sees (accelerate's "
            "big-model dispatch); launch one process per node",
        ),
    )
    tensor_parallel: int | None = field(
        default=None,
        metadata=option(
            metavar="N",
            check=_at_least_one,
            help="text: split the model over groups of N consecutive processes of one node with transformers' own "
            "tensor-parallel plan; each group is one data-parallel rank (launch a multiple of N processes per node)",
            reference="text: split the model over groups of N consecutive processes of one node, each rank holding "
            "1/N of the weights (transformers' own tensor-parallel plan, loaded sharded). Each group is one "
            "data-parallel rank: it owns whole chunks and one of its ranks writes them. N must divide the processes "
            "per node; not with `--device-map`. See docs/large-models.md.",
        ),
    )
    tokens_per_batch: int | None = field(
        default=None,
        metadata=option(
            metavar="N",
            check=_positive,
            help="text: tokens per forward, padding included, however many documents that takes (default: "
            "--batch-size x 128)",
        ),
    )
    decode: str = field(
        default="pil",
        metadata=option(
            check=_one_of(DECODES),
            help=f"{' | '.join(DECODES)}: PIL in full, PIL at a reduced JPEG scale covering the resize, "
            "or batched nvjpeg on the GPU",
            reference="`pil` (default): PIL decodes each image in full. `draft`: a JPEG is decoded at the "
            "smallest DCT scale (1/2, 1/4, 1/8) whose image still covers the transform's resize target, then "
            "transformed as usual: 2-4x faster on large JPEGs, pixels slightly different (see [Data sources](#data-sources)). "
            "`nvjpeg` (CUDA): workers only read bytes, JPEGs are decoded in batches on the GPU and resized, "
            "cropped and normalized there; other formats (and JPEGs nvjpeg refuses) go through the CPU path",
        ),
    )
    exif_transpose: bool = field(
        default=False,
        metadata=option(
            help="rotate images as their EXIF orientation says (off by default, like torchvision's loaders)",
            reference="rotate images as their EXIF orientation tag says. Off by default, as in torchvision's "
            "and timm's loaders (the weights were trained on unrotated pixels); turn it on for phone photos "
            "whose pixels are stored sideways. Under `--decode nvjpeg` (whose CUDA decoder ignores the tag) the "
            "orientation is applied after the decode, as PIL applies it",
        ),
    )
    timeout: float = field(
        default=1800.0,
        metadata=option(
            metavar="SECONDS",
            check=_timeout,
            help="how long a process waits for the others at a barrier before failing",
        ),
    )

    def validate(self) -> None:
        """Reject bad values before anything is built or written: the types, then each option's own check
        (in declaration order), then what options say together."""
        check_types(self.to_dict(), "job option")
        for f, declared in job_options():
            value = getattr(self, f.name)
            if declared.check is not None and value is not None:
                declared.check(flag_of(f), value)
        if self.sae_only and not self.sae:
            raise ExtractError(
                "--sae-only keeps only the codes of the --sae layers, but no --sae is given; add --sae LAYER=PATH"
            )
        if self.tensor_parallel is not None and self.tensor_parallel > 1 and self.device_map is not None:
            raise ExtractError(
                f"--tensor-parallel {self.tensor_parallel} splits the model over a group of processes, --device-map "
                f"{self.device_map} over one process's GPUs; give one of them"
            )
        if self.pack is not None and self.context_length is not None and self.pack != self.context_length:
            raise ExtractError(
                f"--pack {self.pack} makes contexts of {self.pack} tokens, but --context-length is "
                f"{self.context_length}; give one of them (--pack alone sets the context length)"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def location(self) -> Location:
        """``--out`` as a ``Location``: the path, or the URL on object storage, the job's stages are given."""
        return parse(self.out)

    def store_compressor(self, kind: str, existing: Mapping[str, Any] | None) -> str:
        """The compressor a store of ``kind`` gets: ``--compressor`` if given; else, when the store at
        ``--out`` is resumed (``existing``, its attributes, and no ``--overwrite``), the one its identity
        records, so that a store made under another default (zstd, before text stores' became none) is
        the same job; else ``DEFAULT_COMPRESSORS[kind]``. The identity records the answer, never None."""
        if self.compressor is not None:
            return self.compressor
        recorded = (existing or {}).get("identity", {}).get("compressor") if not self.overwrite else None
        return recorded if recorded in COMPRESSORS else DEFAULT_COMPRESSORS[kind]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def batching(options: Mapping[str, Any], text: bool) -> dict[str, Any]:
    """What decides which rows share a forward and how it runs, from a job's options (``JobSpec.to_dict()``,
    or the ``job`` record of a store made before its identity held this): matmul and convolution kernels
    round by the padded batch's shape and memory layout, so the same sample computed in another batch
    differs in its last bits. A text job batches by tokens (``--batch-size`` only sets that default)."""
    if text:
        tokens = options.get("tokens_per_batch") or options.get("batch_size", JobSpec.batch_size) * TOKENS_PER_SEQUENCE
        return {"tokens_per_batch": tokens}
    return {
        "batch_size": options.get("batch_size", JobSpec.batch_size),
        "channels_last": bool(options.get("channels_last")),
    }


def job_options() -> list[tuple[Field[Any], Option]]:
    """Every ``JobSpec`` field with its declaration, in field order (--help's and the reference's order)."""
    return declared_options(JobSpec)


def _fits(value: Any, expected: Any) -> bool:
    if get_origin(expected) is types.UnionType:
        return any(_fits(value, option) for option in get_args(expected))
    if expected is type(None):
        return value is None
    if get_origin(expected) is list:
        (item,) = get_args(expected)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if expected is float:  # an integer number of seconds is fine; a boolean is not a number
        return type(value) in (int, float)
    return type(value) is expected  # exact: True is not an int, "no" is not a bool


def _describe(expected: Any) -> str:
    if get_origin(expected) is types.UnionType:
        return " or ".join(_describe(option) for option in get_args(expected))
    if get_origin(expected) is list:
        return f"a list of {_describe(get_args(expected)[0]).split(' ', 1)[1]}s"
    names = {bool: "a boolean (true or false)", int: "an integer", float: "a number", str: "a string"}
    return names.get(expected, "null" if expected is type(None) else str(expected))


def check_types(options: Mapping[str, Any], source: str) -> None:
    """Every option must have its ``JobSpec`` type exactly: booleans are booleans, integers integers.
    A TOML ``overwrite = "no"`` is truthy and would replace a store; ``chunk_size = true`` would be 1."""
    hints = get_type_hints(JobSpec)
    for key, value in options.items():
        expected = hints.get(key)
        if expected is not None and not _fits(value, expected):
            raise ExtractError(
                f"{source} '{key}' = {value!r} must be {_describe(expected)}, not {type(value).__name__}"
            )
