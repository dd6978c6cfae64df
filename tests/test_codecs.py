"""The stores' codecs: the default by kind of store (none for text models' activations, zstd for
images: benchmarks/codecs.py), ``--compressor`` over it, and a store made under another default
(zstd, before text stores' became none) resumed by the same command without the flag."""

import json

import numpy as np
import pytest
from helpers.text_models import real_documents, save_text_model, write_jsonl
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from extract import open_features
from extract.job.spec import DEFAULT_COMPRESSORS, JobSpec
from extract.store.store import FeatureStore

LAYER = "transformer.h.0"


@pytest.fixture(scope="module")
def text_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("codecs")
    write_jsonl(root / "docs.jsonl", real_documents(12))
    model = save_text_model("gpt2", root / "gpt2")

    def job(out, *extra):
        return [
            "--model", f"hf:{model}", "--layers", LAYER, "--data", f"text:{root / 'docs.jsonl'}",
            "--context-length", "64", "--chunk-size", "64", "--out", str(out), *extra,
        ]  # fmt: skip

    return job


def _compressors(path, layer=LAYER):
    return open_features(path).array(layer).compressors


def _identity(path):
    return json.loads((path / "zarr.json").read_text())["attributes"]["identity"]


def test_the_defaults_are_declared_for_every_kind_of_store():
    assert DEFAULT_COMPRESSORS == {"images": "zstd", "documents": "none", "tokens": "none"}
    assert JobSpec().compressor is None  # resolved per store: ``JobSpec.store_compressor``


@pytest.mark.parametrize("extra, kind", [((), "tokens"), (("--pool", "mean"), "documents")])
def test_a_new_text_store_is_checksummed_but_not_compressed(text_job, tmp_path, cli, extra, kind):
    out = tmp_path / "new.zarr"
    code, _, err = cli(*text_job(out, *extra))
    assert code == 0, err
    features = open_features(out)
    assert features.kind == kind
    (checksum,) = _compressors(out)  # no compressor, the crc32c only
    assert isinstance(checksum, Crc32cCodec)
    assert _identity(out)["compressor"] == "none"
    assert json.loads((out / "zarr.json").read_text())["attributes"]["job"]["compressor"] == "none"
    assert isinstance(features.store.array("offsets").compressors[0], ZstdCodec)  # metadata stays zstd


def test_a_new_image_store_keeps_zstd(tmp_path, cli):
    out = tmp_path / "images.zarr"
    code, _, err = cli(
        "--model", "resnet18", "--weights", "none", "--layers", "layer1", "--pool", "avg", "--image-size", "32",
        "--data", "synthetic:4", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    compressor, checksum = _compressors(out, "layer1")
    assert isinstance(compressor, ZstdCodec) and isinstance(checksum, Crc32cCodec)
    assert _identity(out)["compressor"] == "zstd"


@pytest.mark.parametrize("name, codec", [("zstd", ZstdCodec), ("bitshuffle", BloscCodec)])
def test_compressor_flag_still_chooses_the_codec(text_job, tmp_path, cli, name, codec):
    out = tmp_path / f"{name}.zarr"
    code, _, err = cli(*text_job(out, "--compressor", name))
    assert code == 0, err
    compressor, checksum = _compressors(out)
    assert isinstance(compressor, codec) and isinstance(checksum, Crc32cCodec)
    if name == "bitshuffle":
        assert compressor.shuffle.value == "bitshuffle" and compressor.cname.value == "lz4"
    assert _identity(out)["compressor"] == name
    np.testing.assert_array_equal(open_features(out).load(LAYER), open_features(out).load(LAYER))  # decodes


def test_a_zstd_store_resumes_with_the_default_flags_and_stays_zstd(text_job, tmp_path, cli):
    """A token store made when zstd was the default (its identity says zstd), interrupted: the same
    command without --compressor resumes it, with zstd, instead of calling it another job."""
    out, reference = tmp_path / "old.zarr", tmp_path / "reference.zarr"
    assert cli(*text_job(reference, "--compressor", "zstd"))[0] == 0
    assert cli(*text_job(out, "--compressor", "zstd"))[0] == 0
    store = FeatureStore.open(out)
    assert store.plan.num_chunks >= 3
    store.integrity.clear_done([0, 2])  # as a kill leaves it: chunks not done, the job running
    store.update_attrs(status="running")
    fingerprint = json.loads((out / "zarr.json").read_text())["attributes"]["fingerprint"]

    code, _, err = cli(*text_job(out))
    assert code == 0, err
    assert "resuming" in err and "different job" not in err, err
    attrs = json.loads((out / "zarr.json").read_text())["attributes"]
    assert attrs["status"] == "complete" and attrs["fingerprint"] == fingerprint
    assert attrs["identity"]["compressor"] == "zstd"
    assert isinstance(_compressors(out)[0], ZstdCodec)
    np.testing.assert_array_equal(open_features(out).load(LAYER), open_features(reference).load(LAYER))
    # and a different codec asked for explicitly is still another job
    code, _, err = cli(*text_job(out, "--compressor", "none"))
    assert code == 2 and "differs in: compressor" in err, err


def test_overwrite_takes_the_default_again(text_job, tmp_path, cli):
    out = tmp_path / "again.zarr"
    assert cli(*text_job(out, "--compressor", "zstd"))[0] == 0
    code, _, err = cli(*text_job(out, "--overwrite"))
    assert code == 0, err
    assert _identity(out)["compressor"] == "none" and len(_compressors(out)) == 1


def test_store_compressor_rules():
    old = {"identity": {"compressor": "zstd"}}
    assert JobSpec().store_compressor("tokens", None) == "none"
    assert JobSpec().store_compressor("images", None) == "zstd"
    assert JobSpec().store_compressor("tokens", old) == "zstd"
    assert JobSpec(overwrite=True).store_compressor("tokens", old) == "none"
    assert JobSpec(compressor="blosc").store_compressor("tokens", old) == "blosc"
    assert JobSpec().store_compressor("documents", {"extract.damaged_root": "x"}) == "none"


def test_an_unknown_compressor_is_refused_by_name():
    from extract.errors import ExtractError

    with pytest.raises(ExtractError, match="unknown --compressor 'lz4'.*bitshuffle"):
        JobSpec(compressor="lz4").validate()
