"""The same job gives the same bytes whatever happens (issue 28): 1, 2 and 3 processes, a SIGKILL then a
rerun with another process count, a repaired chunk, and every kind of damage to a text store, each
compared array by array, bit for bit, with one uninterrupted run in one process.

The documents have very different lengths and the token budget is small, so a chunk takes many padded
batches: were a document's batch to depend on the ranks or on which chunks are pending, its padded
length would change the matmuls' rounding, and float32 storage would show it."""

import os
import random
import shutil
import signal
import time
import uuid

import numpy as np
import pytest
import zarr
from helpers.launches import Sequence, rank_pids
from helpers.s3 import s3_server_or_none
from helpers.text_models import real_documents, save_text_model, write_jsonl

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


def _arrays(location) -> dict[str, np.ndarray]:
    group = zarr.open_group(location, mode="r")
    return {name: member[:] for name, member in group.members(max_depth=None) if isinstance(member, zarr.Array)}


def assert_same_store(location, reference) -> None:
    """Every array of the two stores holds the same bytes (NaN rows included), and the digests recorded
    at creation agree."""
    ours, theirs = _arrays(location), _arrays(reference)
    assert sorted(ours) == sorted(theirs)
    for name, values in theirs.items():
        got = ours[name]
        assert got.dtype == values.dtype and got.shape == values.shape, name
        if values.dtype.kind in "fiub":
            same = np.array_equal(got.view(np.uint8), values.view(np.uint8))
            if not same and values.dtype.kind == "f":
                worst = np.nanmax(np.abs(got.astype(np.float64) - values))
                raise AssertionError(f"{name} differs (by up to {worst:.3g})")
            assert same, name
        else:
            assert (got == values).all(), name
    group, reference_group = zarr.open_group(location, mode="r"), zarr.open_group(reference, mode="r")
    assert group.attrs.get("document_digests") == reference_group.attrs.get("document_digests")
    assert group.attrs["status"] == "complete"


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
def launched(corpus, references, tmp_path_factory, request):
    """2 ranks run every job (the ragged one on S3 too), then a ragged job whose last rank is SIGKILLed at
    a random point; 3 ranks run every job, then resume the killed one."""
    two_folder, three_folder = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("three")
    killed = two_folder / "killed.zarr"
    server = s3_server_or_none(request)
    on_s3 = f"s3://{server.bucket}/same-{uuid.uuid4().hex[:8]}/ragged.zarr" if server else None
    jobs = {
        **_jobs(corpus, two_folder),
        **({"s3": _text_job(corpus, on_s3, *RAGGED)} if on_s3 else {}),
        "killed": _text_job(corpus, killed, *RAGGED),
    }
    two = Sequence(2, jobs, two_folder, env=server.env() if server else None)
    job = two.start()
    done_at = random.Random().randint(3, 25)  # of about 45 chunks
    deadline = time.time() + 300
    while not ((killed / "done" / "c").is_dir() and len(os.listdir(killed / "done" / "c")) >= done_at):
        assert job.poll() is None and time.time() < deadline, job.stderr.read()[-3000:]
        time.sleep(0.01)
    os.kill(rank_pids(job.pid, program=b"job_sequence.py")[-1], signal.SIGKILL)
    job.communicate(timeout=120)
    three = Sequence(3, {**_jobs(corpus, three_folder), "resumed": _text_job(corpus, killed, *RAGGED)}, three_folder)
    finished = three.run(timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return {"two": two, "three": three, "killed": killed, "s3": on_s3, "env": server.env() if server else {}}


@pytest.mark.parametrize("name", ["ragged", "packed", "pooled", "images"])
@pytest.mark.parametrize("processes", [2, 3])
def test_two_and_three_processes_give_the_bytes_of_one(launched, references, name, processes):
    sequence = launched["two" if processes == 2 else "three"]
    result = sequence.result(name)
    assert result.codes == [0] * processes, result.stderr[-3000:]
    assert_same_store(sequence.folder / f"{name}.zarr", references / f"{name}.zarr")


def test_a_killed_run_resumed_by_another_process_count_gives_the_bytes_of_one(launched, references):
    result = launched["three"].result("resumed")
    assert result.codes == [0, 0, 0], result.stderr[-3000:]
    assert "resuming" in result.stderr
    assert_same_store(launched["killed"], references / "ragged.zarr")
    runs = zarr.open_group(launched["killed"], mode="r").attrs["runs"]
    assert [run["world_size"] for run in runs] == [2, 3]


def test_a_job_on_s3_gives_the_bytes_of_one_on_disk(launched, references, monkeypatch):
    if launched["s3"] is None:
        pytest.skip("the S3 tests need moto[server] and obstore (pip install 'extract[test]')")
    for variable, value in launched["env"].items():
        monkeypatch.setenv(variable, value)
    result = launched["two"].result("s3")
    assert result.codes == [0, 0], result.stderr[-3000:]
    assert_same_store(open_store(launched["s3"], read_only=True), references / "ragged.zarr")


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
    assert_same_store(store, references / "ragged.zarr")


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
    assert_same_store(store, references / "packed.zarr")


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
