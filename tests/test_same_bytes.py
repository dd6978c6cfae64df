"""The same job gives the same bytes whatever happens (issue 28): 1, 2 and 3 processes, a SIGKILL then a
rerun with another process count, a repaired chunk, and every kind of damage to a text store, each
compared array by array, bit for bit, with one uninterrupted run in one process.

The launches of 2 and 3 processes also run the token jobs of test_tokens.py (its corpus and three tiny
models: tests/helpers/text_jobs.py), checked against one process with other batches and against the
tokenizer's own packing: a launch costs more than its small jobs.

The documents have very different lengths and the token budget is small, so a chunk takes many padded
batches: were a document's batch to depend on the ranks or on which chunks are pending, its padded
length would change the matmuls' rounding, and float32 storage would show it."""

import os
import random
import shutil
import signal
import uuid

import numpy as np
import pytest
import zarr
from helpers import patience
from helpers.launches import Sequence, rank_pids
from helpers.s3 import s3_server_or_none
from helpers.stores import assert_same_bytes
from helpers.text_jobs import HIDDEN, PACK, close, packed_by_hand, packed_job, token_corpus, token_job
from helpers.text_models import real_documents, save_text_model, write_jsonl

from extract import open_features
from extract.store.location import open_store

RAGGED = ["--context-length", "80", "--chunk-size", "32", "--tokens-per-batch", "96", "--dtype", "float32"]
PACKED = ["--pack", "40", "--chunk-size", "48", "--tokens-per-batch", "120", "--dtype", "float32"]

pytestmark = pytest.mark.slow  # every test here launches 1, 2 and 3 processes


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("same-bytes")
    documents = [*real_documents(36, seed=3), "", "x"]  # an empty document, and one of a single token
    write_jsonl(root / "docs.jsonl", documents, label=[i % 4 for i in range(len(documents))])
    return root, save_text_model("gpt2", root / "gpt2")


def _text_job(corpus, out, *options):
    root, model = corpus
    return [
        "--model", f"hf:{model}", "--layers", "transformer.h.0", "hidden_states.2", "--data",
        f"text:{root / 'docs.jsonl'}", "--label-key", "label", *options, "--out", str(out),
    ]  # fmt: skip


def _image_job(out):
    return [
        "--model", "resnet18", "--weights", "none", "--layers", "layer2", "--pool", "avg", "--data", "synthetic:90",
        "--image-size", "40", "--chunk-size", "16", "--batch-size", "12", "--dtype", "float32", "--out", str(out),
    ]  # fmt: skip


def _jobs(corpus, folder):
    return {
        "ragged": _text_job(corpus, folder / "ragged.zarr", *RAGGED),
        "packed": _text_job(corpus, folder / "packed.zarr", *PACKED),
        "pooled": _text_job(corpus, folder / "pooled.zarr", *RAGGED, "--pool", "mean"),
        "images": _image_job(folder / "images.zarr"),
    }


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    """One uninterrupted run of each job in one process, this one (a process of its own would cost a
    start-up; the repairs below run here too): the bytes every other run must give."""
    from extract.cli.extract import main

    folder = tmp_path_factory.mktemp("one")
    for name, job in _jobs(corpus, folder).items():
        assert main(job) == 0, name  # its error is in the captured stderr
    return folder


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """The corpus of test_tokens.py and its GPT-2, Llama and BERT, for the token jobs of the launches."""
    return token_corpus(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="module")
def gpt2_reference(tokens, tmp_path_factory):
    """The GPT-2 token job in one process (this one), with the default batches."""
    from extract.cli.extract import main

    out = tmp_path_factory.mktemp("ref") / "ref.zarr"
    assert main(token_job(tokens, "gpt2", out)) == 0
    return out


WHOLE = ["--chunk-size", "64", "--tokens-per-batch", "256"]  # other chunks and batches than the reference's


def _token_jobs(tokens, folder, kind):
    """The token jobs of a launch: GPT-2 per token, and ``kind`` packed."""
    return {
        "tokens": token_job(tokens, "gpt2", folder / "tokens.zarr", *WHOLE),
        "token-packed": packed_job(tokens, kind, folder / "token-packed.zarr", "--chunk-size", "100"),
    }


@pytest.fixture(scope="module")
def launched(corpus, tokens, references, tmp_path_factory, request):
    """2 ranks run every job (the ragged one on S3 too) and the token jobs (GPT-2 packed), then a ragged
    job whose last rank is SIGKILLed at a random point; 3 ranks run every job and the token jobs (Llama
    packed), then resume the killed one."""
    two_folder, three_folder = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("three")
    killed = two_folder / "killed.zarr"
    server = s3_server_or_none(request)
    on_s3 = f"s3://{server.bucket}/same-{uuid.uuid4().hex[:8]}/ragged.zarr" if server else None
    jobs = {
        **_jobs(corpus, two_folder),
        **({"s3": _text_job(corpus, on_s3, *RAGGED)} if on_s3 else {}),
        **_token_jobs(tokens, two_folder, "gpt2"),
        "killed": _text_job(corpus, killed, *RAGGED),
    }
    two = Sequence(2, jobs, two_folder, env=server.env() if server else None)
    job = two.start()
    done_at = random.Random().randint(3, 25)  # of about 45 chunks
    patience.while_running(
        lambda: (killed / "done" / "c").is_dir() and len(os.listdir(killed / "done" / "c")) >= done_at,
        f"{done_at} chunks of the job to kill",
        job,
        quiet=300,
        pause=0.01,
    )
    os.kill(rank_pids(job.pid, program=b"job_sequence.py")[-1], signal.SIGKILL)
    patience.communicate(job, quiet=120)
    done_before = int(open_features(killed, allow_partial=True).store.done_flags().sum())
    three = Sequence(
        3,
        {**_jobs(corpus, three_folder), **_token_jobs(tokens, three_folder, "llama"),
         "resumed": _text_job(corpus, killed, *RAGGED)},
        three_folder,
    )  # fmt: skip
    finished = three.run(timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return {
        "two": two, "three": three, "killed": killed, "done_before": done_before, "s3": on_s3,
        "env": server.env() if server else {},
    }  # fmt: skip


@pytest.mark.parametrize("name", ["ragged", "packed", "pooled", "images"])
@pytest.mark.parametrize("processes", [2, 3])
def test_two_and_three_processes_give_the_bytes_of_one(launched, references, name, processes):
    sequence = launched["two" if processes == 2 else "three"]
    result = sequence.result(name)
    assert result.codes == [0] * processes, result.stderr[-3000:]
    assert_same_bytes(sequence.folder / f"{name}.zarr", references / f"{name}.zarr")


def test_a_killed_run_resumed_by_another_process_count_gives_the_bytes_of_one_and_verify_catches_tampering(
    corpus, launched, references
):
    """Resumed by 3 ranks, the store a SIGKILL left gives the bytes of one process; then two of its
    objects are tampered with: verify finds them, --repair clears them, the job's command redoes them."""
    from extract.cli.extract import main
    from extract.cli.verify import main as verify

    out, reference = launched["killed"], open_features(references / "ragged.zarr")
    result = launched["three"].result("resumed")
    assert result.codes == [0, 0, 0], result.stderr[-3000:]
    assert "resuming" in result.stderr
    assert_same_bytes(out, references / "ragged.zarr")
    resumed = open_features(out)
    assert 0 < launched["done_before"] < resumed.num_chunks
    assert [run["world_size"] for run in resumed.attrs["runs"]] == [2, 3]
    assert (resumed.text.token_ids == reference.text.token_ids).all()
    for layer in reference.layers:
        assert close(resumed.load(layer), reference.load(layer)), layer

    for chunk in (out / "features" / "transformer.h.0" / "c" / "3" / "0", out / "token_ids" / "c" / "5"):
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        chunk.write_bytes(bytes(raw))
    assert verify([str(out)]) == 1
    assert verify([str(out), "--repair"]) == 1  # the damaged chunks are cleared: the job's command redoes them
    assert main(_text_job(corpus, out, *RAGGED)) == 0
    assert verify([str(out)]) == 0
    repaired = open_features(out)
    assert (repaired.text.token_ids == reference.text.token_ids).all()
    for layer in reference.layers:
        assert close(repaired.load(layer), reference.load(layer)), layer
    assert_same_bytes(out, references / "ragged.zarr")


def test_a_job_on_s3_gives_the_bytes_of_one_on_disk(launched, references, monkeypatch):
    """Issue 20: the store 2 ranks wrote to S3 holds, byte for byte, what the same job wrote to disk by 2
    ranks and by one: features, token ids, special, offsets, labels, keys and done (every array, by listing)."""
    if launched["s3"] is None:
        pytest.skip("the S3 tests need moto[server] and obstore (pip install 'extract[test]')")
    for variable, value in launched["env"].items():
        monkeypatch.setenv(variable, value)
    result = launched["two"].result("s3")
    assert result.codes == [0, 0], result.stderr[-3000:]
    assert_same_bytes(open_store(launched["s3"], read_only=True), references / "ragged.zarr")

    local = zarr.open_group(launched["two"].folder / "ragged.zarr", mode="r")
    remote = zarr.open_group(open_store(launched["s3"], read_only=True), mode="r")
    arrays = sorted(name for name, member in local.members(max_depth=None) if isinstance(member, zarr.Array))
    assert arrays == sorted(name for name, m in remote.members(max_depth=None) if isinstance(m, zarr.Array))
    assert {"token_ids", "special", "offsets", "labels", "keys", "done", "features/transformer.h.0"} <= set(arrays)
    for name in arrays:
        np.testing.assert_array_equal(remote[name][:], local[name][:], err_msg=name)
    assert remote.attrs["status"] == "complete" and remote.attrs["fingerprint"] == local.attrs["fingerprint"]
    assert remote.attrs["runs"][-1]["world_size"] == 2


# ---------------------------------------------------------------- the token jobs of test_tokens.py


def test_two_and_three_processes_equal_one(launched, gpt2_reference):
    reference = open_features(gpt2_reference)
    for processes, sequence in ((2, launched["two"]), (3, launched["three"])):
        result = sequence.result("tokens")
        assert result.codes == [0] * processes, result.stderr[-3000:]
        f = open_features(sequence.folder / "tokens.zarr")
        assert f.store.done_flags().all() and f.attrs["runs"][-1]["world_size"] == processes
        assert (f.text.token_ids == reference.text.token_ids).all() and (f.keys == reference.keys).all()
        for layer in reference.layers:
            values = f.load(layer)
            assert not np.isnan(values).any() and close(values, reference.load(layer)), (processes, layer)


@pytest.mark.parametrize("processes, kind", [(2, "gpt2"), (3, "llama")])
def test_packed_contexts_equal_the_tokenizers_concatenation_each_run_alone(tokens, launched, processes, kind):
    import torch
    import transformers as tf

    _, documents, _, models = tokens
    sequence = launched["two" if processes == 2 else "three"]
    result = sequence.result("token-packed")
    assert result.codes == [0] * processes, result.stderr[-3000:]
    assert "contexts of 48 tokens" in result.stderr and "were dropped" in result.stderr, result.stderr[-3000:]
    f = open_features(sequence.folder / "token-packed.zarr")
    contexts, doc, position, tail = packed_by_hand(models[kind], documents, separator_is_bos=kind == "llama")
    assert f.kind == "tokens" and f.text.num_documents == len(contexts) and (np.diff(f.text.offsets) == PACK).all()
    assert f.pack["contexts"] == len(contexts) and f.pack["dropped_tokens"] == tail
    assert f.pack["source_documents"] == len(documents)
    assert f.text.token_ids.tolist() == contexts.reshape(-1).tolist()
    assert (f.text.doc == doc.reshape(-1)).all() and (f.text.doc_position == position.reshape(-1)).all()
    assert (f.text.special == (doc.reshape(-1) < 0)).all()  # the docstrings hold no special token of their own
    assert f.keys.tolist() == [f"docs.jsonl/{i}" for i in range(len(documents))]
    assert f.text.token_positions.tolist() == np.tile(np.arange(PACK), len(contexts)).tolist()
    model = tf.AutoModelForCausalLM.from_pretrained(models[kind]).eval()
    with torch.inference_mode():
        out = model(input_ids=torch.from_numpy(contexts), output_hidden_states=True)
    for layer, number in HIDDEN[kind].items():
        assert close(f.load(layer), out.hidden_states[number].reshape(-1, out.hidden_states[0].shape[-1]).numpy()), (
            layer
        )


def test_a_damaged_packed_store_is_repaired_and_resumed_to_the_same_contexts(tokens, launched, tmp_path):
    from extract.cli.extract import main
    from extract.cli.verify import main as verify

    original = launched["two"].folder / "token-packed.zarr"
    store = tmp_path / "packed.zarr"
    shutil.copytree(original, store)
    for chunk in (
        store / "token_ids" / "c" / "2",
        store / "doc" / "c" / "4",
        store / "features" / "transformer.h.0" / "c" / "1" / "0",
    ):
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        chunk.write_bytes(bytes(raw))
    (store / "doc_position" / "c" / "3").unlink()
    assert verify([str(store), "--repair"]) == 1
    assert main(packed_job(tokens, "gpt2", store, "--chunk-size", "100")) == 0
    assert verify([str(store)]) == 0
    repaired, reference = open_features(store), open_features(original)
    for name in ("token_ids", "special", "doc", "doc_position"):
        assert (getattr(repaired.text, name) == getattr(reference.text, name)).all(), name
    for layer in reference.layers:
        assert close(repaired.load(layer), reference.load(layer)), layer


def test_another_pack_length_is_another_job(tokens, launched, tmp_path, cli):
    store = tmp_path / "packed.zarr"
    shutil.copytree(launched["two"].folder / "token-packed.zarr", store)
    job = packed_job(tokens, "gpt2", store)
    job[job.index("--pack") + 1] = "40"
    code, _, err = cli(*job)
    assert code == 2 and "tokenization" in err, err
    assert open_features(store).pack["context_length"] == PACK


def _edit(store, name, index, change):
    """Change element ``index`` of array ``name`` through zarr: its object's checksum stays valid."""
    array = zarr.open_array(store / name, mode="r+")
    array[index] = change(array[index])


def _tear(path):
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


DAMAGE = {
    "token_ids": lambda s: _edit(s, "token_ids", 40, lambda v: (v + 7) % 50),
    "special": lambda s: _edit(s, "special", 41, lambda v: not v),
    "offsets": lambda s: _edit(s, "offsets", 10, lambda v: v + 1),
    "labels": lambda s: _edit(s, "labels", 3, lambda v: v + 1),
    "keys": lambda s: _edit(s, "keys", 2, lambda v: "elsewhere.jsonl/0"),
    "valid": lambda s: _edit(s, "valid", 4, lambda v: not v),
    "torn offsets": lambda s: _tear(s / "offsets" / "c" / "0"),
    "lost chunk and done": lambda s: [
        (s / "features" / "transformer.h.0" / "c" / "5" / "0").unlink(),
        (s / "done" / "c" / "5").unlink(),
    ],
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_named_by_verify_and_repaired_to_the_same_bytes(corpus, references, tmp_path, damage, cli):
    from extract import open_features
    from extract.cli.verify import main as verify
    from extract.errors import StoreDamagedError

    store = tmp_path / "ragged.zarr"
    shutil.copytree(references / "ragged.zarr", store)
    DAMAGE[damage](store)
    if damage == "lost chunk and done":
        with pytest.raises(StoreDamagedError, match="chunk 5"):
            open_features(store).load("transformer.h.0")
    assert verify([str(store)]) == 1
    assert verify([str(store), "--repair"]) == 1
    code, _, err = cli(*_text_job(corpus, store, *RAGGED))
    assert code == 0, err
    assert verify([str(store)]) == 0
    assert_same_bytes(store, references / "ragged.zarr")


def test_an_edited_packed_doc_is_recomputed_from_the_source(corpus, references, tmp_path, cli):
    from extract.cli.verify import main as verify

    store = tmp_path / "packed.zarr"
    shutil.copytree(references / "packed.zarr", store)
    _edit(store, "doc", 50, lambda v: v + 1)
    _edit(store, "token_ids", 130, lambda v: (v + 3) % 50)
    assert verify([str(store), "--repair"]) == 1
    code, _, err = cli(*_text_job(corpus, store, *PACKED))
    assert code == 0, err
    assert verify([str(store)]) == 0
    assert_same_bytes(store, references / "packed.zarr")


def test_a_store_whose_source_is_gone_is_refused_in_one_line(corpus, references, tmp_path, cli):
    from extract.cli.verify import main as verify

    root, model = corpus
    data = tmp_path / "gone" / "docs.jsonl"
    data.parent.mkdir()
    shutil.copy(root / "docs.jsonl", data)
    store = tmp_path / "store.zarr"
    job = [
        "--model", f"hf:{model}", "--layers", "transformer.h.0", "--data", f"text:{data}", *RAGGED, "--out", str(store),
    ]  # fmt: skip
    assert cli(*job)[0] == 0
    _edit(store, "token_ids", 5, lambda v: (v + 1) % 50)
    assert verify([str(store), "--repair"]) == 1
    data.unlink()
    code, _, err = cli(*job)
    said = [line for line in err.splitlines() if line.startswith("extract")]  # not transformers' loading bar
    assert code == 2 and len(said) == 1 and "no file matches" in said[0] and "Traceback" not in err, err
