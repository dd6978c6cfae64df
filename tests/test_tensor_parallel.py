"""``--tensor-parallel`` on CPU (gloo): 4 processes as 2 groups x 2 ranks, and 2 processes as one group,
over a Llama-shaped model saved from a config and real text of very different lengths.

One 4-process launch runs the jobs (per token, --pack, pooled, the refusals), then a job whose last rank
is SIGKILLed at a random chunk; one 2-process launch (one group of the same size) runs the per-token job
again and resumes the killed store. The stored rows are compared with each document (or context) run
alone through transformers in this process, and byte for byte between runs on the same tensor-parallel
size; the interpreter's audit hooks list which rank wrote which file.

A Qwen3-MoE, its experts split over each group (transformers' expert-parallel plan), runs beside the Llama:
2 groups x 2 against each document alone, one writer per group, --sae on
its residual stream in the same job, TokenStream on its store, and the SIGTERM to the rank that does not write (its group
stops between forwards: no rank is left inside the experts' all-to-all), resumed by 1 x 2 to the bytes of 2 x 2."""

import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers import patience
from helpers.cli import one_line_error
from helpers.launches import Sequence, rank_pids
from helpers.stores import assert_same_bytes
from helpers.text_models import real_documents, save_text_model, write_jsonl

from extract import TokenStream, open_features

pytestmark = pytest.mark.slow

# the residual stream (a decoder layer, and its TransformerLens name), the attention's per-head output "z"
# (o_proj's input) and the MLP's hidden activation (down_proj's input): replicated, then sharded layers
LAYERS = ["model.layers.1", "blocks.0.hook_resid_post", "model.layers.0.self_attn.o_proj@input",
          "model.layers.0.mlp.down_proj@input"]  # fmt: skip
MODULES = {  # stored layer -> (module, its input?) as transformers names them
    "model.layers.1": ("model.layers.1", False),
    "blocks.0.hook_resid_post": ("model.layers.0", False),
    "model.layers.0.self_attn.o_proj@input": ("model.layers.0.self_attn.o_proj", True),
    "model.layers.0.mlp.down_proj@input": ("model.layers.0.mlp.down_proj", True),
}
# the Qwen3-MoE: each block's routing, the residual stream (with an SAE's codes), the MoE block's output and the
# gathered heads
MOE_LAYERS = ["model.layers.0.mlp@router", "model.layers.1.mlp@router", "model.layers.1", "model.layers.1.mlp",
              "model.layers.0.self_attn.o_proj@input"]  # fmt: skip
MOE_MODULES = {
    "model.layers.1": ("model.layers.1", False),
    "model.layers.1.mlp": ("model.layers.1.mlp", False),
    "model.layers.0.self_attn.o_proj@input": ("model.layers.0.self_attn.o_proj", True),
}
MOE_SAE_HOOK = "model.layers.1"  # the MoE's residual stream (width 32): no TransformerLens names for Qwen3-MoE
CONTEXT = 80
TOKENS = ["--context-length", str(CONTEXT), "--chunk-size", "32", "--tokens-per-batch", "96"]
PACKED = ["--pack", "40", "--chunk-size", "48", "--tokens-per-batch", "120"]


HIDDEN = "model.layers.0.mlp.down_proj@input"  # the MLP's hidden activation: sharded, gathered (width 64)
SAE_K = 8
SAE_HOOK = "blocks.0.mlp.hook_post"  # the same tensor by its TransformerLens name, as SAELens names its hook


def _save_sae(path: Path, d_in: int = 64, hook: str = SAE_HOOK) -> Path:
    """A TopK SAE of the MLP's hidden activation, saved by SAELens, with random (seeded) weights."""
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata

    sae = sae_lens.TopKSAE(sae_lens.TopKSAEConfig(d_in=d_in, d_sae=96, k=SAE_K, metadata=SAEMetadata(hook_name=hook)))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in sae.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    sae.save_model(path)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-corpus")
    documents = list(real_documents(36, seed=5))
    write_jsonl(root / "docs.jsonl", documents, label=[i % 3 for i in range(len(documents))])
    return (root, documents, save_text_model("llama", root / "llama"), save_text_model("gpt2", root / "gpt2"),
            save_text_model("qwen3_moe", root / "qwen3_moe"))  # fmt: skip


@pytest.fixture(scope="module")
def sae(tmp_path_factory):
    pytest.importorskip("sae_lens")
    folder = tmp_path_factory.mktemp("tp-sae")
    return _save_sae(folder / "sae"), _save_sae(folder / "moe_sae", d_in=32, hook=MOE_SAE_HOOK)


def job(corpus, out, *options, layers=LAYERS, tensor_parallel="2", model=2):
    root, llama = corpus[0], corpus[model]
    return [
        "--model", f"hf:{llama}", "--layers", *layers, "--data", f"text:{root / 'docs.jsonl'}", "--label-key",
        "label", "--dtype", "float32", "--tensor-parallel", tensor_parallel, *options, "--out", str(out),
    ]  # fmt: skip


def moe_job(corpus, out, sae):
    """The Qwen3-MoE's per-token job, with an SAE on its residual stream (one launch serves both)."""
    return job(corpus, out, *TOKENS, "--sae", f"{MOE_SAE_HOOK}={sae[1]}", layers=MOE_LAYERS, model=4)


@pytest.fixture(scope="module")
def launched(corpus, sae, tmp_path_factory):
    four_folder, two_folder = tmp_path_factory.mktemp("tp-four"), tmp_path_factory.mktemp("tp-two")
    killed = four_folder / "killed.zarr"
    gpt2 = corpus[3]
    jobs = {
        "tokens": job(corpus, four_folder / "tokens.zarr", *TOKENS),
        "packed": job(corpus, four_folder / "packed.zarr", *PACKED),
        "pooled": job(corpus, four_folder / "pooled.zarr", *TOKENS, "--pool", "mean"),
        "sae": job(corpus, four_folder / "sae.zarr", *PACKED, "--sae", f"{SAE_HOOK}={sae[0]}", layers=[SAE_HOOK]),
        "moe": moe_job(corpus, four_folder / "moe.zarr", sae),
        "three": job(corpus, four_folder / "three.zarr", *TOKENS, tensor_parallel="3"),
        "activation": job(corpus, four_folder / "act.zarr", *TOKENS, layers=["model.layers.0.mlp.act_fn"]),
        "no_plan": ["--model", f"hf:{gpt2}", "--layers", "transformer.h.0", "--data", f"text:{corpus[0] / 'docs.jsonl'}",
                    "--tensor-parallel", "2", "--out", four_folder / "gpt2.zarr"],
        "killed": job(corpus, killed, *TOKENS),
    }  # fmt: skip
    four = Sequence(4, jobs, four_folder, env={"EXTRACT_TEST_WRITES": str(four_folder)})
    launch = four.start()
    done_at = random.Random().randint(3, 30)  # of 60 chunks
    patience.while_running(
        lambda: (killed / "done" / "c").is_dir() and len(os.listdir(killed / "done" / "c")) >= done_at,
        f"{done_at} chunks of the job to kill",
        launch,
        quiet=400,
        pause=0.01,
    )
    os.kill(rank_pids(launch.pid, program=b"job_sequence.py")[-1], signal.SIGKILL)
    patience.communicate(launch, quiet=120)
    done_before = int(zarr.open_group(killed, mode="r")["done"][:].sum())
    termed = two_folder / "termed.zarr"  # the MoE: a group stopped while its experts are split over it
    two_jobs = {
        "one_group": job(corpus, two_folder / "tokens.zarr", *TOKENS),
        "resumed": job(corpus, killed, *TOKENS),
        "termed": moe_job(corpus, termed, sae),
    }
    two = Sequence(2, two_jobs, two_folder)
    launch = two.start()
    term_at = random.Random().randint(3, 30)
    patience.while_running(
        lambda: (termed / "done" / "c").is_dir() and len(os.listdir(termed / "done" / "c")) >= term_at,
        f"{term_at} chunks of the job to stop",
        launch,
        quiet=300,
        pause=0.01,
    )
    # the rank that does not write: the launcher, told by it, stops the group's writer too
    os.kill(_rank(launch.pid, 1), signal.SIGTERM)
    patience.communicate(launch, quiet=300)
    again = Sequence(2, {"termed_resumed": moe_job(corpus, termed, sae)}, tmp_path_factory.mktemp("tp-again"))
    finished = again.run(timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return {
        "four": four, "two": two, "again": again, "killed": killed, "done_before": done_before, "termed": termed,
    }  # fmt: skip


def _rank(launcher: int, rank: int) -> int:
    """The process of ``rank`` under the launcher (its RANK variable)."""
    for pid in rank_pids(launcher, program=b"job_sequence.py"):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no rank {rank} under {launcher}")


def alone(model_dir: Path, ids: list[int], layers: dict = MODULES) -> dict[str, np.ndarray]:
    """Each layer's rows of one document (or context) run alone through transformers, in one process."""
    model = _model(model_dir)
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for layer, (name, is_input) in layers.items():

        def keep(module, args, output=None, layer=layer, is_input=is_input):
            value = args[0] if is_input else output
            seen[layer] = (value[0] if isinstance(value, tuple) else value).detach()[0].clone()

        if is_input:
            handles.append(modules[name].register_forward_pre_hook(keep))
        else:
            handles.append(modules[name].register_forward_hook(keep))
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {layer: value.numpy() for layer, value in seen.items()}


_MODELS: dict[Path, object] = {}


def _model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    if model_dir not in _MODELS:
        _MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _MODELS[model_dir]


def largest_difference(store: Path, model_dir: Path, layers: dict = MODULES) -> float:
    """The largest |stored - alone| over every document's (or context's) rows of every layer, relative to
    the layer's largest magnitude."""
    features = open_features(store)
    offsets, ids = features.text.offsets, features.text.token_ids
    worst = 0.0
    for index in range(len(offsets) - 1):
        rows = slice(int(offsets[index]), int(offsets[index + 1]))
        if rows.stop == rows.start:
            continue
        expected = alone(model_dir, ids[rows].tolist(), layers)
        for layer in layers:
            got = features.load(layer)[rows]
            assert got.shape == expected[layer].shape, layer
            scale = max(1.0, float(np.abs(expected[layer]).max()))
            worst = max(worst, float(np.abs(got - expected[layer]).max()) / scale)
    return worst


@pytest.mark.parametrize("name", ["tokens", "packed"])
def test_two_groups_of_two_give_every_document_as_run_alone(corpus, launched, name):
    from extract.cli.verify import main as verify

    result = launched["four"].result(name)
    assert result.codes == [0, 0, 0, 0], result.stderr[-3000:]
    assert "4 processes as 2 x 2 (data x tensor parallel)" in result.stderr
    store = launched["four"].folder / f"{name}.zarr"
    group = zarr.open_group(store, mode="r")
    assert group.attrs["status"] == "complete" and group["done"][:].all()
    assert verify([str(store)]) == 0
    run = group.attrs["runs"][-1]
    assert run["world_size"] == 4 and run["mesh"] == {"data_parallel": 2, "tensor_parallel": 2}
    assert len(run["chunks_per_rank"]) == 2 and sum(run["chunks_per_rank"]) == group["done"].shape[0]
    assert group.attrs["identity"]["tensor_parallel"] == 2
    # each rank holds about half the weights: the projections and the embeddings are split, the norms are not
    whole = sum(p.nbytes for p in _model(corpus[2]).parameters())
    assert all(0.5 * whole <= size <= 0.53 * whole for size in run["parameter_bytes"]), (run["parameter_bytes"], whole)
    # float32 sums split over 2 ranks: measured at most ~1e-7 of the layer's scale (1.5e-8 absolute)
    assert largest_difference(store, corpus[2]) <= 1e-5


@pytest.mark.parametrize("name, layers", [("tokens", LAYERS), ("moe", MOE_LAYERS)])
def test_each_chunk_is_written_once_by_the_writing_rank_of_its_group(launched, name, layers):
    """Ranks 1 and 3 (tensor rank 1 of each group) write nothing to the store; every chunk object of a
    feature array was written exactly once, by rank 0 or rank 2."""
    folder = launched["four"].folder
    store = str(folder / f"{name}.zarr")
    writes = {}
    for rank in range(4):
        lines = (folder / f"writes.rank{rank}").read_text().splitlines()
        writes[rank] = [line for line in lines if line.startswith(store + "/") and ".partial" not in line]
    assert writes[1] == [] and writes[3] == []
    group = zarr.open_group(store, mode="r")
    chunks = group["done"].shape[0]
    for layer in layers:
        prefix = f"{store}/features/{layer}/c/"
        written = [line for rank in (0, 2) for line in writes[rank] if line.startswith(prefix)]
        assert len(written) == len(set(written)) == chunks, layer  # one object per chunk, each written once
    by_group = [sum(line.startswith(f"{store}/done/c/") for line in writes[rank]) for rank in (0, 2)]
    assert by_group == group.attrs["runs"][-1]["chunks_per_rank"]


def test_one_group_of_two_gives_the_bytes_of_two_groups(launched):
    result = launched["two"].result("one_group")
    assert result.codes == [0, 0], result.stderr[-3000:]
    assert "2 processes as 1 x 2 (data x tensor parallel)" in result.stderr
    assert_same_bytes(launched["two"].folder / "tokens.zarr", launched["four"].folder / "tokens.zarr")


def test_a_killed_group_resumed_gives_the_bytes_of_the_uninterrupted_run(launched):
    out = launched["killed"]
    result = launched["two"].result("resumed")
    assert result.codes == [0, 0], result.stderr[-3000:]
    assert 0 < launched["done_before"] < zarr.open_group(out, mode="r")["done"].shape[0]
    assert f"{launched['done_before']} of" in result.stderr and "resuming" in result.stderr
    assert_same_bytes(out, launched["four"].folder / "tokens.zarr")


def test_sigterm_to_the_rank_that_does_not_write_stops_its_group_and_the_rerun_gives_the_same_bytes(launched):
    """The MoE, experts split over one group of 2: stopped by SIGTERM, resumed, it gives the bytes of the
    uninterrupted 2 groups of 2."""
    termed = launched["two"].result("termed")
    assert termed.codes == [128 + signal.SIGTERM] * 2, termed.stderr[-3000:]
    assert "interrupted by SIGTERM" in termed.stderr
    group = zarr.open_group(launched["termed"], mode="r")
    assert group.attrs["runs"][0]["status"] == "interrupted"
    stopped_at = int(group["done"][:].sum())
    resumed = launched["again"].result("termed_resumed")
    assert resumed.codes == [0, 0], resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr, resumed.stderr[-3000:]
    assert stopped_at != 0
    assert_same_bytes(launched["termed"], launched["four"].folder / "moe.zarr")


def test_a_resume_with_another_tensor_parallel_size_is_refused(corpus, launched, capsys):
    from extract.cli.extract import main

    store = launched["four"].folder / "tokens.zarr"
    before = {name: member[:] for name, member in zarr.open_group(store, mode="r").members(max_depth=None)
              if isinstance(member, zarr.Array)}  # fmt: skip
    args = job(corpus, store, *TOKENS)
    args[args.index("--tensor-parallel") + 1] = "1"
    assert main(args) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "was made with --tensor-parallel 2, this run has 1" in line and "resume with --tensor-parallel 2" in line
    after = zarr.open_group(store, mode="r")
    for name, values in before.items():
        np.testing.assert_array_equal(after[name][:], values)


def test_pooled_documents_and_readers_work_on_a_tensor_parallel_store(corpus, launched):
    result = launched["four"].result("pooled")
    assert result.codes == [0, 0, 0, 0], result.stderr[-3000:]
    pooled = open_features(launched["four"].folder / "pooled.zarr")
    _, documents, llama, *_ = corpus
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama)
    for index in (0, 7, 20):
        ids = tokenizer(documents[index], truncation=True, max_length=CONTEXT)["input_ids"]
        expected = alone(llama, ids)
        for layer in LAYERS:
            got = pooled.load(layer)[index]
            np.testing.assert_allclose(got, expected[layer].mean(axis=0), rtol=0, atol=1e-5)
    tokens = open_features(launched["four"].folder / "tokens.zarr")
    layer = "model.layers.0.mlp.down_proj@input"
    stream = TokenStream(launched["four"].folder / "tokens.zarr", layer, batch_size=64, return_index=True)
    stored, seen = tokens.load(layer), []
    for rows, index in stream:
        np.testing.assert_array_equal(rows.numpy(), stored[index.numpy()])
        seen.append(index.numpy())
    assert sorted(np.concatenate(seen).tolist()) == list(range(len(stored)))


@pytest.mark.parametrize(
    "name, says",
    [
        ("three", ["--tensor-parallel 3 does not divide the 4 processes of this node"]),
        ("activation", ["layer 'model.layers.0.mlp.act_fn' differs across the ranks", "down_proj@input"]),
        ("no_plan", ["no tensor-parallel plan for model type 'gpt2'", "llama"]),
    ],
)
def test_what_cannot_be_split_is_refused_in_one_line(launched, name, says):
    result = launched["four"].result(name)
    assert result.codes == [2, 2, 2, 2], result.stderr[-3000:]
    line = one_line_error((launched["four"].folder / f"{name}.rank0.err").read_text())
    for words in says:
        assert words in line, line


def test_sae_codes_and_the_saelens_export_of_a_tensor_parallel_store(corpus, sae, launched, tmp_path):
    """--sae encodes the gathered hidden activation on the writing rank: its codes are SAELens's encode of
    the stored rows, top-k by numpy; the packed store exports to SAELens's cache with the store's rows."""
    import datasets
    from helpers.saes import top_k_codes
    from sae_lens import SAE

    from extract.cli.export import main as export_main

    result = launched["four"].result("sae")
    assert result.codes == [0, 0, 0, 0], result.stderr[-3000:]
    store = launched["four"].folder / "sae.zarr"
    group = zarr.open_group(store, mode="r")
    rows = group[f"features/{SAE_HOOK}"][:]
    np.testing.assert_array_equal(rows, open_features(launched["four"].folder / "packed.zarr").load(HIDDEN))
    with torch.no_grad():
        dense = SAE.load_from_disk(sae[0]).encode(torch.from_numpy(rows)).numpy()
    indices, values = top_k_codes(dense, SAE_K)
    np.testing.assert_array_equal(group[f"latents/{SAE_HOOK}/indices"][:], indices)
    np.testing.assert_array_equal(group[f"latents/{SAE_HOOK}/values"][:], values.astype(np.float16))

    packed = launched["four"].folder / "packed.zarr"
    assert export_main([str(packed), "--to", "saelens", str(tmp_path / "cache"), "--layer", HIDDEN]) == 0
    features = open_features(packed)
    contexts, size = features.pack["contexts"], features.pack["context_length"]
    cache = datasets.load_from_disk(str(tmp_path / "cache")).with_format("numpy")
    np.testing.assert_array_equal(cache[HIDDEN][:], features.load(HIDDEN).reshape(contexts, size, 64))
    np.testing.assert_array_equal(cache["token_ids"][:], features.text.token_ids.reshape(contexts, size))


def test_a_mixture_of_experts_split_over_two_groups_of_two_gives_every_document_as_run_alone(corpus, launched):
    """The Qwen3-MoE's experts split over each group: each rank holds half of them (the run record's parameter
    bytes), and every document's residual stream, MoE block output and gathered heads are those of the
    document run alone in one process. (One group of 2 gives the same bytes: the SIGTERM test below.)"""
    result = launched["four"].result("moe")
    assert result.codes == [0, 0, 0, 0], result.stderr[-3000:]
    assert "4 processes as 2 x 2 (data x tensor parallel)" in result.stderr
    store = launched["four"].folder / "moe.zarr"
    run = zarr.open_group(store, mode="r").attrs["runs"][-1]
    assert run["mesh"] == {"data_parallel": 2, "tensor_parallel": 2} and len(run["chunks_per_rank"]) == 2
    model = _model(corpus[4])
    whole = sum(p.nbytes for p in model.parameters())
    experts = sum(p.nbytes for name, p in model.named_parameters() if ".experts." in name)
    assert experts > 0.3 * whole  # measured 0.36: the split shows in the bytes each rank holds
    # the experts, the attention and the embeddings are halved; the norms and routers are not
    assert all(0.5 * whole <= size <= 0.51 * whole for size in run["parameter_bytes"]), (run["parameter_bytes"], whole)
    assert "parameters per rank" in result.stderr
    assert largest_difference(store, corpus[4], MOE_MODULES) <= 1e-5
    rows, stream = open_features(store).load("model.layers.1.mlp"), []
    for batch, index in TokenStream(store, "model.layers.1.mlp", batch_size=64, return_index=True):
        np.testing.assert_array_equal(batch.numpy(), rows[index.numpy()])
        stream.append(index.numpy())
    assert sorted(np.concatenate(stream).tolist()) == list(range(len(rows)))


def test_sae_codes_of_a_mixture_of_experts_split_over_its_group(sae, launched):
    """--sae on the MoE's residual stream, experts split over each group (the rows are each document run
    alone: the test above): the codes are SAELens's encode of the stored rows, top-k by numpy."""
    from helpers.saes import top_k_codes
    from sae_lens import SAE

    result = launched["four"].result("moe")
    assert result.codes == [0, 0, 0, 0], result.stderr[-3000:]
    group = zarr.open_group(launched["four"].folder / "moe.zarr", mode="r")
    rows = group[f"features/{MOE_SAE_HOOK}"][:]
    with torch.no_grad():
        dense = SAE.load_from_disk(sae[1]).encode(torch.from_numpy(rows)).numpy()
    indices, values = top_k_codes(dense, SAE_K)
    np.testing.assert_array_equal(group[f"latents/{MOE_SAE_HOOK}/indices"][:], indices)
    np.testing.assert_array_equal(group[f"latents/{MOE_SAE_HOOK}/values"][:], values.astype(np.float16))
