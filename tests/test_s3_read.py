"""Issue 20, the read side on object storage: a store made locally by the CLI and uploaded to moto's S3
server reads back through its URL as it does through its path: ``open_features``, ``FeatureDataset``,
xarray, ``verify`` (clean, then a deleted and a garbage chunk object, named and repaired), ``probe``
and ``compare``."""

import json
import time

import numpy as np
import pytest
import torch
from helpers import TINY
from helpers.forked import fork_run
from helpers.s3 import s3_per_module, upload  # noqa: F401 - s3_per_module: this module's s3

from extract import open_features
from extract.cli.compare import main as compare_main
from extract.cli.probe import main as probe_main
from extract.cli.verify import main as verify_main
from extract.read.dataset import ChunkShuffleSampler, FeatureDataset
from extract.store.store import FeatureStore

JOB = ["--model", f"{TINY}:dict_net", "--layers", "heads.conv", "fc", "--image-size", "32", "--num-workers", "0",
       "--dtype", "float32", "--chunk-size", "4", "--batch-size", "4", "--data", "synthetic:48"]  # fmt: skip



@pytest.fixture(scope="module")
def stores(tmp_path_factory, s3):
    """(local path, its URL): 48 synthetic images in 12 chunks, extracted here and uploaded."""
    local = tmp_path_factory.mktemp("s3read") / "ref.zarr"
    assert fork_run([*JOB, "--out", local]) == 0
    return local, upload(s3, local, "ref.zarr")


def verify(capsys, store, *flags: str) -> tuple[int, str]:
    code = verify_main([str(store), *flags])
    captured = capsys.readouterr()
    assert len(captured.out.strip().splitlines()) == 1 and "Traceback" not in captured.err, captured
    return code, captured.out.strip()


def test_the_reader_and_the_dataset_read_a_url_as_the_path(stores):
    local, url = stores
    a, b = open_features(url), open_features(local)
    assert a.path == url and a.layers == b.layers and a.complete
    for layer in a.layers:
        np.testing.assert_array_equal(a.load(layer), b.load(layer))
        np.testing.assert_array_equal(a.load(layer, [40, 3, 17, 3], pool="avg" if layer == "heads.conv" else None),
                                      b.load(layer, [40, 3, 17, 3], pool="avg" if layer == "heads.conv" else None))  # fmt: skip
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.keys, b.keys)
    dataset = FeatureDataset(url, "fc", cache_chunks=2)
    sampler = ChunkShuffleSampler(len(dataset), dataset.chunk_size, 8, window=2)
    for batch in sampler:
        for i in batch:
            values, label = dataset[i]
            np.testing.assert_array_equal(values.numpy(), b.load("fc", [i])[0])
            assert label == b.labels[i]
    assert dataset.chunk_reads == a.num_chunks  # each chunk read once an epoch


def test_xarray_opens_the_url_through_zarrs_object_store(stores):
    xr = pytest.importorskip("xarray")
    from extract.store.location import open_store

    local, url = stores
    ds = xr.open_zarr(open_store(url, read_only=True), group="features", consolidated=False)
    np.testing.assert_array_equal(ds["fc"].values, open_features(local).load("fc"))


def test_verify_a_url_then_damage_named_and_repaired(capsys, stores, s3):
    local, url = stores
    assert verify(capsys, url) == (0, verify(capsys, local)[1].replace(str(local), url))
    damaged = upload(s3, local, "damaged.zarr")
    client, key = s3.server.client(), f"{s3.prefix}/damaged.zarr/features/fc/c"
    client.delete_object(Bucket=s3.server.bucket, Key=f"{key}/2/0")
    client.put_object(Bucket=s3.server.bucket, Key=f"{key}/5/0", Body=b"garbage")
    code, line = verify(capsys, damaged)
    assert code == 1 and "2 of 12 chunks damaged" in line, line
    assert "chunk 2: features/fc missing" in line and "chunk 5: features/fc does not decode" in line, line
    code, line = verify(capsys, damaged, "--repair")
    assert code == 1 and "cleared their done flags" in line, line
    assert FeatureStore.open(damaged, mode="r").pending_chunks() == [2, 5]
    assert s3.keys() and not any(key.endswith(".lock") for key in s3.keys())  # the repair's lock was released
    code, line = verify(capsys, damaged)
    assert code == 0 and "10 of 12 chunks are done" in line, line


def test_probe_and_compare_on_a_url_as_on_the_path(capsys, stores, tmp_path):
    local, url = stores
    results = {}
    for name, store in (("local", local), ("url", url)):
        assert probe_main([str(store), "--epochs", "20", "--json", str(tmp_path / f"p-{name}.json")]) == 0
        assert compare_main([f"{store}:fc,heads.conv", "--json", str(tmp_path / f"c-{name}.json")]) == 0
        probe = json.loads((tmp_path / f"p-{name}.json").read_text())
        cka = json.loads((tmp_path / f"c-{name}.json").read_text())
        assert cka["rows"] == ["heads.conv", "fc"]
        results[name] = (probe["layers"], cka["cka"])
    capsys.readouterr()
    assert results["url"] == results["local"]


def test_report_on_a_url_as_on_the_path(capsys, stores, tmp_path):
    pytest.importorskip("matplotlib")
    from extract.cli.report import main as report_main

    local, url = stores
    pages = {}
    for name, store in (("local", local), ("url", url)):
        out = tmp_path / f"{name}.html"
        assert report_main([str(store), "--out", str(out), "--device", "cpu"]) == 0
        pages[name] = out.read_text().replace(str(store), "STORE")
    capsys.readouterr()
    assert "extract report: ref.zarr" in pages["url"] and pages["url"] == pages["local"]


def test_token_stream_reads_a_url_as_the_path(tmp_path, s3):
    from helpers.text_models import real_documents, save_text_model, write_jsonl

    from extract import TokenStream
    from extract.cli.extract import main as extract_main

    data = write_jsonl(tmp_path / "docs.jsonl", real_documents(12))
    model = save_text_model("gpt2", tmp_path / "gpt2")
    local = tmp_path / "tokens.zarr"
    assert extract_main(["--model", f"hf:{model}", "--data", f"text:{data}", "--chunk-size", "64", "--dtype",
                         "float16", "--layers", "transformer.h.0", "--pack", "32", "--context-length", "32",
                         "--out", str(local)]) == 0  # fmt: skip
    url = upload(s3, local, "tokens.zarr")
    stored = open_features(local).load("transformer.h.0")
    streams = [TokenStream(store, "transformer.h.0", 48, window=4, exclude="special", return_index=True, seed=1)
               for store in (local, url)]  # fmt: skip
    batches = [list(stream) for stream in streams]
    assert len(batches[0]) == len(batches[1]) > 2
    for (a, rows_a), (b, rows_b) in zip(*batches, strict=True):
        assert torch.equal(rows_a, rows_b) and torch.equal(a, b)
        np.testing.assert_array_equal(b.numpy(), stored[rows_b.numpy()])


def test_a_forked_dataloader_worker_is_refused_in_one_line_not_left_hanging(stores):
    """obstore's runtime does not survive fork: a worker forked after this process read the store
    would hang on its first request; it is refused, naming the fix."""
    from extract.store.location import ForkedAfterObjectStorageError

    _, url = stores
    dataset = FeatureDataset(url, "fc")
    dataset[40]  # this process has used object storage (and caches chunk 10, not the worker's chunk 0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=1, multiprocessing_context="fork")
    batches = iter(loader)
    with pytest.raises(ForkedAfterObjectStorageError, match="multiprocessing_context='spawn'"):
        next(batches)
    started = time.monotonic()
    batches._shutdown_workers()  # what its __del__ does, here rather than in whichever thread collects it
    assert time.monotonic() - started < 10  # the refused worker exits: nothing is left hanging
    assert not any(worker.is_alive() for worker in batches._workers)
