"""TransformerLens's hook names as aliases of Hugging Face causal LMs, and module inputs (``NAME@input``)
on them, against TransformerLens itself: a ``HookedTransformer`` built from the same weights without
processing (its own config conversion and weight converters, ``load_and_process_state_dict`` with
every fold and centring off, as ``from_pretrained_no_processing`` does), run with ``run_with_cache``.
Tiny random models of each architecture, saved here; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from helpers.text_models import gpt2_tokenizer, llama_tokenizer, real_documents, write_jsonl

from extract import open_features
from extract.capture import Capture, resolve_layers
from extract.capture.lens import LENS_HINT
from extract.errors import ExtractError
from extract.models import build_model

# TransformerLens 3.9 points to its TransformerBridge; HookedTransformer is what SAELens loads models with
pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
ATOL = 1e-5
SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64
)
# kind -> (config class, model class, tokenizer, config options); directory names avoid "llama" and "gemma",
# which TransformerLens's config conversion reads as official model names
ARCHITECTURES = {
    # transformers 5 dropped GPT2Config.n_ctx, which TransformerLens's GPT-2 conversion still reads
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, gpt2_tokenizer, dict(n_positions=64, n_ctx=64, n_embd=32, n_layer=3, n_head=2)),
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, llama_tokenizer, dict(SMALL, num_key_value_heads=2)),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, llama_tokenizer, dict(SMALL, num_key_value_heads=2)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, llama_tokenizer, dict(SMALL, num_key_value_heads=2)),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, llama_tokenizer, dict(SMALL, num_key_value_heads=2, head_dim=8, hidden_act="gelu")),
    # query_pre_attn_scalar = head_dim: the attention scale TransformerLens's Gemma 2 config uses (256 = d_head there)
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, llama_tokenizer, dict(SMALL, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8)),
    "neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, gpt2_tokenizer, dict(SMALL, use_parallel_residual=True)),
    "neox_sequential": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, gpt2_tokenizer, dict(SMALL, use_parallel_residual=False)),
}  # fmt: skip
# TransformerLens's own config of the architecture, made small: Gemma's is chosen by model name only
TL_GEMMA = {"gemma": "google/gemma-2b", "gemma2": "google/gemma-2-2b"}
BLOCK_NAMES = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")
MLP_NAMES = ("mlp.hook_pre", "mlp.hook_post")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lens")
    saved = {}
    for number, (kind, (config_class, model_class, tokenizer_of, options)) in enumerate(ARCHITECTURES.items()):
        tokenizer = tokenizer_of()
        torch.manual_seed(number)
        config = config_class(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **options,
        )
        model = model_class(config).eval()
        with torch.no_grad():  # biases and norm weights start at 0 or 1: move them, so that each one matters
            for parameter in model.parameters():
                if parameter.dim() == 1:
                    parameter.add_(torch.randn_like(parameter) * 0.2)
        saved[kind] = root / f"m{number}"
        model.save_pretrained(saved[kind])
        tokenizer.save_pretrained(saved[kind])
    return saved


@pytest.fixture(scope="module")
def loaded(folders):
    return {kind: build_model(f"hf:{folder}", "DEFAULT", None, 0, None) for kind, folder in folders.items()}


def hooked_transformer(kind: str, folder: Path):
    """TransformerLens's model of the saved weights, without weight processing."""
    import transformer_lens.loading_from_pretrained as loading
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gemma import convert_gemma_weights

    hf = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    if kind in TL_GEMMA:
        options = loading.convert_hf_model_config(TL_GEMMA[kind])
        options.update(d_model=32, d_head=8, n_heads=4, d_mlp=64, n_layers=2, n_ctx=64, d_vocab=hf.config.vocab_size)
        options.update(
            n_key_value_heads=2, rotary_dim=8, **({"attn_types": ["local", "global"]} if kind == "gemma2" else {})
        )
        cfg = HookedTransformerConfig(**options, device="cpu", dtype=torch.float32)
        state = convert_gemma_weights(hf, cfg)
    else:
        cfg = loading.get_pretrained_model_config(str(folder), fold_ln=False, device="cpu", dtype=torch.float32)
        state = loading.get_pretrained_state_dict(str(folder), cfg, hf_model=hf)
    model = HookedTransformer(cfg, tf.AutoTokenizer.from_pretrained(folder))
    model.load_and_process_state_dict(
        state, fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )  # fmt: skip
    return model.eval()


def lens_refs(model):
    return [ref for name, ref in model.aliases.items() if not name.startswith("hidden_states.")]


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_every_name_equals_transformer_lens_run_with_cache(kind, folders, loaded):
    model = loaded[kind]
    reference = hooked_transformer(kind, folders[kind])
    ids = torch.randint(5, 390, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _, cache = reference.run_with_cache(ids)
    refs = lens_refs(model)
    gated = kind not in ("gpt2", "neox", "neox_sequential")
    per_block = [n for n in BLOCK_NAMES if not (kind == "neox" and n == "hook_resid_mid")]
    expected = {f"blocks.{b}.{n}" for b in range(reference.cfg.n_layers) for n in (*per_block, *MLP_NAMES)}
    expected |= {f"blocks.{b}.mlp.hook_pre_linear" for b in range(reference.cfg.n_layers) if gated}
    expected |= {"hook_embed", "unembed.hook_in", *(["hook_pos_embed"] if kind == "gpt2" else [])}
    assert {ref.name for ref in refs} == expected
    with Capture(model.model, refs) as cap, torch.inference_mode():
        model.call(model.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    for ref in refs:
        ours, theirs = cap[ref.name], cache[ref.name]
        if ref.name == "hook_pos_embed":  # GPT-2 computes it once for the batch: (1, T, D)
            ours = ours.expand_as(theirs)
        assert ours.shape == theirs.shape, ref.name
        torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL * max(1.0, float(theirs.abs().max())), msg=ref.name)
    # TransformerLens's hook_normalized is before the norm's weight: the norm's output is not it
    norm = model.absent_aliases["blocks.0.ln2.hook_normalized"].rpartition("with them it is ")[2].split()[0]
    with Capture(model.model, [norm]) as cap, torch.inference_mode():
        model.call(model.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert not torch.allclose(cap[norm], cache["blocks.0.ln2.hook_normalized"], atol=1e-3)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_names_stop_the_forward_and_follow_hidden_states(kind, folders, loaded):
    model = loaded[kind]
    hf = tf.AutoModelForCausalLM.from_pretrained(folders[kind]).eval()
    ids = torch.randint(5, 390, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        states = hf(input_ids=ids, output_hidden_states=True).hidden_states
    blocks = len(states) - 1
    names = [f"blocks.{b}.hook_resid_pre" for b in range(blocks)] + [
        f"blocks.{b}.hook_resid_post" for b in range(blocks - 1)
    ]
    with Capture(model.model, [model.aliases[n] for n in names]) as cap, torch.inference_mode():
        model.call(model.model, {"input_ids": ids})
    for b in range(blocks):
        torch.testing.assert_close(cap[f"blocks.{b}.hook_resid_pre"], states[b], rtol=0, atol=ATOL)
    for b in range(blocks - 1):  # the last hidden state is after the final norm, not block L-1's output
        torch.testing.assert_close(cap[f"blocks.{b}.hook_resid_post"], states[b + 1], rtol=0, atol=ATOL)
    # an input fires before its module runs: asking for block 1's input alone, block 1 never runs
    ran = []
    block = model.aliases["blocks.1.hook_resid_pre"].module
    handle = dict(model.model.named_modules())[block].register_forward_hook(lambda *a: ran.append(block))
    with Capture(model.model, [model.aliases["blocks.1.hook_resid_pre"]], stop=True) as cap, torch.inference_mode():
        assert model.call(cap.forward, {"input_ids": ids}) is None
    handle.remove()
    assert ran == [] and torch.equal(cap["blocks.1.hook_resid_pre"], states[1])


@pytest.mark.parametrize(
    ("kind", "layers"),
    [
        ("gpt2", ["transformer.h.1.mlp@input", "transformer.h.1@input", "transformer.h.1.attn@input"]),
        # Llama's attention takes its input as hidden_states=, its MLP and decoder layers positionally
        ("llama", ["model.layers.1@input", "model.layers.1.self_attn@input", "model.layers.1.mlp@input"]),
    ],
)
def test_an_input_equals_what_a_plain_forward_pre_hook_sees(kind, layers, loaded):
    model = loaded[kind]
    modules = dict(model.model.named_modules())
    seen, handles = {}, []
    for layer in layers:
        name = layer.removesuffix("@input")

        def hook(module, args, kwargs, name=name):
            seen[name] = ("args", args[0].clone()) if args else ("hidden_states", kwargs["hidden_states"].clone())

        handles.append(modules[name].register_forward_pre_hook(hook, with_kwargs=True))
    ids = torch.randint(5, 390, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        model.call(model.model, {"input_ids": ids})
    for handle in handles:
        handle.remove()
    if kind == "llama":
        assert seen["model.layers.1.self_attn"][0] == "hidden_states"  # the keyword path is the one tested
    with Capture(model.model, layers) as cap, torch.inference_mode():
        model.call(model.model, {"input_ids": ids})
    for layer in layers:
        assert torch.equal(cap[layer], seen[layer.removesuffix("@input")][1]), layer


@pytest.mark.parametrize(
    ("kind", "layer", "message"),
    [
        ("neox", "blocks.0.hook_resid_mid", "GPTNeoXForCausalLM has a parallel residual (use_parallel_residual)"),
        ("llama", "hook_pos_embed", "LlamaForCausalLM has rotary positions: no position embedding"),
        ("gpt2", "blocks.1.ln2.hook_normalized", "with them it is transformer.h.1.ln_2 (= transformer.h.1.mlp@input)"),
        ("gemma2", "ln_final.hook_normalized", "x / scale before its weight, which no module returns"),
        ("gpt2", "blocks.7.hook_resid_pre", "matches no module; closest: blocks.2.hook_resid_pre"),
    ],
)
def test_a_name_without_a_tensor_is_one_line_naming_the_closest(kind, layer, message, loaded):
    model = loaded[kind]
    with pytest.raises(ExtractError) as error:
        resolve_layers(model.model, [layer], model.aliases, model.absent_aliases)
    text = str(error.value)
    assert message in text and "closest: " in text and "\n" not in text, text


def test_a_model_without_the_names_says_which_have_them():
    from helpers.reference import resnet18

    with pytest.raises(ExtractError) as error:
        resolve_layers(resnet18(), ["blocks.0.hook_resid_pre"])
    assert LENS_HINT in str(error.value)


def test_the_cli_stores_every_name_as_transformer_lens_computes_it(folders, tmp_path, cli):
    documents = [d for d in real_documents(12) if len(d) > 40][:4]
    data = write_jsonl(tmp_path / "docs.jsonl", documents)
    out = tmp_path / "lens.zarr"
    layers = ["hook_embed", "blocks.*.hook_*", "blocks.*.mlp.hook_*", "unembed.hook_in", "transformer.h.1.mlp@input"]
    code, _, err = cli(
        "--model", f"hf:{folders['gpt2']}", "--layers", *layers, "--data", f"text:{data}", "--dtype", "float32",
        "--context-length", "24", "--out", out,
    )  # fmt: skip
    assert code == 0, err
    f = open_features(out)
    names = {f"blocks.{b}.{n}" for b in range(3) for n in (*BLOCK_NAMES, *MLP_NAMES)}
    assert set(f.layers) == names | {"hook_embed", "unembed.hook_in", "transformer.h.1.mlp@input"}
    assert f.resolved_layers["blocks.2.hook_resid_pre"] == "transformer.h.2@input"
    assert f.resolved_layers["blocks.0.hook_attn_out"] == "transformer.h.0.attn:0"
    assert f.resolved_layers["transformer.h.1.mlp@input"] == "transformer.h.1.mlp@input"
    reference = hooked_transformer("gpt2", folders["gpt2"])
    hf = tf.AutoModelForCausalLM.from_pretrained(folders["gpt2"]).eval()
    norms = []
    hf.transformer.h[1].ln_2.register_forward_hook(lambda m, i, o: norms.append(o))
    for i in range(len(documents)):
        ids = torch.from_numpy(f.text.token_ids[f.text.offsets[i] : f.text.offsets[i + 1]].astype(np.int64))[None]
        with torch.inference_mode():
            _, cache = reference.run_with_cache(ids)
            hf(input_ids=ids)
        for name in names | {"hook_embed", "unembed.hook_in"}:
            np.testing.assert_allclose(f.text.document(i, name), cache[name][0].numpy(), rtol=0, atol=ATOL, err_msg=name)
        np.testing.assert_allclose(f.text.document(i, "transformer.h.1.mlp@input"), norms[-1][0].numpy(), rtol=0, atol=ATOL)


def test_the_cli_refuses_a_missing_name_in_one_line(folders, tmp_path, cli):
    data = write_jsonl(tmp_path / "docs.jsonl", list(real_documents(2)))
    out = tmp_path / "never.zarr"
    code, _, err = cli(
        "--model", f"hf:{folders['neox']}", "--layers", "blocks.1.hook_resid_mid", "--data", f"text:{data}", "--out", out
    )  # fmt: skip
    errors = [line for line in err.splitlines() if "extract: error:" in line]  # transformers' progress bars aside
    assert code == 2 and len(errors) == 1, err
    assert "extract: error: layer 'blocks.1.hook_resid_mid': GPTNeoXForCausalLM has a parallel residual" in errors[0]
    assert "closest: blocks.1.hook_resid_pre" in errors[0] and not out.exists()


def test_list_layers_shows_the_names_with_their_tensors_and_every_input(folders, cli):
    code, out, err = cli("--model", f"hf:{folders['gpt2']}", "--list-layers")
    assert code == 0, err
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert rows["blocks.0.hook_resid_pre"] == ["->", "transformer.h.0@input", "(B,", "8,", "32)", "NLC"]
    assert rows["blocks.2.hook_attn_out"] == ["->", "transformer.h.2.attn:0", "(B,", "8,", "32)", "NLC"]
    assert rows["blocks.1.mlp.hook_post"] == ["->", "transformer.h.1.mlp.c_proj@input", "(B,", "8,", "128)", "NLC"]
    assert rows["transformer.h.1.mlp@input"] == ["GPT2MLP", "(B,", "8,", "32)", "NLC"]
    assert rows["transformer.h.1.mlp"] == ["GPT2MLP", "(B,", "8,", "32)", "NLC"]
    assert "blocks.0.ln2.hook_normalized" not in rows


def test_an_input_is_a_layer_of_an_image_store_too(tmp_path, cli):
    out = tmp_path / "images.zarr"
    code, _, err = cli(
        "--model", "resnet18", "--weights", "none", "--layers", "layer3", "layer4@input", "--pool", "layer4@input=avg",
        "--data", "synthetic:4", "--image-size", "32", "--dtype", "float32", "--num-workers", "0", "--out", out,
    )  # fmt: skip
    assert code == 0, err
    f = open_features(out)
    assert f.layers == ["layer3", "layer4@input"] and f.layout("layer3") == "NCHW"
    assert f.attrs["pools"] == {"layer3": "none", "layer4@input": "avg"}
    np.testing.assert_allclose(f.load("layer4@input"), f.load("layer3").mean(axis=(2, 3)), rtol=1e-6, atol=1e-6)


def test_a_per_layer_option_names_an_input_by_its_own_name():
    from extract.names.layers import LayerRef
    from extract.names.pooling import per_layer

    refs = [LayerRef("layer4", input=True), LayerRef("layer4"), LayerRef("layer3", alias="before")]
    assert per_layer(["layer4=avg"], refs, "pool", "none") == {
        "layer4@input": "none",
        "layer4": "avg",
        "before": "none",
    }
    assert per_layer(["layer4@input=max", "layer3=avg"], refs, "pool", "none") == {
        "layer4@input": "max",
        "layer4": "none",
        "before": "avg",
    }
