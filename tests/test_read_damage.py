"""Reading a damaged store: a "complete" store that lost or tore an object (a chunk's features with its
``done`` flag, a torn ``done`` flag, a per-token object, a per-document object written at creation) is a
``StoreDamagedError`` naming the chunk or object and the fix, from ``Features.load``, ``document``,
``FeatureDataset``, ``TokenStream`` and the CLI alike, never NaN rows; a partial store still reads."""

import shutil

import numpy as np
import pytest
import zarr
from helpers.text_models import real_documents, save_text_model, write_jsonl

from extract import FeatureDataset, TokenStream, open_features
from extract.cli.export import main as export_main
from extract.cli.extract import main as extract_main
from extract.cli.verify import main as verify_main
from extract.errors import StoreDamagedError

IMAGE_LAYER, TOKEN_LAYER = "layer4", "transformer.h.0"


def image_job(out):
    return [
        "--model", "resnet18", "--weights", "none", "--data", "synthetic:64", "--image-size", "32",
        "--chunk-size", "16", "--num-workers", "0", "--layers", IMAGE_LAYER, "--out", str(out),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """An image store (64 samples in 4 chunks of 16), a ragged token store and a packed one (tokens in
    chunks of 64, the ragged one with a label per document)."""
    root = tmp_path_factory.mktemp("damage")
    assert extract_main(image_job(root / "images.zarr")) == 0
    data = write_jsonl(root / "docs.jsonl", real_documents(12), label=[i % 3 for i in range(12)])
    model = save_text_model("gpt2", root / "gpt2")
    text = ["--model", f"hf:{model}", "--data", f"text:{data}", "--layers", TOKEN_LAYER, "--chunk-size", "64"]
    text += ["--dtype", "float32"]
    ragged = ["--context-length", "64", "--label-key", "label"]
    assert extract_main([*text, *ragged, "--out", str(root / "tokens.zarr")]) == 0
    assert extract_main([*text, "--pack", "32", "--out", str(root / "packed.zarr")]) == 0
    return {name: root / f"{name}.zarr" for name in ("images", "tokens", "packed")}


def copy(stores, name, tmp_path):
    path = tmp_path / f"{name}.zarr"
    shutil.copytree(stores[name], path)
    return path


def tear(path):
    """Flip a byte in the middle of the object at ``path``, as a torn write or a bad disk does."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def chunk_object(store, array, chunk):
    """The object of ``array``'s chunk ``chunk``: ``c/<k>`` for a 1-D array, ``c/<k>/0/...`` for more dimensions."""
    place = store / array / "c" / str(chunk)
    return place if place.is_file() else next(p for p in place.rglob("*") if p.is_file())


def damage(store, layer, chunk, how):
    """``lost``: the chunk's features object and its done flag are gone; ``done lost``: only the flag;
    ``done torn``: the flag's object fails its checksum."""
    done = store / "done" / "c" / str(chunk)
    if how == "lost":
        chunk_object(store, f"features/{layer}", chunk).unlink()
    if how in ("lost", "done lost"):
        done.unlink()
    else:
        tear(done)


def one_line_naming(error, path, chunk, start, stop):
    message = str(error.value)
    assert "\n" not in message, message
    assert f"chunk {chunk} (samples {start}-{stop})" in message, message
    assert f"python -m extract.verify {path} --repair" in message and "the job's command" in message, message


@pytest.mark.parametrize("how", ["lost", "done lost", "done torn"])
def test_an_image_store_missing_a_done_chunk_is_damaged_for_every_reader(stores, tmp_path, how):
    path = copy(stores, "images", tmp_path)
    whole = open_features(stores["images"]).load(IMAGE_LAYER)
    damage(path, IMAGE_LAYER, 2, how)
    f = open_features(path)
    assert f.complete
    for read in (
        lambda: f.load(IMAGE_LAYER),
        lambda: f.load(IMAGE_LAYER, [40, 3]),
        lambda: f.labels,
        lambda: f.valid,
        lambda: f.load_labels(slice(30, 40)),
        lambda: FeatureDataset(path, IMAGE_LAYER)[40],
    ):
        with pytest.raises(StoreDamagedError) as error:
            read()
        one_line_naming(error, path, 2, 32, 47)
    # the chunks that are whole still read, without NaN
    assert np.array_equal(f.load(IMAGE_LAYER, slice(0, 32)), whole[:32])
    assert np.array_equal(FeatureDataset(path, IMAGE_LAYER)[5][0].numpy(), whole[5])
    if how == "lost":  # the advice works: verify --repair, then the job's command, give the store back
        assert verify_main([str(path), "--repair"]) == 1
        assert extract_main(image_job(path)) == 0
        assert np.array_equal(open_features(path).load(IMAGE_LAYER), whole)


def test_a_token_store_missing_a_done_chunk_is_damaged_for_document_the_dataset_and_the_stream(stores, tmp_path):
    path = copy(stores, "tokens", tmp_path)
    damage(path, TOKEN_LAYER, 3, "lost")
    f = open_features(path)
    inside = int(f.text.documents_of(np.array([200]))[0])  # a document with rows in chunk 3 (tokens 192-255)
    for read in (
        lambda: f.load(TOKEN_LAYER),
        lambda: f.text.document(inside),
        lambda: f.text.document(inside),
        lambda: f.stats(TOKEN_LAYER),
        lambda: FeatureDataset(path, TOKEN_LAYER)[200],
        lambda: list(TokenStream(path, TOKEN_LAYER, 16, threads=2)),
        lambda: list(TokenStream(path, TOKEN_LAYER, 16, threads=0)),
    ):
        with pytest.raises(StoreDamagedError) as error:
            read()
        one_line_naming(error, path, 3, 192, 255)
    assert np.isfinite(f.text.document(0)).all() and int(f.text.offsets[1]) <= 192  # document 0 is in chunk 0
    # the same store as an unfinished job leaves it: the chunk is not written yet, and reads as NaN
    zarr.open_group(path, mode="r+").attrs["status"] = "running"
    partial = open_features(path, allow_partial=True)
    assert np.isnan(partial.load(TOKEN_LAYER, slice(192, 256))).all()
    assert np.isfinite(partial.text.document(0)).all()


@pytest.mark.parametrize("name", ["special", "token_ids"])
def test_a_torn_per_token_object_is_named_with_its_chunk(stores, tmp_path, name):
    path = copy(stores, "tokens", tmp_path)
    tear(path / name / "c" / "3")
    f = open_features(path)
    reads = {
        "special": [lambda: f.text.special, lambda: list(TokenStream(path, TOKEN_LAYER, 16, exclude="special"))],
        "token_ids": [lambda: f.text.token_ids, lambda: f.text.load_token_ids(slice(150, 250))],
    }[name]
    for read in reads:
        with pytest.raises(StoreDamagedError) as error:
            read()
        one_line_naming(error, path, 3, 192, 255)
    assert f.text.load_token_ids(slice(0, 192)).shape == (192,)  # the other chunks read


@pytest.mark.parametrize("how", ["torn", "missing"])
@pytest.mark.parametrize("name", ["offsets", "labels", "valid", "keys"])
def test_a_damaged_per_document_object_is_named_with_its_fix(stores, tmp_path, name, how):
    path = copy(stores, "tokens", tmp_path)
    damaged = path / name / "c" / "0"
    tear(damaged) if how == "torn" else damaged.unlink()
    f = open_features(path)
    reads = {
        "offsets": [lambda: f.text.offsets, lambda: f.text.document(0), lambda: list(TokenStream(path, TOKEN_LAYER, 16, exclude="first:1"))],
        "labels": [lambda: f.labels, lambda: FeatureDataset(path, TOKEN_LAYER)[0]],
        "valid": [lambda: f.valid],
        "keys": [lambda: f.keys],
    }[name]  # fmt: skip
    for read in reads:
        with pytest.raises(StoreDamagedError) as error:
            read()
        message = str(error.value)
        assert "\n" not in message and f"{path}: '{name}', object {name}/c/0 (rows 0-" in message, message
        assert ("is missing" if how == "missing" else "fails its check") in message, message
        assert f"python -m extract.verify {path} --repair`, then the job's command again" in message, message
    from extract.cli.verify import main as verify

    assert verify([str(path)]) == 1  # verify names it too, by the digests recorded at creation


def test_the_export_command_says_a_lost_chunk_in_one_line(stores, tmp_path, capsys):
    pytest.importorskip("datasets")
    path = copy(stores, "packed", tmp_path)
    damage(path, TOKEN_LAYER, 1, "lost")
    code = export_main([str(path), "--to", "saelens", str(tmp_path / "cache"), "--layer", TOKEN_LAYER])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("extract.export: error:") and "chunk 1 (samples 64-127)" in err and "--repair" in err, err
    assert not (tmp_path / "cache").exists()
