"""Reading stores back: ``open_features``, xarray, and the chunk-aware torch Dataset and sampler."""

import shutil

import numpy as np
import pytest
import torch
import xarray as xr
import zarr
from helpers import TINY
from torch.utils.data import DataLoader

from extract import ChunkShuffleSampler, ExtractError, FeatureDataset, open_features
from extract.cli.extract import main
from extract.errors import LayerNotFoundError, SampleIndexError, StoreNotFoundError
from extract.read.features import PoolMismatchError

N, CHUNK = 40, 8  # K = 5 chunks


def extract_store(path, *args):
    code = main(["--data", f"synthetic:{N}", "--image-size", "32", "--chunk-size", str(CHUNK), "--num-workers", "0",
                 "--batch-size", "16", "--out", str(path), *args])  # fmt: skip
    assert code == 0
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """resnet18 layer3 (256, 2, 2) and layer4 (512, 1, 1) in float16, 40 samples in 5 chunks."""
    path = tmp_path_factory.mktemp("reader") / "r18.zarr"
    return extract_store(path, "--model", "resnet18", "--weights", "none", "--layers", "layer3", "layer4")


@pytest.fixture(scope="module")
def raw(store):
    """What zarr itself reads, the reference every reader result is compared with."""
    group = zarr.open_group(store, mode="r")
    return {layer: group[f"features/{layer}"][:] for layer in ("layer3", "layer4")}


@pytest.fixture
def partial(store, tmp_path):
    """A copy of the store as an interrupted job leaves it: status running, chunk 1 never written."""
    path = tmp_path / "partial.zarr"
    shutil.copytree(store, path)
    group = zarr.open_group(path, mode="r+")
    group.attrs["status"] = "running"
    group["done"][1] = False
    for layer in ("layer3", "layer4"):
        shutil.rmtree(path / "features" / layer / "c" / "1")
    return path


def test_open_describes_the_store(store):
    features = open_features(store)
    assert features.layers == ["layer3", "layer4"]
    assert features.shapes == {"layer3": (256, 2, 2), "layer4": (512, 1, 1)}
    assert features.dtypes == {"layer3": np.float16, "layer4": np.float16}
    assert len(features) == features.num_samples == N and features.chunk_size == CHUNK
    assert features.complete and features.present.all() and features.valid.all()
    assert features.labels.tolist() == [i % 10 for i in range(N)]
    assert features.attrs["model"] == "resnet18" and features.attrs["job"]["weights"] == "none"
    assert features.array("layer3").shape == (N, 256, 2, 2)
    assert "layer3 [256, 2, 2] float16" in repr(features)


def test_load_any_index_equals_zarr(store, raw):
    features = open_features(store)
    expected = raw["layer3"].astype(np.float32)
    full = features.load("layer3")
    assert full.dtype == np.float32 and np.array_equal(full, expected)
    assert np.array_equal(features.load("layer3", slice(5, 27)), expected[5:27])
    assert np.array_equal(features.load("layer3", slice(None, None, -3)), expected[::-3])
    unsorted = [33, 2, 2, -1, 17, 8, 9]
    assert np.array_equal(features.load("layer3", unsorted), expected[unsorted])
    mask = np.arange(N) % 3 == 0
    assert np.array_equal(features.load("layer3", mask), expected[mask])
    assert np.array_equal(features.load("layer3", np.array([], dtype=int)), expected[:0])
    for row in range(N):  # one row, also the first of a block (it read nothing, leaving np.empty's bytes)
        assert np.array_equal(features.load("layer3", [row]), expected[[row]]), row
    stored = features.load("layer4", [1, 2], dtype=None, as_torch=True)
    assert isinstance(stored, torch.Tensor) and stored.dtype == torch.float16
    assert np.array_equal(stored.numpy(), raw["layer4"][[1, 2]])
    with pytest.raises(IndexError, match="out of range") as error:
        features.load("layer3", [N])
    assert isinstance(error.value, SampleIndexError)
    with pytest.raises(IndexError, match="needs shape"):
        features.load("layer3", np.ones(N + 1, bool))


def test_load_pools_like_extraction(store, raw):
    features = open_features(store)
    values = raw["layer3"].astype(np.float32)
    np.testing.assert_allclose(features.load("layer3", pool="avg"), values.mean(axis=(2, 3)), rtol=1e-6)
    np.testing.assert_array_equal(features.load("layer3", [4, 30], pool="max"), values[[4, 30]].max(axis=(2, 3)))
    assert features.load("layer3", pool="avg:1", as_torch=True).shape == (N, 256, 1, 1)
    with pytest.raises(
        ValueError, match=r"load\('layer3', pool='cls'\) needs \(B, T, D\) outputs.*use pool='avg' or pool='max'"
    ):
        features.load("layer3", pool="cls")


def test_token_pools(tmp_path):
    path = extract_store(tmp_path / "vit.zarr", "--model", f"{TINY}:tiny_vit", "--layers", "encoder.layers.*")
    features = open_features(path)
    layer = "encoder.layers.encoder_layer_1"
    tokens = zarr.open_group(path, mode="r")[f"features/{layer}"][:].astype(np.float32)
    assert features.shapes[layer] == tokens.shape[1:] and tokens.ndim == 3
    np.testing.assert_array_equal(features.load(layer, pool="cls"), tokens[:, 0])
    np.testing.assert_allclose(features.load(layer, pool="mean"), tokens.mean(axis=1), rtol=1e-5, atol=1e-6)


def test_sorted_index_reads_each_chunk_once(store, monkeypatch):
    fetched = []
    original = zarr.storage.LocalStore.get

    async def counting_get(self, key, *args, **kwargs):
        fetched.append(key)
        return await original(self, key, *args, **kwargs)

    features = open_features(store)
    features.array("layer3")  # metadata read before counting
    monkeypatch.setattr(zarr.storage.LocalStore, "get", counting_get)
    features.load("layer3", [0, 1, 2, 7, 9, 10, 33])
    chunks = sorted(key for key in fetched if key.startswith("features/") and "/c/" in key)
    assert chunks == ["features/layer3/c/0/0/0/0", "features/layer3/c/1/0/0/0", "features/layer3/c/4/0/0/0"]


def test_errors_name_the_problem(store, tmp_path):
    with pytest.raises(KeyError, match="has no layer 'layer5'; it has layer3, layer4") as error:
        open_features(store).load("layer5")
    assert isinstance(error.value, LayerNotFoundError) and str(error.value).startswith(f"{store} has no layer")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExtractError, match="not an extract store") as error:
        open_features(tmp_path / "empty")
    assert not isinstance(error.value, FileNotFoundError)  # it is there, and it is something else
    with pytest.raises(FileNotFoundError, match="not an extract store") as error:
        open_features(tmp_path / "absent.zarr")
    assert isinstance(error.value, StoreNotFoundError)


def test_partial_store_refused_unless_asked(partial, raw):
    with pytest.raises(ExtractError, match=r"not complete \(status 'running', 4 of 5 chunks.*allow_partial=True"):
        open_features(partial)
    features = open_features(partial, allow_partial=True)
    assert not features.complete
    assert features.present.tolist() == [not CHUNK <= i < 2 * CHUNK for i in range(N)]
    assert np.array_equal(features.valid, features.present)
    present = features.load("layer4", features.present)
    assert np.array_equal(present, raw["layer4"][features.present].astype(np.float32))
    assert np.isnan(features.load("layer4", slice(CHUNK, 2 * CHUNK))).all()


def test_xarray_opens_layers_with_named_dims(store, raw):
    ds = xr.open_zarr(store, group="features", consolidated=False)
    assert set(ds.data_vars) == {"layer3", "layer4"}
    assert ds["layer3"].dims == ("sample", "layer3.channel", "layer3.height", "layer3.width")
    assert ds["layer4"].dims == ("sample", "layer4.channel", "layer4.height", "layer4.width")
    assert ds.sizes["sample"] == N and ds["layer3"].dtype == np.float16
    np.testing.assert_array_equal(ds["layer3"].values, raw["layer3"])
    pooled = ds["layer3"].astype("float32").mean(["layer3.height", "layer3.width"])
    np.testing.assert_allclose(pooled.values, raw["layer3"].astype(np.float32).mean(axis=(2, 3)), rtol=1e-6)
    # labels live beside the features group; attach them as a coordinate
    labeled = ds.assign_coords(label=("sample", open_features(store).labels))
    assert labeled["layer4"].sel(sample=labeled.label == 3).sizes["sample"] == N // 10
    # or the whole store as a tree: labels and done at the root, the layers under /features
    tree = xr.open_datatree(store, engine="zarr", consolidated=False)
    assert tree["labels"].dtype == np.int64 and tree["labels"].values.tolist() == [i % 10 for i in range(N)]
    assert tree["features"]["layer4"].dims == ds["layer4"].dims and tree.attrs["status"] == "complete"


def test_dataset_items_equal_store(store, raw):
    one = FeatureDataset(store, "layer3", pool="avg")
    values, label = one[13]
    assert isinstance(values, torch.Tensor) and values.dtype == torch.float32 and values.shape == (256,)
    np.testing.assert_allclose(values.numpy(), raw["layer3"][13].astype(np.float32).mean(axis=(1, 2)), rtol=1e-6)
    assert label == 3
    both = FeatureDataset(store, ["layer3", "layer4"])
    values, label = both[-1]
    assert set(values) == {"layer3", "layer4"} and label == (N - 1) % 10
    assert np.array_equal(values["layer3"].numpy(), raw["layer3"][-1].astype(np.float32))
    assert np.array_equal(values["layer4"].numpy(), raw["layer4"][-1].astype(np.float32))
    with pytest.raises(ExtractError, match="no layer 'fc'"):
        FeatureDataset(store, ["layer3", "fc"])


def test_sampler_epoch_covers_each_index_once_and_reads_each_chunk_once(store, raw):
    dataset = FeatureDataset(store, "layer4")
    sampler = ChunkShuffleSampler(len(dataset), dataset.chunk_size, batch_size=3, seed=7)
    orders = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        before = dataset.chunk_reads
        seen, labels = [], []
        for values, label in DataLoader(dataset, batch_sampler=sampler):
            seen.append(values)
            labels.append(label)
        order = [i for batch in sampler for i in batch]
        assert sorted(order) == list(range(N)) and order != list(range(N))
        # each chunk once; the next epoch may start with the chunk still cached from the last one
        assert dataset.chunk_reads - before in (N // CHUNK - epoch, N // CHUNK)
        assert np.array_equal(torch.cat(seen).numpy(), raw["layer4"][order].astype(np.float32))
        assert torch.cat(labels).tolist() == [i % 10 for i in order]
        orders.append(order)
    assert orders[0] != orders[1]
    sampler.set_epoch(0)
    assert [i for batch in sampler for i in batch] == orders[0]
    assert len(sampler) == len(list(sampler))


class ReadLoggingDataset(FeatureDataset):
    """Appends each chunk read to a file, to count reads made inside DataLoader workers."""

    log = None

    def _read_chunk(self, chunk):
        with open(self.log, "a") as f:
            f.write(f"{chunk}\n")
        return super()._read_chunk(chunk)


def test_two_workers_cover_every_index_and_read_each_chunk_about_once(store, raw, tmp_path):
    dataset = ReadLoggingDataset(store, ["layer3", "layer4"])
    dataset.log = tmp_path / "reads.txt"
    sampler = ChunkShuffleSampler(len(dataset), dataset.chunk_size, batch_size=4, num_workers=2, seed=1)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    batches = list(loader)
    order = [i for batch in sampler for i in batch]
    assert sorted(order) == list(range(N))
    assert np.array_equal(torch.cat([b[0]["layer3"] for b in batches]).numpy(), raw["layer3"][order].astype(np.float32))
    assert torch.cat([b[1] for b in batches]).tolist() == [i % 10 for i in order]
    reads = dataset.log.read_text().split()
    assert sorted(set(reads)) == [str(k) for k in range(N // CHUNK)]
    assert len(reads) <= N // CHUNK + 1  # only the uneven end of the two streams may repeat a chunk


def test_window_mixes_several_chunks_per_batch_and_still_reads_each_once(store, raw):
    dataset = FeatureDataset(store, "layer4", cache_chunks=3)
    sampler = ChunkShuffleSampler(len(dataset), dataset.chunk_size, batch_size=6, window=3, seed=2)
    batches = list(sampler)
    order = [i for batch in batches for i in batch]
    assert sorted(order) == list(range(N))
    chunks_per_batch = [len({i // CHUNK for i in batch}) for batch in batches]
    assert max(chunks_per_batch) >= 3  # a one-chunk window could never mix more than 2 chunks in a batch of 6
    values = torch.cat([v for v, _ in DataLoader(dataset, batch_sampler=sampler)])
    assert dataset.chunk_reads == -(-N // CHUNK)
    assert np.array_equal(values.numpy(), raw["layer4"][order].astype(np.float32))


def test_a_layer_pooled_at_extraction_says_so_in_the_apis_terms(tmp_path):
    """avg:K stores a (C, K, K) map: the reader pools it further along the axes its dimension names give,
    also where the store does not record its layout (stores written before it did); a layer pooled to
    (C,) is refused with a ValueError that speaks of pool=, not of --pool."""
    path = extract_store(tmp_path / "pooled.zarr", "--model", "resnet18", "--weights", "none", "--layers", "layer3",
                         "layer4", "--pool", "layer3=avg:2", "layer4=avg")  # fmt: skip
    group = zarr.open_group(path, mode="r+")
    group.attrs["layouts"] = {"layer3": None, "layer4": None}  # as stores written before this recorded them
    features = open_features(path)
    assert features.layout("layer3") == "NCHW" and features.layout("layer4") is None
    stored = group["features/layer3"][:].astype(np.float32)
    np.testing.assert_allclose(features.load("layer3", pool="avg"), stored.mean(axis=(2, 3)), rtol=1e-6)
    with pytest.raises(
        ValueError, match=r"layer4 is stored as \(512\) per sample \(pooled with avg at extraction\); use pool=None"
    ) as error:
        features.load("layer4", pool="avg")
    assert "--pool" not in str(error.value)
    # a dataset is refused when it is made, in the main process, not at its first item in a worker
    with pytest.raises(
        PoolMismatchError, match=r"FeatureDataset\(\.\.\., 'layer4', pool='avg'\) needs .* use pool=None"
    ):
        FeatureDataset(path, ["layer3", "layer4"], pool="avg")
    assert FeatureDataset(path, "layer4")[0][0].shape == (512,)  # read as stored: pooled already


def test_dataset_pools_per_layer(store, raw):
    both = FeatureDataset(store, ["layer3", "layer4"], pool={"layer3": "avg"})
    values, _ = both[5]
    np.testing.assert_allclose(
        values["layer3"].numpy(), raw["layer3"][5].astype(np.float32).mean(axis=(1, 2)), rtol=1e-6
    )
    assert np.array_equal(values["layer4"].numpy(), raw["layer4"][5].astype(np.float32))
    with pytest.raises(ValueError, match="layer5"):
        FeatureDataset(store, ["layer3"], pool={"layer5": "avg"})


def test_a_partial_dataset_serves_the_labels_of_chunks_written_after_it_was_made(store, partial):
    target = zarr.open_group(partial, mode="r+")
    target["labels"][CHUNK : 2 * CHUNK] = -1  # as an interrupted job leaves the chunk it never wrote
    dataset = FeatureDataset(partial, "layer4", allow_partial=True)
    assert dataset[0][1] == 0 and dataset[CHUNK][1] == -1
    source = zarr.open_group(store, mode="r")
    for name in ("features/layer3", "features/layer4", "labels"):  # the job resumes and writes chunk 1
        target[name][CHUNK : 2 * CHUNK] = source[name][CHUNK : 2 * CHUNK]
    target["done"][1] = True
    dataset._cache.clear()  # the chunk read while unwritten is no longer cached (window moved on)
    assert [dataset[i][1] for i in range(CHUNK, 2 * CHUNK)] == source["labels"][CHUNK : 2 * CHUNK].tolist()


def test_a_packed_store_names_its_samples_contexts(tmp_path):
    """``--pack T``: the rows of ``offsets`` are contexts of T tokens, not documents; the documents are
    those packed into them (one key each)."""
    from helpers.text_models import real_documents, save_text_model, write_jsonl

    documents = real_documents(12)
    write_jsonl(tmp_path / "docs.jsonl", documents)
    model = save_text_model("gpt2", tmp_path / "gpt2")
    out = tmp_path / "packed.zarr"
    assert main(["--model", f"hf:{model}", "--layers", "transformer.h.0", "--data", f"text:{tmp_path / 'docs.jsonl'}",
                 "--pack", "48", "--out", str(out)]) == 0  # fmt: skip
    f = open_features(out)
    contexts = f.num_samples // 48
    assert f.text.num_contexts == contexts == f.pack["contexts"] == len(f.text.offsets) - 1
    assert f.text.num_source_documents == len(documents) == len(f.keys)
    with pytest.warns(DeprecationWarning, match=r"use features\.text\."):  # the old names: the view's, warning
        assert f.num_contexts == f.text.num_contexts and f.num_source_documents == f.text.num_source_documents
    assert f"{f.num_samples} tokens in {contexts} contexts of 48, from {len(documents)} documents" in repr(f)
    assert "num_contexts" in type(f.text).num_documents.__doc__  # the old name says what it counts here
