"""Mixture-of-experts routing per token (``BLOCK@router``), over a Mixtral and a Qwen2-MoE (shared expert,
weights not renormalized) saved from configs, on real text of very different lengths: in one process, in
2 data-parallel processes and in one tensor-parallel group of 2 (gloo).

Every token's stored router logits, top-k experts and weights are compared with transformers' own
``output_router_logits=True`` over the same tokens, each document (or packed context) run alone, the
experts and weights derived from those logits as each model's router derives them; the per-expert
statistics with a bincount of the stored experts. An expert's own output is refused in one line."""

import numpy as np
import pytest
import torch
import zarr
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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    write_jsonl(root / "docs.jsonl", real_documents(24, seed=9))
    return root, {kind: save_text_model(kind, root / kind) for kind in ("mixtral", "qwen2_moe")}


def _job(models, kind, out, *options, layers=LAYERS):
    root, saved = models
    return ["--model", f"hf:{saved[kind]}", "--layers", *layers, "--data", f"text:{root / 'docs.jsonl'}", *options,
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
        "mixtral_tp": _job(models, "mixtral", two / "mixtral_tp.zarr", *TOKENS, "--tensor-parallel", "2"),
        "qwen2_moe_tp": _job(models, "qwen2_moe", two / "qwen2_moe_tp.zarr", *PACKED, "--tensor-parallel", "2"),
    }
    first, second = Sequence(None, alone, one), Sequence(2, paired, two)
    launched = second.start()  # the two launches share the machine: one waits on its subprocess anyway
    finished = first.run(timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    _, err = launched.communicate(timeout=600)
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
     ("two", "mixtral_tp", "mixtral"), ("two", "qwen2_moe_tp", "qwen2_moe")],
)  # fmt: skip
def test_routing_equals_transformers_router_logits(models, runs, run, name, kind):
    from extract.cli.verify import main as verify

    result = runs[run].result(name)
    assert set(result.codes) == {0}, result.stderr[-3000:]
    if name.endswith("_tp"):
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


def test_each_experts_load_is_counted_per_chunk(runs):
    """stats/latents/BLOCK@router: per chunk, the tokens routed to each expert and the weight they got."""
    features = open_features(runs["one"].folder / "qwen2_moe.zarr")
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
