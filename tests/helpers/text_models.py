"""Tiny text models and tokenizers, made here: configs saved with ``save_pretrained`` and tokenizers
trained with ``tokenizers`` on real text (the standard library's own docstrings), so that the tests
need no network and no download.

``real_documents(n)`` gives real text of ragged lengths; ``save_text_model(kind, directory)`` writes
a GPT-2 (no special tokens added), a Llama (BOS added), a BERT (CLS ... SEP), or a mixture-of-experts
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 or gpt-oss (the Llama tokenizer) with its tokenizer.
"""

from __future__ import annotations

import inspect
import json
from functools import cache
from pathlib import Path

MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
MODULES = ("json", "pathlib", "collections", "functools", "itertools", "argparse", "textwrap", "shutil", "inspect")


@cache
def real_documents(n: int = 40, seed: int = 0) -> tuple[str, ...]:
    """``n`` docstrings of the standard library, of ragged lengths (a few words to a few pages)."""
    import importlib
    import random

    docs: list[str] = []
    for name in MODULES:
        module = importlib.import_module(name)
        for _, member in sorted(vars(module).items()):
            doc = inspect.getdoc(member) if callable(member) else None
            if doc and doc not in docs and (getattr(member, "__module__", None) or "").startswith(name):
                docs.append(doc)
    random.Random(seed).shuffle(docs)
    if len(docs) < n:
        raise RuntimeError(f"only {len(docs)} docstrings found")
    return tuple(docs[:n])


def _training_text() -> list[str]:
    return list(real_documents(120, seed=1))


def _byte_level_bpe(vocab_size: int, specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_training_text(), trainer)
    return tokenizer


def gpt2_tokenizer():
    from transformers import GPT2TokenizerFast

    raw = _byte_level_bpe(400, ["<|endoftext|>"])
    return GPT2TokenizerFast(tokenizer_object=raw, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                             unk_token="<|endoftext|>")  # fmt: skip


def llama_tokenizer():
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    raw = _byte_level_bpe(400, ["<unk>", "<s>", "</s>"])
    bos = raw.token_to_id("<s>")
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def bert_tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    raw = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    raw.normalizer = normalizers.BertNormalizer(lowercase=True)
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.train_from_iterator(_training_text(), trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials))
    cls, sep = raw.token_to_id("[CLS]"), raw.token_to_id("[SEP]")
    raw.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return BertTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                             cls_token="[CLS]", mask_token="[MASK]")  # fmt: skip


def save_text_model(kind: str, directory: str | Path, *, positions: int = 256, seed: int = 0) -> Path:
    """A tiny ``kind`` (gpt2 | llama | bert) with random weights (seeded) and its tokenizer, saved to
    ``directory`` as ``save_pretrained`` writes them."""
    import torch
    import transformers as tf

    directory = Path(directory)
    torch.manual_seed(seed)
    if kind == "gpt2":
        tokenizer = gpt2_tokenizer()
        config = tf.GPT2Config(vocab_size=len(tokenizer), n_positions=positions, n_embd=32, n_layer=3, n_head=2,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        model = tf.GPT2LMHeadModel(config)
    elif kind == "llama":
        tokenizer = llama_tokenizer()
        config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        model = tf.LlamaForCausalLM(config)
    elif kind in MOE:  # mixture-of-experts decoders, Llama-shaped attention, with the Llama tokenizer
        tokenizer = llama_tokenizer()
        common = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=positions, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        if kind == "mixtral":
            config = tf.MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common)
            model = tf.MixtralForCausalLM(config)
        elif kind == "qwen2_moe":  # a shared expert beside 6 routed ones, weights not renormalized over the top k
            config = tf.Qwen2MoeConfig(moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
                                       num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                                       **common)  # fmt: skip
            model = tf.Qwen2MoeForCausalLM(config)
        elif kind == "qwen3_moe":
            config = tf.Qwen3MoeConfig(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                       norm_topk_prob=True, head_dim=8, **common)  # fmt: skip
            model = tf.Qwen3MoeForCausalLM(config)
        elif kind == "olmoe":
            config = tf.OlmoeConfig(intermediate_size=24, num_experts=4, num_experts_per_tok=2, **common)
            model = tf.OlmoeForCausalLM(config)
        elif kind == "deepseek_v3":  # MLA attention, a shared expert, its first layer dense, grouped routing
            config = tf.DeepseekV3Config(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                                         n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                         first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                         qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                                         **{**common, "num_key_value_heads": 4})  # fmt: skip
            model = tf.DeepseekV3ForCausalLM(config)
        else:  # gpt-oss, unquantized: biased experts, attention sinks, sliding and full layers
            config = tf.GptOssConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                                     sliding_window=16, **common)  # fmt: skip
            model = tf.GptOssForCausalLM(config)
    elif kind == "bert":
        tokenizer = bert_tokenizer()
        config = tf.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=positions,
                               pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        model = tf.BertModel(config)
    else:
        raise ValueError(f"kind {kind!r}: gpt2, llama, bert, {' or '.join(MOE)}")
    model.eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_jsonl(path: str | Path, documents: list[str] | tuple[str, ...], **fields: list) -> Path:
    """One JSON object per line: ``{"text": doc, **fields}``."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for i, doc in enumerate(documents):
            f.write(json.dumps({"text": doc, **{k: v[i] for k, v in fields.items()}}) + "\n")
    return path
