"""Issue 47, items 1 and 2: what decides a stored bit is part of what a store records, so that a resume
never mixes two batchings (killed, then rerun with another ``--tokens-per-batch`` or ``--batch-size``: the
rerun is refused in one line, and the recorded value then resumes to the bytes of an uninterrupted run), a
store made before its identity held its batching resumes only with the batching its own job record
names, and an edit of an SAE's metadata (``latents`` at the root, a ``latents/<layer>`` group) is named
by ``extract verify`` and refused by a rerun."""

from __future__ import annotations

import json
import signal
from dataclasses import fields
from pathlib import Path

import pytest
import zarr
from helpers.cli import TINY_JOB, one_line_error
from helpers.forked import die_on, fork_run
from helpers.stores import assert_same_bytes
from helpers.text_models import real_documents, save_text_model, write_jsonl

from extract.cli.verify import main as verify_main
from extract.job.spec import OUTSIDE_IDENTITY, JobSpec
from extract.store.store import FeatureStore

# where each option that changes the stored bits is in the identity, when it is not under its own name
IDENTITY_OF = {
    "checkpoint": "checkpoint_sha256",
    "seed": "weights",  # random init: the weights' record names the seed
    "image_size": "preprocessing",
    "sae": "sae",
    "sae_k": "sae",
    "sae_only": "sae",
    "text_key": "tokenization",
    "context_length": "tokenization",
    "pack": "tokenization",
    "batch_size": "batch_size",  # a text job's: through tokens_per_batch's default
}
# recorded only where they apply: a text store has no memory format, a store of one device no mesh
WHERE_THEY_APPLY = {"layout", "channels_last", "tokens_per_batch", "tensor_parallel", "sae", "sae_k", "sae_only"}
WHERE_THEY_APPLY |= {"text_key", "context_length", "pack"}


def _identity(out: Path) -> dict:
    return json.loads((out / "zarr.json").read_text())["attributes"]["identity"]


def _kill_after_four_chunks(args: list) -> None:
    """The job, SIGKILLed as it writes its fifth chunk: four chunks written, the rest not."""
    assert fork_run(args, before=die_on(FeatureStore, "write_chunk", 5)) == -signal.SIGKILL


def _done(out: Path) -> list[bool]:
    return zarr.open_group(out, mode="r")["done"][:].tolist()


def test_every_option_either_decides_the_bits_and_is_recorded_or_says_why_not(tmp_path, cli):
    """The audit, kept: every option of ``JobSpec`` is in a store's identity (under its name or what it
    resolves to), or ``OUTSIDE_IDENTITY`` says why it cannot change a stored bit."""
    names = {f.name for f in fields(JobSpec)}
    assert not set(OUTSIDE_IDENTITY) - names, "OUTSIDE_IDENTITY names an option that is gone"
    recorded = names - set(OUTSIDE_IDENTITY)
    out = tmp_path / "audit.zarr"
    code, _, err = cli(*TINY_JOB, "--out", out, "--channels-last", "--layout", "heads.conv=NCHW")
    assert code == 0, err
    identity = _identity(out)
    for name in sorted(recorded - WHERE_THEY_APPLY):
        assert IDENTITY_OF.get(name, name) in identity, f"--{name} changes the bits but is not recorded"
    assert identity["batch_size"] == 4 and identity["channels_last"] is True and identity["layout"]


def test_a_killed_image_job_rerun_with_another_batch_size_is_refused_then_resumes_to_the_same_bytes(
    tmp_path, cli
):
    reference = tmp_path / "reference.zarr"
    assert fork_run([*TINY_JOB, "--out", reference]) == 0
    out = tmp_path / "killed.zarr"
    _kill_after_four_chunks([*TINY_JOB, "--out", out])
    done, meta = _done(out), (out / "zarr.json").read_text()
    assert 0 < sum(done) < len(done)
    other = [*TINY_JOB]
    other[other.index("--batch-size") + 1] = "2"
    code, _, err = cli(*other, "--out", out)
    line = one_line_error(err)
    assert code == 2 and "was made with --batch-size 4, this run has 2" in line, line
    assert "resume with --batch-size 4" in line and "--overwrite" in line
    assert (out / "zarr.json").read_text() == meta and _done(out) == done, "a refused run must not touch the store"
    code, _, err = cli(*TINY_JOB, "--out", out, "--channels-last")
    line = one_line_error(err)
    assert code == 2 and "no --channels-last, this run has --channels-last" in line, line
    assert "resume without --channels-last" in line
    code, _, err = cli(*TINY_JOB, "--out", out)
    assert code == 0 and "resuming" in err, err
    assert_same_bytes(out, reference)
    code, _, err = cli(*other, "--out", out, "--overwrite")
    assert code == 0, err
    assert _identity(out)["batch_size"] == 2


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity-text")
    write_jsonl(root / "docs.jsonl", real_documents(16, seed=3))
    model = save_text_model("gpt2", root / "gpt2")
    return root, model


def _text_job(text, out: Path, *extra: object) -> list:
    root, model = text
    return [
        "--model", f"hf:{model}", "--layers", "transformer.h.1", "--data", f"text:{root / 'docs.jsonl'}",
        "--context-length", "64", "--chunk-size", "32", "--dtype", "float32", "--out", out, *extra,
    ]  # fmt: skip


def test_a_killed_text_job_rerun_with_another_tokens_per_batch_is_refused_then_resumes_to_the_same_bytes(
    text, tmp_path, cli
):
    """Issue 47's run: killed after 4 chunks, rerun with --tokens-per-batch 1000 instead of 96. The rerun
    is refused naming the recorded value and the fixes; the recorded value resumes to the bytes (features,
    statistics, digests) of the uninterrupted run. ``--batch-size`` alone sets the same default."""
    reference = tmp_path / "reference.zarr"
    assert fork_run(_text_job(text, reference, "--tokens-per-batch", "96")) == 0
    assert _identity(reference)["tokens_per_batch"] == 96
    out = tmp_path / "killed.zarr"
    _kill_after_four_chunks(_text_job(text, out, "--tokens-per-batch", "96"))
    done, meta = _done(out), (out / "zarr.json").read_text()
    assert 0 < sum(done) < len(done)
    code, _, err = cli(*_text_job(text, out, "--tokens-per-batch", "1000"))
    line = one_line_error(err)
    assert code == 2 and "was made with --tokens-per-batch 96, this run has 1000" in line, line
    assert "resume with --tokens-per-batch 96, or pass --overwrite" in line
    assert (out / "zarr.json").read_text() == meta and _done(out) == done, "a refused run must not touch the store"
    code, _, err = cli(*_text_job(text, out))  # the default, --batch-size 64 x 128 tokens, is another batching
    assert code == 2 and "this run has 8192" in one_line_error(err)
    code, _, err = cli(*_text_job(text, out, "--tokens-per-batch", "96"))
    assert code == 0 and "resuming" in err, err
    assert_same_bytes(out, reference)
    assert verify_main([str(out)]) == 0
    # the batching is the tokens per forward: --batch-size 1 sets 128 of them, as --tokens-per-batch 128 does
    made = tmp_path / "by-batch-size.zarr"
    assert fork_run(_text_job(text, made, "--batch-size", "1")) == 0
    code, _, err = cli(*_text_job(text, made, "--tokens-per-batch", "128"))
    assert code == 0 and "already complete" in err, err


def _as_before_batching(out: Path) -> None:
    """``out`` as a store made before its identity recorded the batching: the fields gone from its identity,
    its fingerprint and digests those of what is left (its ``job`` record keeps the options it was made with)."""
    from extract.store.schema import fingerprint, identity_digests

    meta = json.loads((out / "zarr.json").read_text())
    attrs = meta["attributes"]
    for key in ("batch_size", "channels_last", "tokens_per_batch"):
        attrs["identity"].pop(key, None)
    attrs["fingerprint"] = fingerprint(attrs["identity"])
    arrays = [name for name, a in zarr.open_group(out, mode="r").members(max_depth=None) if isinstance(a, zarr.Array)]
    attrs["identity_sha256"] = identity_digests(attrs, arrays)
    (out / "zarr.json").write_text(json.dumps(meta))


def test_a_store_made_before_the_batching_was_recorded_resumes_only_with_its_own(tmp_path, cli):
    reference = tmp_path / "reference.zarr"
    assert fork_run([*TINY_JOB, "--out", reference]) == 0
    out = tmp_path / "old.zarr"
    _kill_after_four_chunks([*TINY_JOB, "--out", out])
    _as_before_batching(out)
    assert verify_main([str(out)]) == 0
    other = [*TINY_JOB]
    other[other.index("--batch-size") + 1] = "3"
    code, _, err = cli(*other, "--out", out)
    assert code == 2 and "was made with --batch-size 4, this run has 3" in one_line_error(err), err
    code, _, err = cli(*TINY_JOB, "--out", out)
    assert code == 0 and "resuming" in err, err
    code, _, err = cli(*TINY_JOB, "--out", out)
    assert code == 0 and "already complete" in err, err
    assert "batch_size" not in _identity(out), "an old store keeps the identity it was made with"
    assert_same_bytes(out, reference)
