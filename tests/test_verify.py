"""Issue 17, items 20, 21 and 24: ``verify`` proves each object is the one written for its place, the
identity attributes are the ones the store was created with, and a complete store has every chunk;
garbage metadata are one line. Each tamper case: verify's exit status and line, ``--repair``, and the
rerun's store against the reference. One small extraction builds the reference, copied per case."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import TINY
from helpers.data_files import make_png_tree
from helpers.forked import fork_run

from extract.cli.verify import main as verify_main
from extract.errors import ExtractError, StoreDamagedError
from extract.read.features import open_features
from extract.store.store import FeatureStore

JOB = ["--model", f"{TINY}:dict_net", "--layers", "heads.conv", "fc", "--image-size", "32", "--num-workers", "0",
       "--dtype", "float32", "--chunk-size", "4", "--batch-size", "4"]  # fmt: skip
ARRAYS = ("features/heads.conv", "features/fc", "labels", "valid", "keys")
UNPLACED = "is not the object written for this chunk (swapped, copied or stale)"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """The reference (48 synthetic images, 12 chunks) and a store of the same shape from other images."""
    root = tmp_path_factory.mktemp("verify")
    reference, other = root / "ref.zarr", root / "other.zarr"
    assert fork_run([*JOB, "--data", "synthetic:48", "--out", reference]) == 0
    make_png_tree(root / "images", {"a": 24, "b": 24}, seed=3)
    assert fork_run([*JOB, "--data", f"imagefolder:{root / 'images'}", "--out", other]) == 0
    return reference, other


@pytest.fixture
def copy(stores, tmp_path):
    out = tmp_path / "t.zarr"
    shutil.copytree(stores[0], out)
    return out


def run_job(out: Path, tmp_path: Path, *extra: str) -> str:
    log = tmp_path / "job.err"
    assert fork_run([*JOB, "--data", "synthetic:48", "--out", out, *extra], stderr=log) == 0, log.read_text()
    return log.read_text()


def verify(capsys, out: Path, *flags: str) -> tuple[int, str]:
    code = verify_main([str(out), *flags])
    captured = capsys.readouterr()
    line = captured.out.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in captured.err, captured
    return code, line


def assert_reference(out: Path, reference: Path) -> None:
    a, b = zarr.open_group(out, mode="r"), zarr.open_group(reference, mode="r")
    assert a.attrs["status"] == "complete" and a["done"][:].all()
    for name in ("fingerprint", "identity", "layers", "identity_sha256"):
        assert a.attrs[name] == b.attrs[name], name
    for name in (*ARRAYS, "digests"):
        np.testing.assert_array_equal(a[name][:], b[name][:], err_msg=name)


def object_path(out: Path, array: str, chunk: int) -> Path:
    arr = zarr.open_group(out, mode="r")[array]
    return out / array / arr.metadata.encode_chunk_key((chunk, *[0] * (arr.ndim - 1)))


def edit_attrs(out: Path, **values) -> None:
    meta = json.loads((out / "zarr.json").read_text())
    meta["attributes"].update(values)
    (out / "zarr.json").write_text(json.dumps(meta))


def repaired_then_rerun(capsys, tmp_path, out, reference, *expected) -> str:
    """--repair (exit 1, its line naming ``expected``), then the job's rerun: the reference, clean."""
    code, line = verify(capsys, out, "--repair")
    assert code == 1 and all(text in line for text in expected), line
    err = run_job(out, tmp_path)
    assert_reference(out, reference)
    assert verify(capsys, out)[0] == 0
    return err


# ------------------------------------------------------------------------ objects bound to their place


def swap(out: Path, array: str, a: int, b: int) -> None:
    first, second = object_path(out, array, a), object_path(out, array, b)
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)


@pytest.mark.parametrize("array, chunks", [("features/heads.conv", (2, 7)), ("labels", (1, 2))])
def test_swapped_chunks_are_named_and_recomputed(capsys, tmp_path, stores, copy, array, chunks):
    assert verify(capsys, copy) == (0, f"extract.verify: {copy}: all 12 done chunks are present and match "
                                       "their checksums and the digests recorded when they were written")  # fmt: skip
    swap(copy, array, *chunks)
    code, line = verify(capsys, copy)
    assert code == 1 and "2 of 12 chunks damaged" in line, line
    assert all(f"chunk {k}: {array} {UNPLACED}" in line for k in chunks), line
    err = repaired_then_rerun(capsys, tmp_path, copy, stores[0], "cleared their done flags")
    assert "2 chunks written, 10 reused" in err, err


def test_a_chunk_copied_from_another_store_is_named(capsys, tmp_path, stores, copy):
    reference, other = stores
    for array in ARRAYS:
        shutil.copyfile(object_path(other, array, 3), object_path(copy, array, 3))
    code, line = verify(capsys, copy)
    assert code == 1 and "1 of 12 chunks damaged" in line, line
    for array in ("features/heads.conv", "features/fc", "labels", "keys"):  # valid is all True in both
        assert f"{array} {UNPLACED}" in line, line
    err = repaired_then_rerun(capsys, tmp_path, copy, reference, "cleared their done flags")
    assert "1 chunk written, 11 reused" in err, err


def test_verify_is_a_library_function_the_command_prints(capsys, stores, copy):
    """``verify_store`` takes a config, not arguments, and returns what the command prints and exits by."""
    from extract.store.verifying import VerifyConfig, verify_store

    clean = verify_store(VerifyConfig(str(copy)))
    assert clean.clean and clean.report is not None and clean.report.done == 12
    assert verify(capsys, copy) == (0, clean.line)
    reference, other = stores
    shutil.copyfile(object_path(other, "labels", 3), object_path(copy, "labels", 3))
    damaged = verify_store(VerifyConfig(str(copy)))
    assert not damaged.clean and sorted(damaged.report.damaged) == [3]
    assert verify(capsys, copy) == (1, damaged.line)
    with pytest.raises(ExtractError, match="is not an extract store"):
        verify_store(VerifyConfig(str(copy.parent / "missing.zarr")))


# --------------------------------------------------------------------------------- identity attributes


def test_an_edited_fingerprint_is_named_and_restored(capsys, tmp_path, stores, copy):
    edit_attrs(copy, fingerprint="0" * 16)
    code, line = verify(capsys, copy)
    assert code == 1 and "its metadata damaged (fingerprint does not match the identity" in line, line
    repaired_then_rerun(capsys, tmp_path, copy, stores[0], "restored the attribute fingerprint")


def test_a_layer_dropped_from_layers_is_named_and_restored(capsys, tmp_path, stores, copy):
    edit_attrs(copy, layers=["heads.conv"])
    code, line = verify(capsys, copy)
    assert code == 1 and "layers does not list the arrays under features/ (fc, heads.conv)" in line, line
    repaired_then_rerun(capsys, tmp_path, copy, stores[0], "restored the attribute layers")
    assert open_features(copy).layers == ["heads.conv", "fc"]


def test_the_job_record_is_not_part_of_the_identity(capsys, copy):
    store = FeatureStore.open(copy)
    store.update_attrs(runs=[], summary={"edited": True}, writer="someone-else", status="complete")
    assert verify(capsys, copy)[0] == 0


def test_a_store_from_before_digests_says_placement_cannot_be_checked(capsys, copy):
    meta = json.loads((copy / "zarr.json").read_text())
    del meta["attributes"]["identity_sha256"]
    meta["attributes"]["format_version"] = 2
    (copy / "zarr.json").write_text(json.dumps(meta))
    shutil.rmtree(copy / "digests")
    code, line = verify(capsys, copy)
    assert code == 0 and line.count("format 2 recorded no digests") == 1 and "all 12 done chunks" in line, line


# ---------------------------------------------------------------------------------- garbage metadata


@pytest.mark.parametrize("node", ["features/heads.conv", "keys", "done", ""])
def test_garbage_array_metadata_is_one_line_and_a_typed_error(capsys, tmp_path, stores, copy, node):
    damaged = copy / node / "zarr.json" if node else copy / "zarr.json"
    damaged.write_text("this is not json {")
    code, line = verify(capsys, copy)
    assert code == 1 and f"{damaged} does not decode as zarr metadata" in line, line
    with pytest.raises(StoreDamagedError, match=f"{damaged} does not decode as zarr metadata") as error:
        features = open_features(copy)
        _ = features.keys
    assert isinstance(error.value, ExtractError)
    assert verify(capsys, copy, "--repair")[0] == 1
    if node:  # the rerun is told to overwrite, and --overwrite gives the reference
        run_job(copy, tmp_path, "--overwrite")
        assert_reference(copy, stores[0])


# ------------------------------------------------------------------------ a complete store has every chunk


def test_a_lost_done_mark_in_a_complete_store_is_named_and_recomputed(capsys, tmp_path, stores, copy):
    object_path(copy, "done", 5).unlink()
    code, line = verify(capsys, copy)
    assert code == 1 and "1 of 12 chunks damaged (chunk 5: not done in a complete store (its done mark was lost" in line
    err = repaired_then_rerun(capsys, tmp_path, copy, stores[0], "cleared their done flags")
    assert "1 chunk written, 11 reused" in err, err


def test_every_done_object_deleted_is_damage(capsys, tmp_path, stores, copy):
    shutil.rmtree(copy / "done" / "c")
    code, line = verify(capsys, copy)
    assert code == 1 and "12 of 12 chunks damaged" in line and "and 9 more" in line, line
    err = repaired_then_rerun(capsys, tmp_path, copy, stores[0], "cleared their done flags")
    assert "12 chunks written" in err, err


def partial(out: Path, chunks: list[int]) -> None:
    """``out`` as if ``chunks`` had never been written: no done, digests or data objects."""
    FeatureStore.open(out).integrity.clear_done(chunks)
    for array in ("features/heads.conv", "features/fc", "labels", "valid"):
        for k in chunks:
            object_path(out, array, k).unlink()


def test_status_edited_to_complete_on_a_partial_store(capsys, tmp_path, stores, copy):
    partial(copy, list(range(6, 12)))
    code, line = verify(capsys, copy)
    assert code == 0 and "6 of 12 chunks are done" in line and "compute the other 6" in line, line
    edit_attrs(copy, status="complete")
    code, line = verify(capsys, copy)
    assert code == 1 and "6 of 12 chunks damaged (chunk 6: not done in a complete store;" in line, line
    assert "done mark was lost" not in line
    repaired_then_rerun(capsys, tmp_path, copy, stores[0], "cleared their done flags")


@pytest.mark.parametrize("status", ["running", "interrupted"])
def test_a_status_edited_away_from_complete_is_named_and_set_right(capsys, tmp_path, stores, copy, status):
    """Every chunk done but the status says otherwise: the attribute is named (not 'compute the other 0'),
    and --repair sets it to complete."""
    edit_attrs(copy, status=status)
    code, line = verify(capsys, copy)
    assert code == 1 and f"status is '{status}', but every chunk is done" in line, line
    assert "status attribute disagrees with the done flags" in line and "the other 0" not in line, line
    code, line = verify(capsys, copy, "--repair")
    assert code == 1 and "restored the attribute status" in line and "all 12 done chunks are present" in line, line
    assert verify(capsys, copy)[0] == 0
    assert_reference(copy, stores[0])


@pytest.fixture(scope="module")
def text_store(tmp_path_factory):
    """A small token store of a GPT-2-like model over real documents."""
    from helpers.text_models import real_documents, save_text_model, write_jsonl

    from extract.cli.extract import main

    root = tmp_path_factory.mktemp("verify-text")
    write_jsonl(root / "docs.jsonl", real_documents(8))
    model = save_text_model("gpt2", root / "gpt2")
    out = root / "tokens.zarr"
    assert main(["--model", f"hf:{model}", "--layers", "transformer.h.0", "--data", f"text:{root / 'docs.jsonl'}",
                 "--context-length", "64", "--chunk-size", "100", "--out", str(out)]) == 0  # fmt: skip
    return out


@pytest.mark.parametrize("name", ["num_documents", "num_tokens"])
def test_an_edited_count_of_a_text_store_is_named_and_restored(capsys, tmp_path, text_store, name):
    copy = tmp_path / "t.zarr"
    shutil.copytree(text_store, copy)
    offsets = zarr.open_group(copy, mode="r")["offsets"][:]
    right = {"num_documents": len(offsets) - 1, "num_tokens": int(offsets[-1])}[name]
    edit_attrs(copy, **{name: right + 5})
    code, line = verify(capsys, copy)
    assert code == 1 and f"{name} is {right + 5}, but offsets holds {right}: the attribute was edited" in line, line
    code, line = verify(capsys, copy, "--repair")
    assert code == 1 and f"restored the attribute {name}" in line, line
    assert zarr.open_group(copy, mode="r").attrs[name] == right and verify(capsys, copy)[0] == 0


def test_a_rerun_of_a_complete_store_with_chunks_not_done_computes_them(tmp_path, stores, copy):
    partial(copy, [3, 9])
    edit_attrs(copy, status="complete")
    err = run_job(copy, tmp_path)
    assert "marked complete but 2 chunks are not done (chunk 3, 9)" in err and "2 chunks written, 10 reused" in err
    assert_reference(copy, stores[0])


# ---------------------------------------------------------------------------- the checksum codec


def test_crc32c_removed_from_metadata_is_restored_and_rewritten_with_it(capsys, tmp_path, stores, copy):
    meta_path = copy / "labels" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["codecs"] = [codec for codec in meta["codecs"] if codec["name"] != "crc32c"]
    meta_path.write_text(json.dumps(meta))
    object_path(copy, "labels", 4).unlink()  # and one chunk to recompute: it must be written checked
    code, line = verify(capsys, copy)
    assert code == 1 and "labels lacks its crc32c checksum in its metadata" in line, line
    err = repaired_then_rerun(capsys, tmp_path, copy, stores[0], "restored crc32c in labels's metadata",
                              "1 of 12 chunks damaged (chunk 4: labels missing)")  # fmt: skip
    assert "1 chunk written, 11 reused" in err, err
    store = FeatureStore.open(copy, mode="r")
    for name in (*ARRAYS, "done", "digests"):
        assert type(store.array(name).compressors[-1]).__name__ == "Crc32cCodec", name
    written = object_path(copy, "labels", 4).read_bytes()
    assert int.from_bytes(written[-4:], "little") == zarr.open_group(copy, mode="r")["digests"][4, 2]
