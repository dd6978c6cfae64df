"""``--model hf:ID_OR_DIR`` for text: a transformers language model with its own ``AutoTokenizer``.

Which ``hf:`` models are text is decided in ``extract.models.hf`` (``is_text_model``): a config that
is not a vision one, with tokenizer files next to it. Which class loads it (``text_model_class``):

- a causal LM (an architecture of ``config.architectures`` is one of transformers' causal-LM classes
  or ends with ``ForCausalLM``; without architectures, a ``model_type`` with a causal-LM class and no
  masked-LM one) loads with ``AutoModelForCausalLM``, so that its module names are the ones its users
  see (``transformer.h.N``, ``model.layers.N``, ``lm_head``);
- an encoder-decoder with an encoder class (T5) loads its encoder alone (``T5EncoderModel``);
- any other (BERT, MiniLM...) loads with ``AutoModel``.

Weights are loaded in the dtype ``--precision`` names (fp32 when none: the runner passes bf16 on
CUDA), not autocast over fp32 weights, which would double the memory of a large model. A random
init (``--weights none``, ``--checkpoint``, ``--list-layers``) is made in fp32 from the seed, then
cast, so that one seed gives the same weights at every precision.

``TextModel.encode`` tokenizes one document exactly as ``tokenizer(text, truncation=True,
max_length=T)`` does, special tokens included, and counts what truncation dropped.

A sentence-transformers folder (``modules.json``, ``sentence_bert_config.json``, ``1_Pooling/``) says
how its own ``encode`` embeds a text (``read_sentence_config``): it truncates at ``max_seq_length``
(the job's default context length, ``TextModel.default_context_length``), pools by the Pooling
module's mode and L2-normalizes where a ``Normalize`` module follows (``--pool model``,
``TextModel.model_pooling``).

transformers is imported only when a model is built (``registry.py`` declares it
without importing this module)."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ..errors import ExtractError
from ..names import ModelKind
from ..names.pooling import MODEL_POOL, TEXT_POOLS, ModelPooling
from .base import LoadedModel, ModelRequest
from .hf_hub import hidden_state_aliases, load_pretrained, model_file, transformer_lens_aliases

if TYPE_CHECKING:
    from ..processes import TensorMeshes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TEXT_PARTS = "model and tokenizer"  # what a save_pretrained directory of a text model holds, for messages
SPECIAL_TOKENS = ("bos", "eos", "pad", "cls", "sep")
SENTENCE_MODULES = "modules.json"  # a sentence-transformers folder's list of its pipeline's modules
SENTENCE_CONFIG = "sentence_bert_config.json"  # its Transformer module's settings (max_seq_length)
# sentence-transformers' pooling modes that extract's mask-aware pools reproduce (right padding: its
# ``cls`` is the first real token, position 0; its ``lasttoken`` the last real one)
SENTENCE_POOLS = {"mean": "mean", "max": "max", "cls": "first", "lasttoken": "last"}
# the pooling config's keys before sentence-transformers 5 wrote one ``pooling_mode``
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}  # fmt: skip


@dataclass(frozen=True)
class SentenceConfig:
    """What a sentence-transformers folder says of the embedding its ``encode`` makes: the length it
    truncates at (None: none set) and its pooling, or why ``--pool model`` cannot follow it (a module
    or mode extract does not apply); ``where`` names the folder's ``modules.json``."""

    where: str
    max_seq_length: int | None
    pooling: ModelPooling | None
    problem: str | None = None


@dataclass
class Encoded:
    """One document as the model sees it."""

    ids: np.ndarray  # int32 token ids, special tokens included
    special: np.ndarray  # bool, one per id: BOS, CLS, SEP... (the tokenizer's special-tokens mask)
    dropped: int  # content tokens cut by truncation (0 when it fit)


@dataclass
class TextModel(LoadedModel):
    """A text model in eval mode with its own tokenizer. It takes ``input_ids`` and
    ``attention_mask`` (``example``, ``call``); ``preprocess`` is ``None`` (tokenizing is
    ``encode``, not a transform of images) and ``input_size`` is (1, 1)."""

    tokenizer: Any = None  # the model's own AutoTokenizer
    max_positions: int | None = None  # the positions the model has (None: unbounded)
    sentence: SentenceConfig | None = None  # a sentence-transformers folder's own pipeline, where it is one
    sentence_missing: str = ""  # where modules.json was looked for, for --pool model's message
    kind: ClassVar[ModelKind] = ModelKind.TEXT
    _backend: Any = field(default=None, init=False, repr=False, compare=False)
    _call_options: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _record: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            # an own copy: transformers leaves its backend's truncation set to the last call's
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_str(backend.to_str())
            self._backend.no_truncation()
            self._backend.no_padding()
        # the cache of past keys and values is never read here, and costs memory
        parameters = inspect.signature(self.model.forward).parameters
        self._call_options = {"use_cache": False} if "use_cache" in parameters else {}

    @property
    def default_context_length(self) -> int | None:
        """The context length the model's own files set (sentence-transformers' ``max_seq_length``,
        at most the model's positions), or None where they set none."""
        length = self.sentence.max_seq_length if self.sentence is not None else None
        if length is None or self.max_positions is None:
            return length
        return min(length, self.max_positions)

    def model_pooling(self) -> ModelPooling:
        """``--pool model``: the pooling (and normalization) of the model's sentence-transformers
        pipeline; a one-line ``ExtractError`` where it has none, or one extract does not apply."""
        if self.sentence is None:
            raise ExtractError(
                f"--pool {MODEL_POOL} follows a sentence-transformers pipeline, but {self.sentence_missing} does not "
                f"exist; use --pool {', '.join(TEXT_POOLS)}"
            )
        if self.sentence.pooling is None:
            raise ExtractError(self.sentence.problem or f"--pool {MODEL_POOL}: {self.sentence.where} names no pooling")
        return self.sentence.pooling

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        """The id padding is filled with (masked, and never stored): pad, else eos, else 0."""
        for value in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if value is not None:
                return int(value)
        return 0

    def encode(self, text: str | None, input_ids: Sequence[int] | None, context_length: int) -> Encoded:
        """One document: ``text`` tokenized with the model's special tokens, exactly as
        ``tokenizer(text, truncation=True, max_length=context_length)`` does, with its special-tokens
        mask; or ``input_ids`` taken as given (cut to ``context_length``; the special ones are the
        tokenizer's special ids, see ``_special_ids``), each checked to lie in the vocabulary
        (``ValueError`` naming it otherwise). Exactly one of the two is given."""
        if (text is None) == (input_ids is None):
            raise ValueError("encode takes text or input_ids, exactly one of them")
        if context_length < 1:
            raise ValueError(f"context_length {context_length}: it must be at least 1")
        if input_ids is not None:
            return self._encode_ids(input_ids, context_length)
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, not {type(text).__name__}")
        if self._backend is None:
            return self._encode_slow(text, context_length)
        return self._finished(self._backend.encode(text, add_special_tokens=False), context_length)

    def encode_many(
        self, documents: Sequence[tuple[str | None, Sequence[int] | None]], context_length: int | None
    ) -> list[Encoded]:
        """``encode`` (``context_length`` given) or ``encode_content`` (None: ``--pack``'s untruncated
        content) of many documents, each a (text, input_ids) pair with exactly one given; the texts go
        through the tokenizer's batch encoder at once (its Rust threads), and every document's ids are
        exactly what ``encode`` gives it alone."""
        texts = [text for text, ids in documents if ids is None and isinstance(text, str)]
        if self._backend is None or not texts:
            return [self._encode_one(text, ids, context_length) for text, ids in documents]
        if context_length is not None:
            self._room(context_length)
        batch = iter(self._backend.encode_batch(texts, add_special_tokens=False))
        out = []
        for text, ids in documents:
            if ids is not None or not isinstance(text, str):
                out.append(self._encode_one(text, ids, context_length))
            elif context_length is None:
                out.append(Encoded(np.asarray(next(batch).ids, dtype=np.int32), np.zeros(0, bool), 0))
            else:
                out.append(self._finished(next(batch), context_length))
        return out

    def _encode_one(self, text: str | None, ids: Sequence[int] | None, context_length: int | None) -> Encoded:
        if context_length is not None:
            return self.encode(text, ids, context_length)
        return Encoded(self.encode_content(text, ids), np.zeros(0, bool), 0)

    def _room(self, context_length: int) -> int:
        """Content tokens a document keeps at ``context_length``, beside the special tokens added."""
        room = context_length - self._backend.num_special_tokens_to_add(False)
        if room < 0:
            raise ExtractError(
                f"--context-length {context_length} leaves no room for the "
                f"{context_length - room} special tokens {type(self.tokenizer).__name__} adds; give a larger one"
            )
        return room

    def _finished(self, encoding: Any, context_length: int) -> Encoded:
        """A backend encoding of a document's content, truncated and given the model's special tokens."""
        room = self._room(context_length)
        content = len(encoding.ids)
        if content > room:
            encoding.truncate(room, direction=self.tokenizer.truncation_side)
        # the tokenizer's own post-processor adds its special tokens and says which they are
        full = self._backend.post_process(encoding, add_special_tokens=True)
        return Encoded(
            np.asarray(full.ids, dtype=np.int32),
            np.asarray(full.special_tokens_mask, dtype=bool),
            content - len(encoding.ids),
        )

    def encode_content(self, text: str | None, input_ids: Sequence[int] | None) -> np.ndarray:
        """One document's content tokens for packing (``--pack``): ``tokenizer(text,
        add_special_tokens=False)``, never truncated (contexts are cut from the concatenation), or
        ``input_ids`` as given, checked to lie in the vocabulary. Exactly one of the two is given."""
        if (text is None) == (input_ids is None):
            raise ValueError("encode_content takes text or input_ids, exactly one of them")
        if input_ids is not None:
            return self._encode_ids(input_ids, len(input_ids)).ids
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, not {type(text).__name__}")
        if self._backend is None:
            return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
        return np.asarray(self._backend.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def packing_tokens(self) -> tuple[int | None, int | None]:
        """(start, separator) of packed contexts, the way SAELens and sparsify build them: a context
        starts with BOS (CLS for an encoder without one); documents are separated by BOS where the
        tokenizer itself starts every sequence with it (Llama), else by EOS (GPT-2), else SEP (BERT),
        else BOS. None where the tokenizer has no such token."""
        tokenizer = self.tokenizer
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
        starts_with_bos = False
        if tokenizer.bos_token_id is not None:
            ids = tokenizer("a", add_special_tokens=True)["input_ids"]
            starts_with_bos = bool(ids) and ids[0] == tokenizer.bos_token_id
        candidates = (tokenizer.bos_token_id,) if starts_with_bos else ()
        candidates += (tokenizer.eos_token_id, tokenizer.sep_token_id, tokenizer.bos_token_id)
        separator = next((int(i) for i in candidates if i is not None), None)
        return (None if bos is None else int(bos)), separator

    def special_ids(self) -> np.ndarray:
        """The ids a packed context flags special where they occur in a document's content."""
        return self._special_ids()

    def _encode_slow(self, text: str, context_length: int) -> Encoded:
        """A tokenizer without a ``tokenizers`` backend: its own call, and a second for the count."""
        encoded = self.tokenizer(text, truncation=True, max_length=context_length, return_special_tokens_mask=True)
        special = np.asarray(encoded["special_tokens_mask"], dtype=bool)
        content = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return Encoded(
            np.asarray(encoded["input_ids"], dtype=np.int32), special, max(content - int((~special).sum()), 0)
        )

    def _encode_ids(self, input_ids: Sequence[int], context_length: int) -> Encoded:
        ids = np.asarray(input_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"input_ids must be a list of integers, not {ids.dtype} of shape {list(ids.shape)}")
        vocab = self.vocab_size
        outside = (ids < 0) | (ids >= vocab)
        if outside.any():
            raise ValueError(f"token id {int(ids[outside][0])} is outside the vocabulary (0..{vocab - 1})")
        kept = ids[:context_length].astype(np.int32)
        return Encoded(kept, np.isin(kept, self._special_ids()), len(ids) - len(kept))

    def _special_ids(self) -> np.ndarray:
        """The ids flagged special in given ``input_ids``: the tokenizer's special tokens, but for
        the unknown token where it is only that, since a tokenizer's own mask does not flag the
        unknown tokens of the content either (an [UNK] is content, not a CLS)."""
        tokenizer = self.tokenizer
        others = {getattr(tokenizer, f"{name}_token_id", None) for name in (*SPECIAL_TOKENS, "mask")}
        unknown = tokenizer.unk_token_id
        ids = [i for i in tokenizer.all_special_ids if i != unknown or unknown in others]
        return np.asarray(ids, dtype=np.int64)

    def tokenizer_record(self) -> dict[str, Any]:
        """Which tokenizer it is, for the store: class, name, vocabulary size, the special ids, and
        the sha256 of its saved files (what decides the ids; computed once)."""
        if self._record is None:
            tokenizer = self.tokenizer
            self._record = {
                "class": type(tokenizer).__name__,
                "name_or_path": str(tokenizer.name_or_path),
                "vocab_size": self.vocab_size,
                "sha256": tokenizer_sha256(tokenizer),
                "special_ids": {name: getattr(tokenizer, f"{name}_token_id", None) for name in SPECIAL_TOKENS},
            }
        return dict(self._record)

    def example(
        self, batch: int = 2, device: torch.device | str = "cpu", length: int = 8, scale: int = 1
    ) -> dict[str, torch.Tensor]:
        """A batch of ``batch`` sequences of ``length * scale`` ordinary (not special) tokens, no padding."""
        length = length * scale
        if self.max_positions is not None:
            length = min(length, self.max_positions)
        specials = set(self.tokenizer.all_special_ids)
        ordinary = [i for i in range(min(self.vocab_size, 4096)) if i not in specials] or [0]
        ids = torch.tensor(ordinary, dtype=torch.long)[torch.arange(batch * length) % len(ordinary)]
        ids = ids.view(batch, length).to(device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def call(self, module: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> Any:  # type: ignore[override]
        """Run ``module`` (the model, or a capture's forward) on tokenized inputs, without a cache."""
        return module(**inputs, **self._call_options)

    @property
    def preprocessing(self) -> dict[str, Any]:
        return {"source": self.source, "tokenizer": self.tokenizer_record()}


def tokenizer_sha256(tokenizer: Any) -> str:
    """The sha256 of the files ``save_pretrained`` writes for ``tokenizer``, by name in sorted order
    (each name, then its bytes): the same tokenizer gives the same hash wherever it was loaded from."""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _is_causal_lm(config: Any) -> bool:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    architectures = list(getattr(config, "architectures", None) or ())
    if architectures:
        causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
        return any(name in causal or name.endswith("ForCausalLM") for name in architectures)
    # BERT and its kin have a causal-LM head class too, but are encoders first
    model_type = getattr(config, "model_type", None)
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def text_model_class(config: Any) -> Any:
    """The transformers auto class a text config loads with (the rule is in the module docstring)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForTextEncoding
    from transformers.models.auto.modeling_auto import MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES

    if _is_causal_lm(config):
        return AutoModelForCausalLM
    if getattr(config, "is_encoder_decoder", False) and config.model_type in MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES:
        return AutoModelForTextEncoding
    return AutoModel


def _json_file(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExtractError(
            f"cannot read {path}, the model's {what} ({e.__class__.__name__}: {e}); fix or remove it"
        ) from None


def _pooling_mode(config: Any) -> list[str]:
    """The modes a sentence-transformers Pooling config names: ``pooling_mode`` (a name or a list), or
    the older ``pooling_mode_*_tokens`` flags (mean where none is set, as sentence-transformers reads them)."""
    if not isinstance(config, dict):
        return []
    mode = config.get("pooling_mode")
    if mode is not None:
        return [mode] if isinstance(mode, str) else [str(m) for m in mode]
    return [name for key, name in LEGACY_POOLING_KEYS.items() if config.get(key)] or ["mean"]


def read_sentence_config(name: str, hub_offline: bool) -> tuple[SentenceConfig | None, str]:
    """The sentence-transformers pipeline of ``hf:name`` (None where it has no ``modules.json``) and
    where ``modules.json`` was looked for. A pipeline extract cannot reproduce is not refused here
    (``--pool mean`` still works on it): ``problem`` says why, for ``--pool model``."""
    modules_file = model_file(name, SENTENCE_MODULES, hub_offline)
    looked = str(Path(name, SENTENCE_MODULES)) if Path(name).is_dir() else f"{SENTENCE_MODULES} of hf:{name}"
    if modules_file is None:
        return None, looked
    where = str(modules_file)
    modules = _json_file(modules_file, "sentence-transformers modules")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ExtractError(f"{where} is not a sentence-transformers module list (a JSON list of objects); fix it")
    config_file = model_file(name, SENTENCE_CONFIG, hub_offline)
    settings = _json_file(config_file, "sentence-transformers settings") if config_file is not None else {}
    length = settings.get("max_seq_length") if isinstance(settings, dict) else None
    length = length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
    fix = f"use --pool {', '.join(TEXT_POOLS)} and apply the rest yourself"
    if isinstance(settings, dict) and settings.get("do_lower_case"):
        problem = f"--pool {MODEL_POOL}: {config_file} sets do_lower_case, which extract does not do to the text; {fix}"
        return SentenceConfig(where, length, None, problem), looked
    pool, normalize, problem, pooled_by = None, False, None, ""
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling" and pool is None:
            path = str(Path(str(module.get("path", "")), "config.json"))
            pooling_file = model_file(name, path, hub_offline)
            if pooling_file is None:
                problem = f"--pool {MODEL_POOL}: {where} names a Pooling module whose {path} is missing; {fix}"
                break
            modes = _pooling_mode(_json_file(pooling_file, "sentence-transformers pooling"))
            if len(modes) != 1 or modes[0] not in SENTENCE_POOLS:
                problem = (
                    f"--pool {MODEL_POOL}: {pooling_file} pools by {' + '.join(modes) or 'nothing'}, which extract "
                    f"does not reproduce (it does {', '.join(SENTENCE_POOLS)}); {fix}"
                )
                break
            pool, pooled_by = SENTENCE_POOLS[modes[0]], f"{path} ({modes[0]})"
        elif kind == "Normalize" and pool is not None and not normalize:
            normalize = True
        else:  # Dense, LayerNorm, a second pooling...: a step extract does not apply
            problem = (
                f"--pool {MODEL_POOL}: {where} has a {kind or 'typeless'} module ({module.get('path') or module.get('name')}) "
                f"that extract does not apply; {fix}"
            )
            break
    if problem is None and pool is None:
        problem = f"--pool {MODEL_POOL}: {where} has no Pooling module; {fix}"
    if problem is not None:
        return SentenceConfig(where, length, None, problem), looked
    assert pool is not None
    # the files by their names in the folder: the same model gives the same record wherever it is installed
    source = f"sentence-transformers {SENTENCE_MODULES}, {pooled_by}" + (", Normalize" if normalize else "")
    return SentenceConfig(where, length, ModelPooling(pool, normalize, source)), looked


def max_positions(config: Any) -> int | None:
    """The longest sequence the model's position embeddings take (None: no such bound in the config)."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# the types named first where a model type has no tensor-parallel plan: the families users most often split
KNOWN_PLANS = (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3_text", "olmo2",
    "olmoe", "phi3", "deepseek_v3", "gpt_oss",
)  # fmt: skip


# How the tokens of a tensor-parallel group reach the experts split over it (transformers'
# ``ep_implementation``): "all_to_all" sends each rank's 1/N of the batch to the experts' ranks and back,
# where "all_reduce" (transformers' default at inference) runs every rank over every route of the whole
# batch, masking those of other ranks' experts, then sums. The masked routes cost memory and time in
# k x T: measured on 2 gloo processes (benchmarks/moe_dispatch.py, RESULTS.md "Mixture of experts"),
# all_to_all is 17-43% faster per batch at top-8 (Qwen3-MoE, DeepSeek-V3) and within noise at top-2, and
# extraction runs large batches of top-8 models, where all_reduce's k x T rows per rank also take GPU
# memory the activations need. See docs/large-models.md for the NCCL arithmetic.
EXPERT_DISPATCH = "all_to_all"


def tensor_parallel_types(config_mapping: Any = None) -> list[str]:
    """The causal-LM model types whose configs carry a tensor-parallel plan (``base_model_tp_plan``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_class = (config_mapping or CONFIG_MAPPING)[model_type]
        except (KeyError, ImportError, AttributeError):  # a type whose config needs a package not installed
            continue
        if getattr(config_class, "base_model_tp_plan", None):
            found.append(model_type)
    return found


# what MoE configs call their number of routed experts (DeepSeek's ``n_routed_experts`` first: its
# ``num_experts`` may count the shared ones too)
EXPERT_COUNTS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
# the MoE types named first where a model type has no expert-parallel plan
KNOWN_EXPERT_PLANS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def expert_count(config: Any) -> int | None:
    """The routed experts of each MoE block of a (text) config, None where it names none (a dense model)."""
    for name in EXPERT_COUNTS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def expert_parallel_types(config_mapping: Any = None) -> list[str]:
    """The causal-LM model types whose configs carry an expert-parallel plan (``base_model_ep_plan``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_class = (config_mapping or CONFIG_MAPPING)[model_type]
        except (KeyError, ImportError, AttributeError):
            continue
        if getattr(config_class, "base_model_ep_plan", None):
            found.append(model_type)
    return found


def splits_experts(config: Any) -> bool:
    """Whether ``--tensor-parallel`` splits this model's experts over the group (transformers' expert plan)."""
    text = config.get_text_config()
    return bool(getattr(text, "base_model_ep_plan", None)) and (expert_count(text) or 2) > 1


def check_tensor_parallel(name: str, config: Any, request: ModelRequest, size: int | None = None) -> None:
    """Refused before any weight loads: a model type without transformers' plan, a mixture of experts
    whose experts the plan would not split over the group (no expert plan, or an expert count N does not
    divide), and a random init (the plan shards weights as ``from_pretrained`` loads them). ``size``: the
    group's, where the request has no meshes yet (the check before the process group,
    ``extract.models.check_tensor_parallel``)."""
    model_type = getattr(config, "model_type", "?")
    size = size if size is not None else request.tensor_parallel.size
    text = config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        types = tensor_parallel_types()
        named = [kind for kind in KNOWN_PLANS if kind in types]
        more = len(types) - len(named)
        raise ExtractError(
            f"--tensor-parallel {size}: transformers has no tensor-parallel plan for model type '{model_type}' "
            f"(hf:{name}); types with one: {', '.join(named)} and {more} more; use data parallel alone "
            "(drop --tensor-parallel) or --device-map auto"
        )
    experts = expert_count(text)
    if experts is not None and experts > 1 and not getattr(text, "base_model_ep_plan", None):
        types = expert_parallel_types()
        named = [kind for kind in KNOWN_EXPERT_PLANS if kind in types]
        raise ExtractError(
            f"--tensor-parallel {size}: hf:{name} is a mixture of experts of type '{model_type}', for which "
            f"transformers has no expert-parallel plan, so every rank would hold all {experts} experts; types with "
            f"one: {', '.join(named)} and {len(types) - len(named)} more; use data parallel alone (drop "
            "--tensor-parallel) or --device-map auto"
        )
    if experts is not None and experts > 1 and experts % size:
        fits = [n for n in range(2, experts + 1) if experts % n == 0][:4]
        raise ExtractError(
            f"--tensor-parallel {size}: hf:{name} has {experts} experts per MoE block, which do not split over "
            f"{size} ranks; give a --tensor-parallel that divides {experts} (such as {', '.join(map(str, fits))})"
        )
    if not request.load_weights or request.weights.lower() == "none":
        raise ExtractError(
            f"--tensor-parallel {size} loads each rank's shard of the saved weights; --weights none makes them "
            "in memory: save the model (save_pretrained) and load it with --weights DEFAULT"
        )


def load_tensor_parallel(auto: Any, source: str, meshes: TensorMeshes, **options: Any) -> Any:
    """``from_pretrained`` under transformers' own tensor-parallel plan, each rank loading only its shards
    (the model is made on the meta device, then each parameter is read as this rank's slice).

    transformers 5 builds its device mesh from the world size (``initialize_distributed_mesh``) and takes
    no mesh of ours (``device_mesh=`` is not read once ``distributed_config`` is given): with several
    groups the world is D × N, so its own mesh would span them all. It is given our meshes, whose "tp"
    dimension is this rank's group, for the length of the load; ``dp_replicate`` stays 1 in the config, so
    no FSDP is applied (data parallel is the job's: each group runs its own batches)."""
    from transformers.distributed import DistributedConfig, mixin
    from transformers.distributed.utils import TransformersDeviceMesh

    if not hasattr(mixin, "initialize_distributed_mesh"):
        import transformers

        raise ExtractError(
            f"--tensor-parallel needs transformers' DistributedConfig loading (5.20 or newer); this is "
            f"transformers {transformers.__version__}: pip install -U transformers"
        )
    device = meshes.dense.device_type
    local = torch.device(device) if device == "cpu" else torch.device(device, torch.accelerator.current_device_index())
    own = mixin.initialize_distributed_mesh
    mixin.initialize_distributed_mesh = lambda config: (local, TransformersDeviceMesh(meshes.dense, meshes.expert))
    # an MoE model's experts are split over the group too (whole experts per rank, transformers' expert plan);
    # without it every rank would hold every expert, most of such a model's weights
    experts = {"ep_size": meshes.size, "ep_implementation": EXPERT_DISPATCH} if meshes.experts else {}
    try:
        return auto.from_pretrained(
            source, distributed_config=DistributedConfig(tp_size=meshes.size, **experts), **options
        )
    except ValueError as e:
        # an expert count the config does not name (``expert_count``), found uneven as the plan shards it
        if "Cannot evenly shard" not in str(e):
            raise
        raise ExtractError(
            f"--tensor-parallel {meshes.size}: {e} (transformers' expert plan); give a --tensor-parallel that "
            "divides the model's expert count"
        ) from None
    finally:
        mixin.initialize_distributed_mesh = own


def _dispatch(model: Any) -> Any:
    """A model made in memory (a random init) spread the way ``from_pretrained(device_map="auto")``
    spreads saved weights: accelerate's own device map over the visible GPUs, then its dispatch."""
    from accelerate import dispatch_model, infer_auto_device_map

    device_map = infer_auto_device_map(model, no_split_module_classes=getattr(model, "_no_split_modules", None))
    model.hf_device_map = device_map
    return dispatch_model(model, device_map)


def input_device(model: Any) -> torch.device:
    """Where a dispatched model takes its token ids: the device of its input embeddings."""
    return model.get_input_embeddings().weight.device


def build(name: str, request: ModelRequest) -> TextModel:
    from transformers import AutoConfig, AutoTokenizer

    if request.image_size is not None:
        raise ExtractError(f"--image-size does not apply to hf:{name}: it is a text model (drop --image-size)")
    if request.weights.lower() not in ("default", "none"):
        raise ExtractError(f"--weights {request.weights}: hf models take DEFAULT (the saved weights) or none")
    dtype = DTYPES[request.precision or "fp32"]
    offline = request.hub_offline
    tokenizer = load_pretrained("the tokenizer", name, AutoTokenizer.from_pretrained, offline, TEXT_PARTS)
    config = load_pretrained("the config", name, AutoConfig.from_pretrained, offline, TEXT_PARTS)
    sentence, looked = read_sentence_config(name, offline)  # before the weights: a bad file is said at once
    auto = text_model_class(config)
    meshes = request.tensor_parallel
    if meshes is not None:
        check_tensor_parallel(name, config, request)
        meshes = dataclasses.replace(meshes, experts=splits_experts(config))
    if request.load_weights and request.weights.lower() == "default":

        def load(source: str, **options: Any) -> Any:
            if meshes is not None:
                return load_tensor_parallel(auto, source, meshes, dtype=dtype, **options)
            placed = {"device_map": request.device_map} if request.device_map else {}
            return auto.from_pretrained(source, dtype=dtype, **placed, **options)

        model = load_pretrained("the weights", name, load, offline, TEXT_PARTS)
        description = f"hf:{name}"
    else:
        model = auto.from_config(config).to(dtype)
        if request.device_map:
            model = _dispatch(model)
        description = f"none (random init, seed {request.seed}; config of hf:{name})"
    model.eval()
    loaded = TextModel(
        model, None, (1, 1), description, input_name="input_ids", tokenizer=tokenizer,  # type: ignore[arg-type]
        max_positions=max_positions(config), sentence=sentence, sentence_missing=looked,
    )  # fmt: skip
    failures: list[str] = []
    loaded.aliases = hidden_state_aliases(model, loaded.example(1), loaded.call, failures)
    lens, loaded.absent_aliases = transformer_lens_aliases(model, config, loaded.example(1), loaded.call, failures)
    loaded.alias_failure = failures[0] if failures else None
    loaded.aliases.update(lens)
    return loaded
