"""Issue 47, items 3 and 4: inputs that ended in a traceback, or in a message that sent the user the wrong
way, are one line naming the culprit and the fix, exit status 2, with nothing created or damaged: a
damaged weights file, ``extract top --out`` naming a file, a corrupt ``config.json``, a TransformerLens
name on a model whose forward fails, a lock path that is a directory, and a reader of a store whose job
is still writing it."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.cli import SMALL, one_line_error, run_cli
from helpers.stores import array_store
from helpers.text_models import gpt2_tokenizer, real_documents, save_text_model, write_jsonl

from extract.errors import StoreBusyError
from extract.store.lock import StoreLock, lock_path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A tiny GPT-2 saved as ``save_pretrained`` writes it, and a few documents, made once."""
    root = tmp_path_factory.mktemp("messages")
    save_text_model("gpt2", root / "gpt2")
    write_jsonl(root / "docs.jsonl", real_documents(6))
    return root


def _text_job(cli, corpus: Path, model: Path, out: Path, layer: str = "transformer.h.1") -> tuple[int, str]:
    code, _, err = cli("--model", f"hf:{model}", "--layers", layer, "--data", f"text:{corpus / 'docs.jsonl'}",
                       "--context-length", "32", "--out", out)  # fmt: skip
    return code, err


def _nothing_but(folder: Path, *names: str) -> None:
    """No store, no lock, no scratch left beside the model: only ``names`` are in ``folder``."""
    assert sorted(os.listdir(folder)) == sorted(names)


@pytest.mark.parametrize("damage", ["truncated", "random", "random pytorch_model.bin"])
def test_a_damaged_weights_file_is_one_line_naming_it(cli, corpus, tmp_path, damage):
    """transformers raised safetensors' (or torch.load's) own exception: a traceback, exit status 1, that
    named no file (and for a .bin advised loading it with ``weights_only=False``)."""
    model = shutil.copytree(corpus / "gpt2", tmp_path / "model")
    weights = model / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "random":
        weights.write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        weights.unlink()
        weights = model / "pytorch_model.bin"
        weights.write_bytes(np.random.default_rng(0).bytes(4096))
    before = weights.read_bytes()
    code, err = _text_job(cli, corpus, model, tmp_path / "out.zarr")
    assert code == 2, err
    line = one_line_error(err)
    assert f"{weights.name} cannot be read" in line and "truncated or damaged" in line, line
    assert "save_pretrained" in line and "weights_only" not in line, line
    assert weights.read_bytes() == before
    _nothing_but(tmp_path, "model")


def test_a_damaged_weights_file_in_the_hugging_face_cache_is_one_line(corpus, tmp_path):
    """The same for a hub id read from the cache (a download cut short): the fix is to remove it there."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = shutil.copytree(corpus / "gpt2", repo / "snapshots" / revision)
    weights = snapshot / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    finished = run_cli("--model", "hf:acme/tiny", "--layers", "transformer.h.1", "--data",
                       f"text:{corpus / 'docs.jsonl'}", "--out", tmp_path / "out.zarr",
                       env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert finished.returncode == 2, finished.stderr[-3000:]
    line = one_line_error(finished.stderr)
    assert "its weights in the Hugging Face cache cannot be read (SafetensorError" in line, line
    assert "hf cache rm model/acme/tiny" in line, line
    _nothing_but(tmp_path, "hub")


@pytest.mark.parametrize("content", [b'{"model_type": "gpt2", ', b"\xff\xfe{}", b"[1, 2]"])
def test_a_corrupt_config_json_of_a_text_model_is_named(cli, corpus, tmp_path, content):
    """It was read as "not a text model", so the vision loaders asked for a preprocessor_config.json."""
    model = shutil.copytree(corpus / "gpt2", tmp_path / "model")
    (model / "config.json").write_bytes(content)
    code, err = _text_job(cli, corpus, model, tmp_path / "out.zarr")
    assert code == 2, err
    line = one_line_error(err)
    assert "its config.json" in line and "preprocessor_config" not in line and "save_pretrained" in line, line
    why = {b"{": "not valid JSON", b"\xff": "not UTF-8 text", b"[": "a JSON list, not an object"}[content[:1]]
    assert why in line, line
    _nothing_but(tmp_path, "model")


def test_a_lens_name_on_a_model_whose_forward_fails_gives_that_failure(cli, corpus, tmp_path):
    """A GPT-2 whose embedding is smaller than its tokenizer fails in its forward. Its module name said
    so; a TransformerLens name (found by a forward) said "matches no module", and that --model hf:
    gives those names for gpt2, which this model is."""
    import transformers as tf

    tokenizer = gpt2_tokenizer()
    config = tf.GPT2Config(vocab_size=3, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                           eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = tmp_path / "model"
    tf.GPT2LMHeadModel(config).save_pretrained(model)
    tokenizer.save_pretrained(model)
    lines = {}
    for layer in ("transformer.h.1", "blocks.1.hook_resid_post", "hidden_states.1"):
        code, err = _text_job(cli, corpus, model, tmp_path / "out.zarr", layer)
        assert code == 2, err
        lines[layer] = one_line_error(err)
    cause = "the model fails on input_ids (B, 8) (IndexError: index out of range in self)"
    assert cause in lines["transformer.h.1"]
    for layer in ("blocks.1.hook_resid_post", "hidden_states.1"):
        assert f"layer '{layer}' is found by running the model once, and {cause}" in lines[layer], lines[layer]
        assert "matches no module" not in lines[layer]
    _nothing_but(tmp_path, "model")


def test_a_lock_path_that_is_a_directory_says_so(cli, tmp_path):
    """It was read as no lock, "taken over" and found again: "could not take the lock from a stale holder;
    rerun", and a rerun said the same, forever."""
    out = tmp_path / "out.zarr"
    lock_path(out).mkdir()
    (lock_path(out) / "mine.txt").write_text("a user's file")
    code, _, err = cli(*SMALL, "--data", "synthetic:8", "--out", out)
    assert code == 2, err
    line = one_line_error(err)
    assert f"its lock path {lock_path(out)} is a directory, not a lock file" in line, line
    assert "move it away" in line and "stale" not in line, line
    assert (lock_path(out) / "mine.txt").read_text() == "a user's file"
    _nothing_but(tmp_path, lock_path(out).name)


def test_a_reader_of_a_store_its_job_is_finishing_is_told_the_job_holds_it(tmp_path):
    """All chunks written, the status not yet "complete", the job's lock live: the reader was told to
    rerun the extract command (which a live job would refuse), where a moment earlier, while the store
    was being created, it was told the job's host and pid. With no live holder it still says rerun."""
    from extract import open_features
    from extract.store.store import FeatureStore

    out = array_store(tmp_path / "s.zarr", {"x": np.ones((8, 2), np.float32)}, np.zeros(8, np.int64), 4)
    FeatureStore.open(out, mode="r+").update_attrs(status="running")
    with StoreLock(out):
        with pytest.raises(StoreBusyError) as busy:
            open_features(out)
        message = str(busy.value)
        assert f"is being written by a job (host {socket.gethostname()}, pid {os.getpid()}" in message, message
        assert str(lock_path(out)) in message and "2 of 2 chunks written" in message, message
        assert "wait for the job to finish" in message and "rerun" not in message and "\n" not in message
        assert open_features(out, allow_partial=True).num_samples == 8
    with pytest.raises(Exception, match="rerun the same extract command") as gone:
        open_features(out)
    assert not isinstance(gone.value, StoreBusyError)


def test_top_out_naming_a_file_is_refused_and_the_file_kept(cli, corpus, tmp_path, capsys):
    """``mkdir`` on the file raised FileExistsError after the codes were ranked: a traceback, exit 1."""
    pytest.importorskip("sae_lens")
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata

    from extract.cli.top import main as top_main

    hook = "blocks.1.hook_resid_post"
    sae = sae_lens.TopKSAE(sae_lens.TopKSAEConfig(d_in=32, d_sae=16, k=4, metadata=SAEMetadata(hook_name=hook)))
    with torch.no_grad():
        for parameter in sae.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    sae.save_model(tmp_path / "sae")
    store = tmp_path / "store.zarr"
    code, _, err = cli("--model", f"hf:{corpus / 'gpt2'}", "--layers", hook, "--data", f"text:{corpus / 'docs.jsonl'}",
                       "--context-length", "32", "--dtype", "float32", "--sae", f"{hook}={tmp_path / 'sae'}",
                       "--out", store)  # fmt: skip
    assert code == 0, err
    taken = tmp_path / "notes.txt"
    taken.write_text("keep me")
    for out, culprit in ((taken, taken), (taken / "top", taken)):
        code = top_main([str(store), "--layer", hook, "--out", str(out)])
        assert code == 2
        err = capsys.readouterr().err
        assert err.startswith("extract.top: error: ") and err.count("\n") == 1, err
        line = err
        assert f"--out {out}" in line and f"{culprit} is a file, not a directory" in line, line
        assert taken.read_text() == "keep me"
    assert top_main([str(store), "--layer", hook, "--out", str(tmp_path / "top")]) == 0
    assert (tmp_path / "top" / "top.parquet").is_file()


def test_a_tensor_parallel_refusal_from_the_config_is_the_first_line_of_the_launch(corpus, tmp_path):
    """2 ranks under accelerate launch: what the model's config refuses (gpt2 has no plan) is the first
    line the launch prints, before the data is read (a missing file here) or anything else is said. It
    came after the data, the tokenizer and the config; here the missing data was said instead."""
    from helpers.launches import launcher

    out = tmp_path / "tp.zarr"
    finished = run_cli("--model", f"hf:{corpus / 'gpt2'}", "--layers", "transformer.h.0", "--data",
                       f"text:{tmp_path / 'missing.jsonl'}", "--tensor-parallel", "2", "--out", out,
                       launcher=launcher(2, "--quiet"))  # fmt: skip
    err = finished.stderr
    assert finished.returncode == 1 and "exitcode  : 2" in err, err[-3000:]  # torch elastic's 1: see docs
    line = one_line_error(err)
    assert err.startswith(line), err[-3000:]  # the first line a user sees
    assert "no tensor-parallel plan for model type 'gpt2'" in line and "missing.jsonl" not in err, err[-3000:]
    _nothing_but(tmp_path)
