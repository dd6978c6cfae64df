"""Text models from ``--model hf:DIR``: the tokenizer's own ids and special tokens, the model classes,
weights and precision, the ``hidden_states`` aliases, the tokenizer's record and ``--list-layers``,
each against transformers run alone. Tiny GPT-2, Llama and BERT models with tokenizers trained here
(tests/helpers/text_models.py), on real text (the standard library's docstrings); nothing is downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from helpers.launches import Sequence
from helpers.text_models import real_documents, save_text_model
from safetensors.torch import load_file

from extract.capture import Capture
from extract.errors import ExtractError
from extract.models import build_model
from extract.models.hf_text import TextModel, text_model_class

KINDS = ("gpt2", "llama", "bert")
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertModel"}
MODULES = {"gpt2": ["transformer.h.0", "lm_head"], "llama": ["model.layers.0", "lm_head"], "bert": ["encoder.layer.0"]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text-models")
    return {kind: save_text_model(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def loaded(dirs) -> dict[str, TextModel]:
    return {kind: build_model(f"hf:{folder}", "DEFAULT", None, 0, None) for kind, folder in dirs.items()}


def reference_class(kind: str):
    return transformers.AutoModel if kind == "bert" else transformers.AutoModelForCausalLM


# --- tokenizing ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_encode_gives_the_tokenizers_ids_and_special_tokens(kind, dirs, loaded):
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs[kind])
    model = loaded[kind]
    documents = [*real_documents(40), ""]
    truncated = 0
    for length in (4, 32, 10_000):
        for doc in documents:
            encoded = model.encode(doc, None, length)
            expected = tokenizer(doc, truncation=True, max_length=length, return_special_tokens_mask=True)
            assert encoded.ids.dtype == np.int32 and encoded.special.dtype == np.bool_
            assert encoded.ids.tolist() == expected["input_ids"], (kind, length, doc[:60])
            assert encoded.special.tolist() == [bool(v) for v in expected["special_tokens_mask"]]
            content = len(tokenizer(doc, add_special_tokens=False)["input_ids"])
            kept = len(expected["input_ids"]) - sum(expected["special_tokens_mask"])
            assert encoded.dropped == content - kept
            truncated += encoded.dropped > 0
            if length == 10_000:  # nothing cut: the plain call, with the special tokens it adds
                assert encoded.dropped == 0 and encoded.ids.tolist() == tokenizer(doc)["input_ids"]
    assert truncated >= 40  # every document at 4 tokens, most at 32
    specials = {"gpt2": [], "llama": [tokenizer.bos_token_id], "bert": [tokenizer.cls_token_id, tokenizer.sep_token_id]}
    empty = model.encode("", None, 16)
    assert empty.ids.tolist() == specials[kind] and empty.special.all() and empty.dropped == 0


def test_input_ids_are_taken_as_given_and_checked_against_the_vocabulary(dirs, loaded):
    model = loaded["bert"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["bert"])
    ids = tokenizer(real_documents(3)[1])["input_ids"]
    assert len(ids) > 10
    encoded = model.encode(None, ids, 10)
    assert encoded.ids.tolist() == ids[:10] and encoded.dropped == len(ids) - 10
    assert encoded.special.tolist() == [i in tokenizer.all_special_ids for i in ids[:10]]
    assert encoded.special[0] and not encoded.special[1:].any()  # CLS first, then content
    whole = model.encode(None, np.asarray(ids, dtype=np.int64), 10_000)
    assert whole.ids.tolist() == ids and whole.dropped == 0 and whole.special.tolist()[-1]
    assert model.encode(None, [], 8).ids.size == 0
    for doc in [*real_documents(10), "a snowman \u2603 is unknown"]:  # given ids get the mask their text gets
        text = model.encode(doc, None, 64)
        given = model.encode(None, tokenizer(doc, truncation=True, max_length=64)["input_ids"], 64)
        assert given.ids.tolist() == text.ids.tolist() and given.special.tolist() == text.special.tolist()
    assert tokenizer.unk_token_id in text.ids  # the snowman: content, not special
    with pytest.raises(ValueError, match=r"^token id 5000 is outside the vocabulary \(0\.\.399\)$"):
        model.encode(None, [5, 6, 5000, 7], 8)
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        model.encode(None, [5, -1], 8)
    with pytest.raises(ValueError, match="exactly one"):
        model.encode(None, None, 8)
    with pytest.raises(ExtractError, match="--context-length 1 leaves no room for the 2 special tokens"):
        model.encode("some text", None, 1)


def test_pad_id_is_pad_else_eos(dirs, loaded):
    tokenizers = {kind: transformers.AutoTokenizer.from_pretrained(dirs[kind]) for kind in KINDS}
    assert tokenizers["gpt2"].pad_token_id is None and loaded["gpt2"].pad_id == tokenizers["gpt2"].eos_token_id
    assert loaded["llama"].pad_id == tokenizers["llama"].eos_token_id == 2
    assert loaded["bert"].pad_id == tokenizers["bert"].pad_token_id == 0


# --- the model -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_model_class_module_names_and_saved_weights(kind, dirs, loaded):
    model = loaded[kind]
    assert isinstance(model, TextModel) and model.kind == "text" and model.source == "hf"
    assert type(model.model).__name__ == CLASSES[kind] and not model.model.training
    names = dict(model.model.named_modules())
    assert all(name in names for name in MODULES[kind])
    assert ("lm_head" in names) == (kind != "bert")
    saved = load_file(dirs[kind] / "model.safetensors")
    state = model.model.state_dict()
    assert saved and all(torch.equal(state[name], value) for name, value in saved.items())
    assert model.max_positions == 256 and model.weights == f"hf:{dirs[kind]}"


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_random_init_is_seeded_from_the_config(kind, dirs):
    random = build_model(f"hf:{dirs[kind]}", "none", None, 7, None)
    torch.manual_seed(7)
    expected = reference_class(kind).from_config(transformers.AutoConfig.from_pretrained(dirs[kind])).state_dict()
    state = random.model.state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    saved = load_file(dirs[kind] / "model.safetensors")
    assert any(not torch.equal(state[name], value) for name, value in saved.items())
    assert random.weights.startswith("none (random init, seed 7")


def test_precision_loads_the_weights_in_that_dtype(dirs):
    saved = load_file(dirs["llama"] / "model.safetensors")
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), (None, torch.float32)):
        model = build_model(f"hf:{dirs['llama']}", "DEFAULT", None, 0, None, precision=precision).model
        assert {p.dtype for p in model.parameters()} == {dtype}
        state = model.state_dict()
        assert all(torch.equal(state[name], value.to(dtype)) for name, value in saved.items())
    random = build_model(f"hf:{dirs['gpt2']}", "none", None, 3, None, precision="bf16").model
    assert {p.dtype for p in random.parameters()} == {torch.bfloat16}
    fp32 = build_model(f"hf:{dirs['gpt2']}", "none", None, 3, None).model.state_dict()
    assert all(torch.equal(value, fp32[name].to(torch.bfloat16)) for name, value in random.state_dict().items())


def test_checkpoint_loads_into_a_text_model(dirs, tmp_path):
    torch.manual_seed(11)
    other = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(dirs["gpt2"]))
    torch.save(other.state_dict(), tmp_path / "ckpt.pt")
    model = build_model(f"hf:{dirs['gpt2']}", "DEFAULT", str(tmp_path / "ckpt.pt"), 0, None)
    state, expected = model.model.state_dict(), other.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected) and model.checkpoint_sha256


def test_which_class_loads_a_text_config():
    config = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    assert text_model_class(config["gpt2"](architectures=["GPT2LMHeadModel"])) is transformers.AutoModelForCausalLM
    assert text_model_class(config["llama"]()) is transformers.AutoModelForCausalLM  # no architectures: its type
    assert text_model_class(config["qwen2"](architectures=["Qwen2ForCausalLM"])) is transformers.AutoModelForCausalLM
    assert text_model_class(config["bert"]()) is transformers.AutoModel  # a causal-LM head exists, but an encoder
    assert text_model_class(config["bert"](architectures=["BertForMaskedLM"])) is transformers.AutoModel
    assert text_model_class(config["t5"]()) is transformers.AutoModelForTextEncoding  # T5EncoderModel


@pytest.mark.parametrize(("option", "value", "message"), [
    ("image_size", 64, "--image-size does not apply to hf:.*: it is a text model"),
    ("weights", "IMAGENET1K_V1", "--weights IMAGENET1K_V1: hf models take DEFAULT"),
])  # fmt: skip
def test_image_options_are_refused_for_text(dirs, option, value, message):
    arguments = {"weights": "DEFAULT", "image_size": None, option: value}
    with pytest.raises(ExtractError, match=message):
        build_model(f"hf:{dirs['llama']}", arguments["weights"], None, 0, arguments["image_size"])


# --- hidden_states aliases -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_state_aliases_capture_output_hidden_states(kind, dirs, loaded):
    model = loaded[kind]
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs[kind])
    inputs = tokenizer(real_documents(5)[2], truncation=True, max_length=48, return_tensors="pt")
    reference = reference_class(kind).from_pretrained(dirs[kind]).eval()
    with torch.no_grad():
        expected = reference(**inputs, output_hidden_states=True).hidden_states
    hidden = {name: ref for name, ref in model.aliases.items() if name.startswith("hidden_states.")}
    assert sorted(hidden) == sorted(f"hidden_states.{n}" for n in range(len(expected)))
    # causal LMs have TransformerLens's names besides (tests/test_lens.py); BERT has none
    assert (len(model.aliases) > len(hidden)) == (kind != "bert")
    with Capture(model.model, list(hidden.values())) as cap, torch.inference_mode():
        model.call(model.model, dict(inputs))
    for number, state in enumerate(expected):
        captured = cap[f"hidden_states.{number}"]
        assert captured.shape == state.shape and torch.allclose(captured, state, rtol=1e-5, atol=1e-6), number
    final = {"gpt2": "transformer.ln_f", "llama": "model.norm", "bert": "encoder.layer.2"}[kind]
    assert model.aliases[f"hidden_states.{len(expected) - 1}"].module == final
    # resolved to a module, a forward stops right after it
    first = model.aliases["hidden_states.1"]
    with Capture(model.model, [first], stop=True) as cap, torch.inference_mode():
        assert model.call(cap.forward, dict(inputs)) is None
    assert torch.allclose(cap["hidden_states.1"], expected[1], rtol=1e-5, atol=1e-6)


# --- the tokenizer's record ------------------------------------------------------------------


def test_tokenizer_record_is_stable_and_tells_tokenizers_apart(dirs, loaded, tmp_path):
    record = loaded["llama"].tokenizer_record()
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["llama"])
    assert record["class"] == type(tokenizer).__name__ and record["vocab_size"] == len(tokenizer) == 400
    assert record["name_or_path"] == str(dirs["llama"]) and len(record["sha256"]) == 64
    assert record["special_ids"] == {"bos": 1, "eos": 2, "pad": None, "cls": None, "sep": None}
    again = build_model(f"hf:{dirs['llama']}", "none", None, 5, None).tokenizer_record()
    assert again == record
    copy = shutil.copytree(dirs["llama"], tmp_path / "copy")
    assert build_model(f"hf:{copy}", "DEFAULT", None, 0, None).tokenizer_record()["sha256"] == record["sha256"]
    tokenizer.add_tokens(["docstring"])  # one token more: other ids for the same text
    tokenizer.save_pretrained(copy)
    changed = build_model(f"hf:{copy}", "DEFAULT", None, 0, None).tokenizer_record()
    assert changed["sha256"] != record["sha256"] and changed["vocab_size"] == 401
    assert loaded["gpt2"].tokenizer_record()["sha256"] != record["sha256"]
    preprocessing = loaded["bert"].preprocessing
    assert preprocessing == {"source": "hf", "tokenizer": loaded["bert"].tokenizer_record()}
    assert preprocessing["tokenizer"]["special_ids"] == {"bos": None, "eos": None, "pad": 0, "cls": 2, "sep": 3}


def test_example_and_call(loaded):
    model = loaded["gpt2"]
    example = model.example(2)
    assert example["input_ids"].shape == (2, 8) and example["attention_mask"].eq(1).all()
    assert not torch.isin(example["input_ids"], torch.tensor(model.tokenizer.all_special_ids)).any()
    assert model.example(1, scale=2)["input_ids"].shape == (1, 16)
    assert model.example(1, length=1000)["input_ids"].shape == (1, 256)  # at most the model's positions
    with torch.inference_mode():
        logits = model.call(model.model, example).logits
    assert logits.shape == (2, 8, 400)


# --- text or vision, and --list-layers -------------------------------------------------------


@pytest.fixture(scope="module")
def dinov2_dir(tmp_path_factory) -> Path:
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    folder = tmp_path_factory.mktemp("dinov2")
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    Dinov2Model(config).save_pretrained(folder)
    BitImageProcessor(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def test_a_vision_model_stays_vision_even_with_a_tokenizer(dinov2_dir, dirs, tmp_path):
    vision = build_model(f"hf:{dinov2_dir}", "DEFAULT", None, 0, None)
    assert vision.kind == "image" and not isinstance(vision, TextModel) and vision.input_name == "pixel_values"
    both = shutil.copytree(dinov2_dir, tmp_path / "both")
    transformers.AutoTokenizer.from_pretrained(dirs["bert"]).save_pretrained(both)
    assert build_model(f"hf:{both}", "DEFAULT", None, 0, None).kind == "image"  # it has an image processor
    (both / "preprocessor_config.json").unlink()  # a vision-only model type: still vision, which needs one
    with pytest.raises(ExtractError, match="has no preprocessor_config.json"):
        build_model(f"hf:{both}", "DEFAULT", None, 0, None)


@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_list_layers_offline_for_text_a_cached_hub_id_and_no_tokenizer(dirs, tmp_path):
    cache = tmp_path / "hf"
    snapshot = cache / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(dirs["llama"], snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(dirs["gpt2"], no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*"))
    jobs = {
        "dir": ["--model", f"hf:{dirs['gpt2']}", "--list-layers"],
        "hub": ["--model", "hf:tiny-org/tiny-llama", "--list-layers"],
        "none": ["--model", f"hf:{no_tokenizer}", "--layers", "x", "--data", "synthetic:2", "--out", tmp_path / "o"],
    }
    sequence = Sequence(None, jobs, tmp_path, env={"HF_HOME": str(cache), "HF_HUB_OFFLINE": "1"})
    launch = sequence.run(timeout=300)
    assert launch.returncode == 0, launch.stderr[-3000:]
    for name, rows in (("dir", {"transformer.h.0", "lm_head"}), ("hub", {"model.layers.0", "lm_head"})):
        result = sequence.result(name)
        assert result.codes == [0], result.stderr
        header, *lines = result.stdout.splitlines()
        assert "output shapes for a batch of B sequences of T tokens (T = 8 here)" in header
        table = {line.split()[0]: line for line in lines}
        assert rows <= table.keys()
        for row in rows:
            assert "(B, 8, " in table[row] and table[row].endswith("NLC"), table[row]
    hub = {line.split()[0]: line for line in sequence.result("hub").stdout.splitlines()}
    assert "-> model.norm" in hub["hidden_states.3"]
    failed = sequence.result("none")
    assert failed.codes == [2]
    assert failed.stderr.strip() == (
        f"extract: error: --model hf:{no_tokenizer} has no tokenizer (tokenizer.json or tokenizer_config.json); "
        f"save it there with tokenizer.save_pretrained({no_tokenizer})"
    )
    assert not (tmp_path / "o").exists()


# --- a sentence-transformers folder's own pipeline (--pool model) ------------------------------


def _sentence_folder(source: Path, folder: Path, modules: list[str], pooling: dict | None, **settings) -> Path:
    """``source`` (a saved model) with sentence-transformers files: ``modules`` by type after the
    Transformer, the Pooling module's ``pooling`` config and ``sentence_bert_config.json`` ``settings``."""
    import json

    shutil.copytree(source, folder)
    listed = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    for number, kind in enumerate(modules, 1):
        listed.append({"idx": number, "name": str(number), "path": f"{number}_{kind}",
                       "type": f"sentence_transformers.models.{kind}"})  # fmt: skip
        (folder / f"{number}_{kind}").mkdir()
        if kind == "Pooling" and pooling is not None:
            (folder / f"{number}_{kind}" / "config.json").write_text(json.dumps(pooling))
    (folder / "modules.json").write_text(json.dumps(listed))
    (folder / "sentence_bert_config.json").write_text(json.dumps(settings))
    return folder


@pytest.mark.parametrize(
    ("pooling", "modules", "pool", "normalize"),
    [({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, ["Pooling"], "first", False),
     ({"pooling_mode_mean_tokens": False}, ["Pooling", "Normalize"], "mean", True),  # no flag set: mean
     ({"pooling_mode": "lasttoken"}, ["Pooling", "Normalize"], "last", True),
     ({"pooling_mode": ["max"]}, ["Pooling"], "max", False)],
)  # fmt: skip
def test_a_sentence_transformers_folder_names_its_pooling_and_length(dirs, tmp_path, pooling, modules, pool, normalize):
    folder = _sentence_folder(dirs["bert"], tmp_path / "st", modules, pooling, max_seq_length=1000)
    model = build_model(f"hf:{folder}", "DEFAULT", None, 0, None)
    applied = model.model_pooling()
    assert (applied.pool, applied.normalize) == (pool, normalize)
    assert "modules.json" in applied.source and str(tmp_path) not in applied.source  # the same wherever installed
    assert model.default_context_length == 256  # max_seq_length, at most the model's 256 positions


@pytest.mark.parametrize(
    ("pooling", "modules", "words"),
    [({"pooling_mode": "weightedmean"}, ["Pooling"], "pools by weightedmean, which extract does not reproduce"),
     ({"pooling_mode": ["mean", "max"]}, ["Pooling"], "pools by mean + max"),
     ({"pooling_mode": "mean"}, ["Pooling", "Dense", "Normalize"], "has a Dense module (2_Dense) that extract does not apply"),
     (None, ["Pooling"], "names a Pooling module whose 1_Pooling/config.json is missing"),
     (None, ["Normalize"], "has a Normalize module (1_Normalize) that extract does not apply")],
)  # fmt: skip
def test_a_pipeline_extract_cannot_follow_refuses_only_pool_model(dirs, tmp_path, pooling, modules, words):
    folder = _sentence_folder(dirs["bert"], tmp_path / "st", modules, pooling, max_seq_length=128)
    model = build_model(f"hf:{folder}", "DEFAULT", None, 0, None)
    assert model.default_context_length == 128  # --pool mean still truncates where encode does
    with pytest.raises(ExtractError, match="--pool model") as caught:
        model.model_pooling()
    assert words in str(caught.value) and "use --pool mean" in str(caught.value) and "\n" not in str(caught.value)


def test_a_model_without_sentence_transformers_files_keeps_its_positions(loaded, dirs):
    model = loaded["bert"]
    assert model.default_context_length is None
    with pytest.raises(ExtractError) as caught:
        model.model_pooling()
    assert str(caught.value) == (
        f"--pool model follows a sentence-transformers pipeline, but {dirs['bert'] / 'modules.json'} does not "
        "exist; use --pool mean, max, first, last"
    )


def test_tensor_parallel_splits_the_experts_of_an_moe_and_refuses_what_it_cannot_split():
    """Decided from the config alone (no weights): a Qwen3-MoE's 4 experts split over 2 or 4 ranks, not 3; a
    Llama is dense; Llama 4's text model has experts but transformers has no expert plan for it."""
    from types import SimpleNamespace

    from extract.models.hf_text import check_tensor_parallel, splits_experts

    def request(size):
        return SimpleNamespace(tensor_parallel=SimpleNamespace(size=size), load_weights=True, weights="DEFAULT")

    moe = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2)
    for size in (2, 4):
        check_tensor_parallel("moe", moe, request(size))
    assert splits_experts(moe) and not splits_experts(transformers.LlamaConfig())
    check_tensor_parallel("llama", transformers.LlamaConfig(), request(3))
    with pytest.raises(ExtractError, match=r"has 4 experts per MoE block, which do not split over 3 ranks.*such as 2, 4"):
        check_tensor_parallel("moe", moe, request(3))
    with pytest.raises(ExtractError, match=r"mixture of experts of type 'llama4_text'.*no expert-parallel plan.*mixtral"):
        check_tensor_parallel("l4", transformers.Llama4TextConfig(num_local_experts=4), request(2))
