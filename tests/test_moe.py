"""Mixture-of-experts routing per token (``BLOCK@router``), over a Mixtral and a Qwen2-MoE (shared expert,
weights not renormalized) saved from configs, on real text of very different lengths: in one process, in
2 data-parallel processes and in one tensor-parallel group of 2 (gloo).

Every token's stored router logits, top-k experts and weights are compared with transformers' own
``output_router_logits=True`` over the same tokens, each document (or packed context) run alone, the
experts and weights derived from those logits as each model's router derives them; the per-expert
statistics with a bincount of the stored experts. An expert's own output is refused in one line.

Under ``--tensor-parallel 2`` the experts are split over the group (transformers' expert-parallel plan):
every MoE family transformers ships with one (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 with MLA
attention, a shared expert and a dense first layer, gpt-oss unquantized), built tiny from its config, gives
each token's routing, the MoE block's output, the layer's output and the attention's gathered per-head
output as each document run alone in one process gives them (its router's own output, by a hook), and
each rank holds its half of the experts (the run record's parameter bytes). An expert count the group
does not divide, and an MoE family without an expert plan, are refused in one line before any weight loads
(their folders hold no weights at all)."""

import numpy as np
import pytest
import torch
import zarr
from helpers import patience
from helpers.cli import one_line_error
from helpers.launches import Sequence
from helpers.stores import assert_same_bytes
from helpers.text_models import real_documents, save_text_model, write_jsonl

from extract import open_features

pytestmark = pytest.mark.slow

BLOCKS = ["model.layers.0.mlp", "model.layers.1.mlp"]
ROUTERS = [f"{block}@router" for block in BLOCKS]
LAYERS = ["model.layers.*.mlp@router", "model.layers.1.mlp"]  # the routing, beside a block's own output
TOKENS = ["--context-length", "64", "--chunk-size", "32", "--tokens-per-batch", "96", "--dtype", "float32"]
PACKED = ["--pack", "40", "--chunk-size", "48", "--tokens-per-batch", "120", "--dtype", "float32"]


# each family's MoE blocks by layer (DeepSeek-V3's first layer is a dense MLP: first_k_dense_replace=1)
FAMILIES = {"mixtral": (0, 1), "qwen2_moe": (0, 1), "qwen3_moe": (0, 1), "olmoe": (0, 1), "deepseek_v3": (1,),
            "gpt_oss": (0, 1)}  # fmt: skip
# beside the routing: the layer's and the MoE block's outputs (replicated), and the attention's per-head
# output (o_proj's input: sharded and gathered where the plan splits the attention)
FAMILY_MODULES = {"model.layers.1": ("model.layers.1", False), "model.layers.1.mlp": ("model.layers.1.mlp", False),
                  "model.layers.0.self_attn.o_proj@input": ("model.layers.0.self_attn.o_proj", True)}  # fmt: skip


def _save_config_only(kind: str, folder):
    """A model's config and tokenizer without weights: what a refusal before any weight loads needs."""
    import transformers as tf
    from helpers.text_models import llama_tokenizer

    tokenizer = llama_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=48)  # fmt: skip
    if kind == "three_experts":
        config = tf.MixtralConfig(num_local_experts=3, num_experts_per_tok=2, architectures=["MixtralForCausalLM"],
                                  **common)  # fmt: skip
    else:  # Llama 4's text model: a tensor-parallel plan, but no expert-parallel one
        config = tf.Llama4TextConfig(num_local_experts=4, intermediate_size_mlp=48,
                                     architectures=["Llama4ForCausalLM"], **common)  # fmt: skip
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    write_jsonl(root / "docs.jsonl", real_documents(24, seed=9))
    write_jsonl(root / "few.jsonl", real_documents(24, seed=9)[:10])  # the families' jobs: shorter, as many kinds
    saved = {kind: save_text_model(kind, root / kind) for kind in FAMILIES}
    saved.update({kind: _save_config_only(kind, root / kind) for kind in ("three_experts", "no_expert_plan")})
    return root, saved


def _stored(kind: str, layer: str) -> str:
    """gpt-oss's MoE block returns (output, router scores): its output is element 0."""
    return f"{layer}:0" if kind == "gpt_oss" and layer == "model.layers.1.mlp" else layer


def _family_layers(kind: str) -> list[str]:
    return [f"model.layers.{i}.mlp@router" for i in FAMILIES[kind]] + [_stored(kind, m) for m in FAMILY_MODULES]


def _job(models, kind, out, *options, layers=LAYERS, documents="docs.jsonl"):
    root, saved = models
    return ["--model", f"hf:{saved[kind]}", "--layers", *layers, "--data", f"text:{root / documents}", *options,
            "--out", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    one, two = tmp_path_factory.mktemp("moe-one"), tmp_path_factory.mktemp("moe-two")
    alone = {
        "mixtral": _job(models, "mixtral", one / "mixtral.zarr", *TOKENS),
        "qwen2_moe": _job(models, "qwen2_moe", one / "qwen2_moe.zarr", *PACKED),
        "experts": _job(models, "mixtral", one / "experts.zarr", *TOKENS, layers=["model.layers.0.mlp.experts"]),
        "pooled": _job(models, "mixtral", one / "pooled.zarr", *TOKENS, "--pool", "mean"),
        "not_moe": _job(models, "mixtral", one / "attn.zarr", *TOKENS, layers=["model.layers.0.self_attn@router"]),
    }
    paired = {
        "mixtral": _job(models, "mixtral", two / "mixtral.zarr", *TOKENS),
        # Qwen2-MoE's is packed, on all the documents: the routing test below reads it too
        "qwen2_moe_ep": _job(models, "qwen2_moe", two / "qwen2_moe_ep.zarr", *PACKED, "--tensor-parallel", "2",
                             layers=_family_layers("qwen2_moe")),
        **{f"{kind}_ep": _job(models, kind, two / f"{kind}_ep.zarr", *TOKENS, "--tensor-parallel", "2",
                              layers=_family_layers(kind), documents="few.jsonl")
           for kind in FAMILIES if kind != "qwen2_moe"},
        **{kind: _job(models, kind, two / f"{kind}.zarr", *TOKENS, "--tensor-parallel", "2")
           for kind in ("three_experts", "no_expert_plan")},
    }  # fmt: skip
    first, second = Sequence(None, alone, one), Sequence(2, paired, two)
    launched = second.start()  # the two launches share the machine: one waits on its subprocess anyway
    finished = first.run(timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    _, err = patience.communicate(launched, quiet=600)
    assert launched.returncode == 0, err[-3000:]
    return {"one": first, "two": second}


_MODELS: dict = {}


def _model(path):
    from transformers import AutoModelForCausalLM

    if path not in _MODELS:
        _MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _MODELS[path]


def _routing_alone(model, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per MoE block: (logits, experts, weights) of one document run alone, from transformers'
    ``output_router_logits=True``; the experts and weights as the model's config says its router picks them."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True, use_cache=False)
    config = model.config
    renormalize = getattr(config, "norm_topk_prob", True)  # Mixtral always renormalizes over the top k
    routed = []
    for logits in out.router_logits:
        probabilities = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probabilities, config.num_experts_per_tok, dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        routed.append((logits.numpy(), experts.numpy(), weights.numpy()))
    return routed


def _check_against_transformers(store, model_path) -> float:
    """Every row of ``store``'s routers against each document (context) run alone; the largest logit
    difference. Experts must be the same where the k-th and next probabilities are not a near tie."""
    features, model = open_features(store), _model(model_path)
    offsets, ids = features.text.offsets, features.text.token_ids
    logits = {router: features.load(router) for router in ROUTERS}
    codes = {router: features.codes(router) for router in ROUTERS}
    worst, compared = 0.0, 0
    for index in range(len(offsets) - 1):
        rows = slice(int(offsets[index]), int(offsets[index + 1]))
        if rows.stop == rows.start:
            continue
        for router, (want_logits, want_experts, want_weights) in zip(ROUTERS, _routing_alone(model, ids[rows].tolist()), strict=True):
            got_experts, got_weights = codes[router][0][rows], codes[router][1][rows]
            assert got_experts.dtype == np.int32 and got_weights.dtype == np.float32
            worst = max(worst, float(np.abs(logits[router][rows] - want_logits).max()))
            np.testing.assert_allclose(logits[router][rows], want_logits, rtol=0, atol=1e-5)
            probabilities = np.sort(torch.softmax(torch.from_numpy(want_logits), -1).numpy(), axis=-1)[:, ::-1]
            k = want_experts.shape[1]
            clear = probabilities[:, k - 1] - probabilities[:, k] > 1e-4  # no near tie at the k-th expert
            np.testing.assert_array_equal(got_experts[clear], want_experts[clear])
            np.testing.assert_allclose(got_weights[clear], want_weights[clear], rtol=0, atol=1e-5)
            compared += int(clear.sum())
    assert compared > 0.9 * len(ids) * len(ROUTERS)
    return worst


@pytest.mark.parametrize(
    "run, name, kind",
    [("one", "mixtral", "mixtral"), ("one", "qwen2_moe", "qwen2_moe"), ("two", "mixtral", "mixtral"),
     ("two", "mixtral_ep", "mixtral"), ("two", "qwen2_moe_ep", "qwen2_moe")],
)  # fmt: skip
def test_routing_equals_transformers_router_logits(models, runs, run, name, kind):
    from extract.cli.verify import main as verify

    result = runs[run].result(name)
    assert set(result.codes) == {0}, result.stderr[-3000:]
    if name.endswith(("_tp", "_ep")):
        assert "2 processes as 1 x 2 (data x tensor parallel)" in result.stderr
    store = runs[run].folder / f"{name}.zarr"
    assert verify([str(store)]) == 0
    group = zarr.open_group(store, mode="r")
    config = _model(models[1][kind]).config
    for router in ROUTERS:
        attrs = group[f"latents/{router}"].attrs
        assert attrs["architecture"] == "router" and attrs["hook_name"] == router.replace("@router", ".gate")
        assert (attrs["d_sae"], attrs["k"]) == (getattr(config, "num_local_experts", 6), config.num_experts_per_tok)
    assert _check_against_transformers(store, models[1][kind]) <= 1e-5


def test_two_data_parallel_processes_give_the_bytes_of_one(runs):
    assert_same_bytes(runs["two"].folder / "mixtral.zarr", runs["one"].folder / "mixtral.zarr")


@pytest.mark.parametrize("run, name", [("one", "qwen2_moe"), ("two", "qwen2_moe_ep")])
def test_each_experts_load_is_counted_per_chunk(runs, run, name):
    """stats/latents/BLOCK@router: per chunk, the tokens routed to each expert and the weight they got; also
    with the experts split over a tensor-parallel group (packed contexts)."""
    features = open_features(runs[run].folder / f"{name}.zarr")
    for router in ROUTERS:
        experts, weights = features.codes(router)
        np.testing.assert_array_equal(features.codes(router, slice(5, 9))[0], experts[5:9])
        stats = features.stats(f"latents/{router}")
        load = np.bincount(experts.ravel(), minlength=6)
        np.testing.assert_array_equal(stats["count"], load)
        mass = np.bincount(experts.ravel(), weights=weights.ravel().astype(np.float64), minlength=6)
        assert stats["rows"] == features.num_samples and stats["rows_over_k"] == 0 and stats["dropped_mass"] == 0
        np.testing.assert_allclose(stats["mean"] * stats["rows"], mass, rtol=1e-9)
        dense = features.latents(router).toarray()  # tokens x experts: each token's weight on its experts
        assert dense.shape == (features.num_samples, 6)
        np.testing.assert_array_equal((dense != 0).sum(1), 2)


@pytest.mark.parametrize(
    "name, says",
    [
        ("experts", ["inside the experts of mixture-of-experts block model.layers.0.mlp",
                     "sees only the tokens routed to it", "'model.layers.0.mlp'", "model.layers.0.mlp@router"]),
        ("pooled", ["is each token's routing", "--pool none"]),
        ("not_moe", ["model.layers.0.self_attn is not a mixture-of-experts block", "model.layers.0.mlp@router"]),
    ],
)  # fmt: skip
def test_what_has_no_row_per_token_is_refused_in_one_line(runs, name, says):
    result = runs["one"].result(name)
    assert result.codes == [2], result.stderr[-3000:]
    line = one_line_error(result.stderr)
    for words in says:
        assert words in line, line


def _alone_with_hooks(model, ids: list[int], routers: list[str]) -> dict[str, object]:
    """One document run alone in one process: each router module's own output (logits, weights, experts)
    and each of ``FAMILY_MODULES``'s rows, by forward hooks."""
    modules = dict(model.named_modules())
    seen: dict[str, object] = {}
    handles = []
    for router in routers:
        block = router.removesuffix("@router")
        name = next(f"{block}.{child}" for child in ("gate", "router") if f"{block}.{child}" in modules)

        def keep_routing(module, args, output, router=router):
            seen[router] = tuple(part.detach().float().clone() for part in output)

        handles.append(modules[name].register_forward_hook(keep_routing))
    for layer, (name, is_input) in FAMILY_MODULES.items():

        def keep(module, args, output=None, layer=layer, is_input=is_input):
            value = args[0] if is_input else output
            seen[layer] = (value[0] if isinstance(value, tuple) else value).detach()[0].clone()

        hook = modules[name].register_forward_pre_hook if is_input else modules[name].register_forward_hook
        handles.append(hook(keep))
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _by_expert(experts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token's (expert, weight) pairs in expert order: a router may list its top k unsorted."""
    order = np.argsort(experts, axis=1, kind="stable")
    return np.take_along_axis(experts, order, 1), np.take_along_axis(weights, order, 1)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_every_moe_family_split_over_the_group_gives_each_document_as_run_alone(models, runs, kind):
    """Experts split over a group of 2 (transformers' expert plan), against each document run alone in one
    process: every token's routing from its router's own output, the block's and the layer's outputs and
    the gathered attention heads, within the tensor-parallel tests' tolerance (1e-5 of the layer's scale)."""
    from extract.cli.verify import main as verify

    result = runs["two"].result(f"{kind}_ep")
    assert result.codes == [0, 0], result.stderr[-3000:]
    assert "2 processes as 1 x 2 (data x tensor parallel)" in result.stderr
    store = runs["two"].folder / f"{kind}_ep.zarr"
    assert verify([str(store)]) == 0
    model = _model(models[1][kind])
    # each rank holds half the experts: at most the rest of the model and half of the experts' bytes
    whole = sum(p.nbytes for p in model.parameters())
    experts = sum(p.nbytes for name, p in model.named_parameters() if ".experts." in name)
    held = zarr.open_group(store, mode="r").attrs["runs"][-1]["parameter_bytes"]
    assert len(held) == 2 and all(size <= whole - experts / 2 + 64 for size in held), (held, whole, experts)
    features = open_features(store)
    offsets, ids = features.text.offsets, features.text.token_ids
    routers = [f"model.layers.{i}.mlp@router" for i in FAMILIES[kind]]
    stored = {layer: features.load(_stored(kind, layer)) for layer in [*routers, *FAMILY_MODULES]}
    codes = {router: features.codes(router) for router in routers}
    worst, compared, total = 0.0, 0, 0
    for index in range(len(offsets) - 1):
        rows = slice(int(offsets[index]), int(offsets[index + 1]))
        if rows.stop == rows.start:
            continue
        alone = _alone_with_hooks(model, ids[rows].tolist(), routers)
        for layer in FAMILY_MODULES:
            want = alone[layer].numpy()
            assert stored[layer][rows].shape == want.shape, layer
            scale = max(1.0, float(np.abs(want).max()))
            worst = max(worst, float(np.abs(stored[layer][rows] - want).max()) / scale)
        for router in routers:
            logits, weights, experts = (part.numpy() for part in alone[router])
            np.testing.assert_allclose(stored[router][rows], logits, rtol=0, atol=1e-5)
            k = experts.shape[1]
            ranked = np.sort(logits, axis=1)[:, ::-1]
            clear = ranked[:, k - 1] - ranked[:, k] > 1e-4  # no near tie at the k-th expert
            got_experts, got_weights = _by_expert(codes[router][0][rows], codes[router][1][rows])
            want_experts, want_weights = _by_expert(experts.astype(np.int32), weights)
            np.testing.assert_array_equal(got_experts[clear], want_experts[clear])
            np.testing.assert_allclose(got_weights[clear], want_weights[clear], rtol=0, atol=1e-5)
            compared, total = compared + int(clear.sum()), total + len(clear)
    assert compared > 0.9 * total
    assert worst <= 1e-5, worst


@pytest.mark.parametrize(
    "name, says",
    [("three_experts", ["has 3 experts per MoE block, which do not split over 2 ranks", "--tensor-parallel that divides 3"]),
     ("no_expert_plan", ["mixture of experts of type 'llama4_text'", "no expert-parallel plan", "qwen3_moe",
                         "drop --tensor-parallel"])],
)  # fmt: skip
def test_experts_that_cannot_be_split_are_refused_before_any_weight_loads(runs, name, says):
    result = runs["two"].result(name)
    assert result.codes == [2, 2], result.stderr[-3000:]
    line = one_line_error((runs["two"].folder / f"{name}.rank0.err").read_text())
    for words in says:
        assert words in line, line
