"""Issue 19, ``python -m extract.export STORE --to saelens DIR --layer L``: a packed token store's layer as
SAELens's activation cache. The dataset loads with ``datasets.load_from_disk`` and has the features
SAELens's ``CacheActivationsRunner`` gives its cache; its rows are the store's contexts and token ids,
written over several blocks and shards; ragged, document, pooled image and unfinished stores are refused with
one line, an existing DIR is refused and left as it was, ``--overwrite`` replaces a dataset only, an
error mid-export leaves nothing behind. Where ``sae_lens`` is importable (not in CI: it pins its own
stack), SAELens's own runner caches the same contexts for comparison, loads the export through its
``ActivationsStore`` and trains an SAE from it."""

import json
import re
import shutil
import sys

import numpy as np
import pytest
import zarr
from helpers.stores import array_store
from helpers.text_models import real_documents, save_text_model, write_jsonl

from extract import open_features
from extract.analysis import export as export_module
from extract.analysis.export import ExportError, export_saelens
from extract.cli.export import main as export_main
from extract.cli.extract import main as extract_main
from extract.errors import ExtractError, LayerNotFoundError

datasets = pytest.importorskip("datasets")

PACK = 48
LAYERS = ["transformer.h.0", "hidden_states.2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    write_jsonl(root / "docs.jsonl", real_documents(23))
    return root / "docs.jsonl", save_text_model("gpt2", root / "gpt2")


def text_job(corpus, out, *extra, chunk_size=100):
    data, model = corpus
    return [
        "--model", f"hf:{model}", "--layers", *LAYERS, "--data", f"text:{data}", "--dtype", "float32",
        "--chunk-size", str(chunk_size), "--out", str(out), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def packed(corpus, tmp_path_factory):
    """82 contexts of 48 tokens in chunks of 100 tokens: a context straddles two chunks."""
    out = tmp_path_factory.mktemp("packed") / "p.zarr"
    assert extract_main(text_job(corpus, out, "--pack", str(PACK))) == 0
    return out


@pytest.fixture(scope="module")
def exported(packed, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "cache"
    cache = export_saelens(packed, out, "transformer.h.0", hook_name="blocks.0.hook_resid_post", shard_contexts=30)
    return cache


def expected_features(hook_name: str, context_size: int, d_in: int, dtype: str):
    """SAELens 6.x (sae_lens/cache_activations_runner.py, ``CacheActivationsRunner.__init__``) builds its
    cache's features as ``{hook_name: Array2D(shape=(context_size, d_in), dtype=cfg.dtype)}`` plus
    ``features_dict["token_ids"] = Sequence(Value(dtype="int32"), length=context_size)``; hard-coded here
    from that source, not from extract's own ``saelens_features``."""
    return datasets.Features(
        {
            hook_name: datasets.Array2D(shape=(context_size, d_in), dtype=dtype),
            "token_ids": datasets.Sequence(datasets.Value(dtype="int32"), length=context_size),
        }
    )


def test_the_export_loads_with_saelenss_features_and_the_stores_rows(packed, exported):
    f = open_features(packed)
    assert exported.contexts == f.pack["contexts"] == 82 and exported.context_size == PACK and exported.d_in == 32
    assert exported.shards == 3 and exported.dtype == "float32" and exported.training_tokens == 82 * PACK
    ds = datasets.load_from_disk(str(exported.path))
    assert ds.features == expected_features("blocks.0.hook_resid_post", PACK, 32, "float32")
    assert ds.column_names == ["blocks.0.hook_resid_post", "token_ids"] and len(ds) == 82
    state = json.loads((exported.path / "state.json").read_text())
    assert [file["filename"] for file in state["_data_files"]] == [f"data-0000{i}-of-00003.arrow" for i in range(3)]
    assert state["_fingerprint"]  # as CacheActivationsRunner._consolidate_shards leaves it
    ds = ds.with_format("numpy")
    rows = f.load("transformer.h.0").reshape(82, PACK, 32)
    np.testing.assert_array_equal(ds["blocks.0.hook_resid_post"][:], rows)
    np.testing.assert_array_equal(ds["token_ids"][:], f.text.token_ids.reshape(82, PACK))
    assert str(ds.data.schema.field("token_ids").type) == f"fixed_size_list<item: int32>[{PACK}]"
    assert (ds["token_ids"][:][:, 0] == f.pack["bos"]).all()
    metadata = json.loads((exported.path / "extract_export.json").read_text())
    assert metadata["hook_name"] == "blocks.0.hook_resid_post" and metadata["layer"] == "transformer.h.0"
    assert metadata["context_size"] == PACK and metadata["d_in"] == 32 and metadata["training_tokens"] == 82 * PACK
    assert metadata["scaling_factor"] == pytest.approx(f.stats("transformer.h.0")["scaling_factor"])
    assert exported.scaling_factor == metadata["scaling_factor"]
    assert not list(exported.path.parent.glob(".*"))  # no staging directory left


def test_blocks_of_a_few_contexts_float16_and_the_default_hook_name(packed, tmp_path, monkeypatch):
    """Blocks of 5 contexts (straddling chunks and shards) and a cast: the rows are the same."""
    monkeypatch.setattr(export_module, "BLOCK_BYTES", 5 * PACK * 32 * 2)
    cache = export_saelens(packed, tmp_path / "c16", "hidden_states.2", dtype="float16", shard_contexts=12)
    assert cache.hook_name == "hidden_states.2" and cache.shards == 7 and cache.dtype == "float16"
    ds = datasets.load_from_disk(str(cache.path)).with_format("numpy")
    assert ds.features == expected_features("hidden_states.2", PACK, 32, "float16")
    f = open_features(packed)
    np.testing.assert_array_equal(
        ds["hidden_states.2"][:], f.load("hidden_states.2", dtype="float16").reshape(82, PACK, 32)
    )
    np.testing.assert_array_equal(ds["token_ids"][:], f.text.token_ids.reshape(82, PACK))


def test_memory_holds_a_block_not_the_layer(packed, tmp_path, monkeypatch):
    """Traced Python allocations (numpy's included) of an export in blocks of 5 contexts stay well
    below the layer's size (82 x 48 x 32 float32, 504 KB); a one-block export of it peaks above it."""
    import tracemalloc

    f = open_features(packed)
    layer_bytes = 82 * PACK * 32 * 4

    def peak(block_bytes: int, out: str) -> int:
        monkeypatch.setattr(export_module, "BLOCK_BYTES", block_bytes)
        tracemalloc.start()
        try:
            export_saelens(f, tmp_path / out, "transformer.h.0")
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    export_saelens(f, tmp_path / "warm", "transformer.h.0")  # imports and caches outside the trace
    whole, blocks = peak(2**30, "whole"), peak(5 * PACK * 32 * 4, "blocks")
    assert whole > layer_bytes > blocks, (whole, layer_bytes, blocks)


def test_load_token_ids_reads_a_slice(packed):
    f = open_features(packed)
    np.testing.assert_array_equal(f.text.load_token_ids(slice(90, 250)), f.text.token_ids[90:250])
    assert f.text.load_token_ids(slice(90, 250)).dtype == np.int32


@pytest.fixture(scope="module")
def ragged(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ragged") / "r.zarr"
    assert extract_main(text_job(corpus, out, "--context-length", "64")) == 0
    return out


@pytest.fixture(scope="module")
def pooled(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("pooled") / "d.zarr"
    assert extract_main(text_job(corpus, out, "--context-length", "64", "--pool", "mean", chunk_size=8)) == 0
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    rng = np.random.default_rng(0)
    layers = {"layer4": rng.normal(size=(20, 8)).astype(np.float32)}
    return array_store(tmp_path_factory.mktemp("images") / "i.zarr", layers, rng.integers(0, 2, 20), chunk_size=8)


def run(capsys, *args) -> tuple[int, str, str]:
    code = export_main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_command_prints_one_line_and_exits_0(packed, tmp_path, capsys):
    code, out, err = run(capsys, packed, "--to", "saelens", tmp_path / "cache", "--layer", "transformer.h.0")
    assert code == 0, err
    assert out.count("\n") == 1 and "exported 82 contexts x 48 tokens of transformer.h.0 (d_in 32, float32)" in out
    assert "scaling_factor" in out and (tmp_path / "cache" / "state.json").is_file()


@pytest.mark.parametrize(
    "store, message",
    [
        ("ragged", "holds ragged documents.*re-extract with --pack T"),
        ("pooled", "is a document \\(pooled per document\\) store.*--pack T"),
        (
            "images",
            r"layer 'layer4' of the image store .* is pooled, one \(8,\) row per image; SAELens's contexts "
            "are an image's patches: extract the layer with --pool none",
        ),
    ],
)
def test_stores_without_contexts_are_refused_with_one_line(store, message, request, tmp_path, capsys):
    path = request.getfixturevalue(store)
    capsys.readouterr()  # what making the store printed
    layer = "layer4" if store == "images" else "transformer.h.0"
    code, out, err = run(capsys, path, "--to", "saelens", tmp_path / "cache", "--layer", layer)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("extract.export: error: ") and re.search(message, err), err
    assert not (tmp_path / "cache").exists() and not list(tmp_path.glob(".*"))


def test_an_unfinished_store_is_refused(packed, tmp_path, capsys):
    partial = tmp_path / "partial.zarr"
    shutil.copytree(packed, partial)
    zarr.open_group(partial, mode="r+").attrs["status"] = "running"
    code, _, err = run(capsys, partial, "--to", "saelens", tmp_path / "cache", "--layer", "transformer.h.0")
    assert code == 2 and err.count("\n") == 1 and "is not complete (status 'running')" in err
    assert "rerun the same extract command" in err and not (tmp_path / "cache").exists()


def test_an_existing_dir_is_refused_and_left_untouched(packed, exported, tmp_path, capsys):
    before = {p.name: p.read_bytes() for p in exported.path.iterdir()}
    code, _, err = run(capsys, packed, "--to", "saelens", exported.path, "--layer", "hidden_states.2")
    assert code == 2 and "exists: pass --overwrite" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in exported.path.iterdir()} == before
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    code, _, err = run(capsys, packed, "--to", "saelens", other, "--layer", "hidden_states.2", "--overwrite")
    assert code == 2 and "is not a dataset saved by datasets" in err and (other / "mine.txt").read_text() == "keep"


def test_overwrite_replaces_a_dataset_once_the_new_one_is_complete(packed, tmp_path, capsys):
    out = tmp_path / "cache"
    export_saelens(packed, out, "transformer.h.0")
    code, _, err = run(capsys, packed, "--to", "saelens", out, "--layer", "hidden_states.2", "--overwrite")
    assert code == 0, err
    assert datasets.load_from_disk(str(out)).column_names == ["hidden_states.2", "token_ids"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # the old one is gone, nothing aside


def test_an_error_mid_export_leaves_the_old_dataset_and_no_debris(packed, tmp_path, monkeypatch):
    out = tmp_path / "cache"
    export_saelens(packed, out, "transformer.h.0")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "_write_dataset_files", fail)
    with pytest.raises(ExportError, match=r"writing the dataset failed \(No space left on device\); nothing was"):
        export_saelens(packed, out, "hidden_states.2", overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "_write_dataset_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_saelens(packed, out, "hidden_states.2", overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_bad_arguments_are_one_line_and_status_2(packed, tmp_path, capsys):
    cases = [
        (["--to", "sparsify", tmp_path / "c", "--layer", "transformer.h.0"], "--to sparsify: the formats are saelens"),
        (["--to", "saelens", tmp_path / "c", "--layer", "transformer.h.9"], "has no layer 'transformer.h.9'"),
        (["--to", "saelens", tmp_path / "c", "--layer", "transformer.h.0", "--dtype", "bfloat16"], "invalid choice"),
        (["--to", "saelens", tmp_path / "c", "--layer", "transformer.h.0", "--hook-name", "token_ids"], "token_ids"),
        (["--to", "saelens", tmp_path / "c", "--layer", "transformer.h.0", "--shard-contexts", "0"], "at least 1"),
        (["--to", "saelens", packed / "inside", "--layer", "transformer.h.0"], "inside it"),
        (["--layer", "transformer.h.0"], "required: --to"),
    ]
    for extra, message in cases:
        code, out, err = run(capsys, packed, *extra)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, (extra, err)
    code, _, err = run(capsys, tmp_path / "none.zarr", "--to", "saelens", tmp_path / "c", "--layer", "x")
    assert code == 2 and err.count("\n") == 1 and "none.zarr" in err
    assert not (tmp_path / "c").exists()
    with pytest.raises(LayerNotFoundError):
        export_saelens(packed, tmp_path / "c", "nope")
    with pytest.raises(ExportError, match="float16 or float32"):
        export_saelens(packed, tmp_path / "c", "transformer.h.0", dtype="int8")


def test_without_datasets_the_error_names_the_extra(packed, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # ``import datasets`` raises ImportError
    with pytest.raises(ExtractError, match=r"pip install 'extract\[datasets\]'"):
        export_saelens(packed, tmp_path / "c", "transformer.h.0")
    code, _, err = run(capsys, packed, "--to", "saelens", tmp_path / "c", "--layer", "transformer.h.0")
    assert code == 2 and err.count("\n") == 1 and "extract[datasets]" in err


# --- SAELens itself (skipped where sae_lens is not installed, as in CI) -----------------------------


@pytest.fixture(scope="module")
def sae_lens():
    return pytest.importorskip("sae_lens")


def test_saelens_caches_the_same_contexts_to_the_same_dataset(sae_lens, corpus, packed, exported, tmp_path):
    """SAELens's own ``CacheActivationsRunner`` on the same model (a local directory, hook names = module
    names) and the store's contexts: the same features, token ids and activations as the export."""
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

    f = open_features(packed)
    contexts = datasets.Dataset.from_dict({"input_ids": f.text.token_ids.reshape(82, PACK).astype(np.int64)})
    tokens = 82 * PACK
    config = CacheActivationsRunnerConfig(
        dataset_path=str(tmp_path / "unused"), model_name=str(corpus[1]), model_class_name="AutoModelForCausalLM",
        model_batch_size=41, hook_name="transformer.h.0", d_in=32, training_tokens=tokens, context_size=PACK,
        new_cached_activations_path=str(tmp_path / "sae-cache"), shuffle=False, dtype="float32", device="cpu",
        buffer_size_gb=(tokens * 32 * 4 + 16) / 1e9, prepend_bos=False,
    )  # fmt: skip
    theirs = CacheActivationsRunner(config, override_dataset=contexts).run()
    ours = export_saelens(packed, tmp_path / "ours", "transformer.h.0")
    mine = datasets.load_from_disk(str(ours.path))
    assert mine.features == theirs.features and mine.column_names == theirs.column_names
    theirs, mine = theirs.with_format("numpy"), mine.with_format("numpy")
    np.testing.assert_array_equal(mine["token_ids"][:], theirs["token_ids"][:])
    np.testing.assert_allclose(mine["transformer.h.0"][:], theirs["transformer.h.0"][:], rtol=1e-4, atol=1e-5)


def test_saelens_loads_and_trains_from_the_export(sae_lens, corpus, exported, tmp_path):
    """``LanguageModelSAERunnerConfig(use_cached_activations=True)``: SAELens's ``ActivationsStore`` loads
    and checks the export (column = hook name, shape (context_size, d_in)) and its runner trains on it;
    then its ``SAETrainer`` with extract's scaling factor preset."""
    import torch
    from sae_lens import (
        LanguageModelSAERunnerConfig,
        LanguageModelSAETrainingRunner,
        LoggingConfig,
        StandardTrainingSAE,
        StandardTrainingSAEConfig,
    )
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.activations_store import ActivationsStore
    from sae_lens.training.sae_trainer import SAETrainer

    # the runner, with the model named as a local directory; the dataset only satisfies from_config
    _, model = corpus
    meta = json.loads((exported.path / "extract_export.json").read_text())
    # SAELens's hook name must be a module of the model: export transformer.h.0 under its own name
    cache = export_saelens(meta["store"], tmp_path / "cache", "transformer.h.0")
    config = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=32, d_sae=64, normalize_activations="expected_average_only_in"),
        model_name=str(model), model_class_name="AutoModelForCausalLM", hook_name="transformer.h.0",
        context_size=PACK, use_cached_activations=True, cached_activations_path=str(cache.path),
        training_tokens=1024, train_batch_size_tokens=128, store_batch_size_prompts=4, n_batches_in_buffer=4,
        n_batches_for_norm_estimate=4, logger=LoggingConfig(log_to_wandb=False), device="cpu",
        output_path=str(tmp_path / "sae"), checkpoint_path=None,
    )  # fmt: skip
    tokens = datasets.load_from_disk(str(cache.path)).select_columns(["token_ids"]).rename_column("token_ids", "tokens")
    runner = LanguageModelSAETrainingRunner(config, override_dataset=tokens)
    assert runner.activations_store.cached_activation_dataset is not None
    sae = runner.run()
    assert tuple(sae.W_enc.shape) == (32, 64) and (tmp_path / "sae" / "cfg.json").is_file()

    # the trainer, on the cached store alone (no model, no dataset), with extract's scaling factor
    store = ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name="blocks.0.hook_resid_post", hook_head_index=None,
        context_size=PACK, d_in=32, n_batches_in_buffer=4, total_training_tokens=exported.training_tokens,
        store_batch_size_prompts=4, train_batch_size_tokens=128, prepend_bos=False,
        normalize_activations="expected_average_only_in", device=torch.device("cpu"), dtype="float32",
        cached_activations_path=str(exported.path),
    )  # fmt: skip
    sae = StandardTrainingSAE(
        StandardTrainingSAEConfig(d_in=32, d_sae=64, normalize_activations="expected_average_only_in")
    )
    trainer_config = SAETrainerConfig(
        total_training_samples=1024, train_batch_size_samples=128, lr_end=3e-5, logger=LoggingConfig(log_to_wandb=False)
    )
    trainer = SAETrainer(cfg=trainer_config, sae=sae, data_provider=store)
    trainer.activation_scaler.scaling_factor = exported.scaling_factor
    before = sae.W_enc.detach().clone()
    batch = next(store)
    assert batch.shape == (128, 32) and float((batch * exported.scaling_factor).norm(dim=-1).mean()) == pytest.approx(
        32**0.5, rel=0.2
    )
    trainer.fit()
    assert trainer.n_training_steps == 8 and not torch.equal(before, sae.W_enc.detach())
