"""TransformerLens's hook names (``blocks.3.hook_resid_pre``...) as aliases of a Hugging Face causal
LM's own tensors: each is a module's output or input (``NAME@input``), so a capture of one still stops
the forward early, and nothing is recomputed outside the model.

The mapping follows TransformerLens's own ``TransformerBlock`` (transformer_lens/components/
transformer_block.py) run without weight processing (``from_pretrained_no_processing``); the table is
in docs/language-models.md. Where TransformerLens's tensor is no module's input or output, the name is
refused with the reason (``absent``), never approximated:

- ``ln1/ln2.hook_normalized`` and ``ln_final.hook_normalized``: TransformerLens hooks the norm's
  normalized input before its weight (and bias), ``(x - mean) / scale`` or ``x / scale``; a Hugging
  Face norm returns it times the weight (plus the bias), and nothing returns it without;
- ``hook_pos_embed`` of rotary models (no position embedding is added to the residual stream);
- ``hook_resid_mid`` of a parallel-residual GPT-NeoX block (Pythia): attention and MLP both read the
  block's input, and TransformerLens has no such hook there either.

Nothing here imports a model library: ``config`` is read by attribute, and the forward that decides
selectors is the caller's (``shapes_of``), through ``Capture``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..names.layers import LayerRef


@dataclass(frozen=True)
class Block:
    """Where an architecture's tensors are, relative to its base model (``transformer.``,
    ``model.``, ``gpt_neox.``) and, for the block's parts, to block N."""

    layers: str  # the ModuleList of blocks
    embed: str  # hook_embed: its output
    pos_embed: str | None  # hook_pos_embed: its output (None: rotary positions)
    attn_out: str  # hook_attn_out: its output (first element of a tuple)
    resid_mid: str  # hook_resid_mid: its input
    mlp_out: str  # hook_mlp_out: its output
    mlp_pre: str  # mlp.hook_pre: its output (the gate's, in a gated MLP)
    mlp_pre_linear: str | None  # mlp.hook_pre_linear: its output (gated MLPs only)
    mlp_post: str  # mlp.hook_post: its input (the MLP's hidden activation, before the output matrix)
    ln1: str  # the norms, for the messages that refuse hook_normalized
    ln2: str
    ln_final: str
    attn: str  # the attention module and the MLP, whose inputs those messages point to
    mlp: str = "mlp"


GPT2 = Block(
    layers="h", embed="wte", pos_embed="wpe", attn_out="attn", resid_mid="ln_2", mlp_out="mlp",
    mlp_pre="mlp.c_fc", mlp_pre_linear=None, mlp_post="mlp.c_proj", ln1="ln_1", ln2="ln_2", ln_final="ln_f",
    attn="attn",
)  # fmt: skip
LLAMA = Block(
    layers="layers", embed="embed_tokens", pos_embed=None, attn_out="self_attn", resid_mid="post_attention_layernorm",
    mlp_out="mlp", mlp_pre="mlp.gate_proj", mlp_pre_linear="mlp.up_proj", mlp_post="mlp.down_proj",
    ln1="input_layernorm", ln2="post_attention_layernorm", ln_final="norm", attn="self_attn",
)  # fmt: skip
# Gemma 2 normalizes the attention's and the MLP's outputs before adding them (TransformerLens's
# ln1_post / ln2_post, applied before hook_attn_out / hook_mlp_out)
GEMMA2 = Block(
    layers="layers", embed="embed_tokens", pos_embed=None, attn_out="post_attention_layernorm",
    resid_mid="pre_feedforward_layernorm", mlp_out="post_feedforward_layernorm", mlp_pre="mlp.gate_proj",
    mlp_pre_linear="mlp.up_proj", mlp_post="mlp.down_proj", ln1="input_layernorm", ln2="pre_feedforward_layernorm",
    ln_final="norm", attn="self_attn",
)  # fmt: skip
NEOX = Block(
    layers="layers", embed="embed_in", pos_embed=None, attn_out="attention", resid_mid="post_attention_layernorm",
    mlp_out="mlp", mlp_pre="mlp.dense_h_to_4h", mlp_pre_linear=None, mlp_post="mlp.dense_4h_to_h",
    ln1="input_layernorm", ln2="post_attention_layernorm", ln_final="final_layer_norm", attn="attention",
)  # fmt: skip
# config.model_type -> its block; Gemma's embedding module scales by sqrt(d_model) itself (transformers
# 5), as TransformerLens's converted W_E does, so its hook_embed is that module's output too
ARCHITECTURES = {
    "gpt2": GPT2, "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gemma": LLAMA, "gemma2": GEMMA2,
    "gpt_neox": NEOX,
}  # fmt: skip
LENS_HINT = (
    f"TransformerLens hook names are aliases --model hf: gives causal LMs of model_type {', '.join(ARCHITECTURES)} "
    "(in Python, pass the LayerRefs of build_model(...).aliases)"
)

ShapesOf = Callable[[list[LayerRef]], Mapping[str, list[Any]]]


def lens_aliases(model: nn.Module, config: Any, shapes_of: ShapesOf) -> tuple[dict[str, LayerRef], dict[str, str]]:
    """(aliases, absent) for a causal LM whose ``config.model_type`` is in ``ARCHITECTURES`` (both
    empty otherwise): each TransformerLens name -> the ``LayerRef`` it is, and each name this model
    has no tensor for -> why. ``shapes_of(refs)`` runs one forward capturing ``refs`` with
    ``retain="shape"`` and returns ``Capture.by_module()``: it tells which outputs are tuples (their
    first element is the tensor) and that each site runs once."""
    block = ARCHITECTURES.get(getattr(config, "model_type", None) or "")
    if block is None:
        return {}, {}
    modules = dict(model.named_modules())
    base = _base_prefix(model)
    blocks = modules.get(base + block.layers)
    count = len(blocks) if isinstance(blocks, nn.ModuleList) else 0
    wanted: dict[str, LayerRef] = {}
    absent: dict[str, str] = {}

    def add(alias: str, module: str, *, input: bool = False) -> None:
        if module in modules:
            wanted[alias] = LayerRef(module, alias=alias, input=input)
        else:
            absent[alias] = f"{type(model).__name__} has no module {module}"

    add("hook_embed", base + block.embed)
    if block.pos_embed is not None:
        add("hook_pos_embed", base + block.pos_embed)
    else:
        absent["hook_pos_embed"] = (
            f"{type(model).__name__} has rotary positions: no position embedding is added to the residual stream"
        )
    absent["ln_final.hook_normalized"] = _normalized(
        "ln_final.hook_normalized", modules, base + block.ln_final, "lm_head"
    )
    add("unembed.hook_in", "lm_head", input=True)
    parallel = bool(getattr(config, "use_parallel_residual", False))
    for n in range(count):
        at = f"{base}{block.layers}.{n}"
        add(f"blocks.{n}.hook_resid_pre", at, input=True)
        add(f"blocks.{n}.hook_attn_out", f"{at}.{block.attn_out}")
        if parallel:
            absent[f"blocks.{n}.hook_resid_mid"] = (
                f"{type(model).__name__} has a parallel residual (use_parallel_residual): attention and MLP both "
                "read the block's input, so there is no resid_mid (TransformerLens has none there either)"
            )
        else:
            add(f"blocks.{n}.hook_resid_mid", f"{at}.{block.resid_mid}", input=True)
        add(f"blocks.{n}.hook_mlp_out", f"{at}.{block.mlp_out}")
        add(f"blocks.{n}.hook_resid_post", at)
        add(f"blocks.{n}.mlp.hook_pre", f"{at}.{block.mlp_pre}")
        if block.mlp_pre_linear is not None:
            add(f"blocks.{n}.mlp.hook_pre_linear", f"{at}.{block.mlp_pre_linear}")
        add(f"blocks.{n}.mlp.hook_post", f"{at}.{block.mlp_post}", input=True)
        for ln, norm, reader in (("ln1", block.ln1, block.attn), ("ln2", block.ln2, block.mlp)):
            name = f"blocks.{n}.{ln}.hook_normalized"
            absent[name] = _normalized(name, modules, f"{at}.{norm}", f"{at}.{reader}")
    return _settle(wanted, absent, shapes_of(list(wanted.values())))


def _settle(
    wanted: Mapping[str, LayerRef], absent: dict[str, str], shapes: Mapping[str, list[Any]]
) -> tuple[dict[str, LayerRef], dict[str, str]]:
    """Each wanted name with its selector (0 where its module returns a tuple), or in ``absent``
    where its site did not run exactly once with a tensor there."""
    aliases: dict[str, LayerRef] = {}
    for alias, ref in wanted.items():
        calls = shapes.get(ref.site, [])
        if len(calls) != 1:
            absent[alias] = f"{ref.target} ran {len(calls)} times in a forward, not once"
            continue
        tree = calls[0]
        if isinstance(tree, torch.Size):
            aliases[alias] = ref
        elif not ref.input and isinstance(tree, (tuple, list)) and tree and isinstance(tree[0], torch.Size):
            aliases[alias] = LayerRef(ref.module, 0, alias=alias)
        else:
            absent[alias] = f"{ref.target} is not a tensor here"
    return aliases, absent


def _normalized(name: str, modules: Mapping[str, nn.Module], norm: str, reader: str) -> str:
    """Why ``*.hook_normalized`` is refused, naming the norm's output (what its reader takes) instead."""
    layer_norm = isinstance(modules.get(norm), nn.LayerNorm)
    formula, weights = ("(x - mean) / scale", "weight and bias") if layer_norm else ("x / scale", "weight")
    return (
        f"TransformerLens's {name} is the norm's {formula} before its {weights}, which no module returns; "
        f"with them it is {norm} (= {reader}@input)"
    )


def _base_prefix(model: nn.Module) -> str:
    """``transformer.`` / ``model.`` / ``gpt_neox.``: where a transformers head model keeps its base
    model (``PreTrainedModel.base_model``), or nothing where ``model`` is the base model."""
    base = getattr(model, "base_model", model)
    name = next((name for name, module in model.named_modules() if module is base), "")
    return f"{name}." if name else ""
