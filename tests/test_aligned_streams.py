"""Issue 31, ``TokenStream`` over several sources. Crosscoder reads: two GPT-2-shaped models of different
seeds and one tokenizer, each extracted by 2 processes with ``--pack 64``, read side by side: every row
pair is the two stores' rows of the same token (checked with ``return_index`` against each store read
directly), every kept token comes once per epoch, also over 2 ranks x 2 DataLoader workers; stores of
another tokenizer, packing or chunking, or with one token id changed, are refused in one line naming
the first difference. Vision patches: a timm ViT's blocks (``--pool none``) and its patch embedding (an
NCHW map) stream as (image, patch) rows: one epoch is the multiset of the store's rows of its valid
images, less each image's CLS with ``first:1``; ``return_index`` pairs index the stored array; the
per-position statistics, ``FeatureDataset(rows="patches")`` and the SAELens export agree with numpy."""

import re
import shutil
from collections import Counter

import numpy as np
import pytest
import torch
import zarr
from helpers.data_files import make_png_tree
from helpers.launches import Sequence
from helpers.stats_reference import assert_close_to_float64
from helpers.text_models import real_documents, save_text_model, write_jsonl
from torch.utils.data import DataLoader

from extract import ChunkShuffleSampler, FeatureDataset, TokenStream, open_features
from extract.cli.extract import main as extract_main
from extract.errors import ExcludeRuleError, ExtractError, UnalignedStoresError
from extract.read.tokens import NORM_SAMPLE_CHUNKS

LAYERS = ["transformer.h.0", "transformer.h.2"]
CHUNK = 64


@pytest.fixture(scope="module")
def text_stores(tmp_path_factory):
    """One launch of 2 processes runs every job: GPT-2s of seeds 0 and 1 (one tokenizer) packed in contexts
    of 64, the seed-0 model packed in 32 and in chunks of 128, and a Llama (another tokenizer)."""
    root = tmp_path_factory.mktemp("aligned")
    data = write_jsonl(root / "docs.jsonl", real_documents(20))
    models = {
        "a": save_text_model("gpt2", root / "gpt2-0", seed=0),
        "b": save_text_model("gpt2", root / "gpt2-1", seed=1),
        "llama": save_text_model("llama", root / "llama"),
    }

    def job(model, out, pack="64", chunk=CHUNK):
        return [
            "--model", f"hf:{models[model]}", "--layers", *(LAYERS if model != "llama" else ["model.layers.0"]),
            "--data", f"text:{data}", "--dtype", "float16", "--pack", pack, "--chunk-size", str(chunk),
            "--tokens-per-batch", "256", "--out", root / f"{out}.zarr",
        ]  # fmt: skip

    jobs = {
        "a": job("a", "a"),
        "b": job("b", "b"),
        "pack32": job("a", "pack32", pack="32"),
        "chunk128": job("a", "chunk128", chunk=128),
        "llama": job("llama", "llama"),
    }
    sequence = Sequence(2, jobs, root)
    finished = sequence.run(timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    for name in jobs:
        assert sequence.result(name).codes == [0, 0], sequence.result(name).stderr[-3000:]
    return {name: root / f"{name}.zarr" for name in jobs}


def stored(path, layers=LAYERS) -> dict[str, np.ndarray]:
    f = open_features(path)
    return {layer: f.load(layer, dtype=None) for layer in layers}


def test_the_two_runs_hold_the_same_tokens_in_two_processes_each(text_stores):
    a, b = open_features(text_stores["a"]), open_features(text_stores["b"])
    assert a.attrs["runs"][-1]["world_size"] == b.attrs["runs"][-1]["world_size"] == 2
    assert a.num_chunks > 40 and np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.offsets, b.offsets)
    for layer in LAYERS:  # other weights: pairing the wrong rows would show
        assert not np.allclose(a.load(layer), b.load(layer), atol=1e-2)


@pytest.mark.parametrize("exclude", [(), ("special", "first:2")])
def test_every_row_pair_is_one_token_of_both_stores_once_per_epoch(text_stores, exclude):
    a, b = stored(text_stores["a"]), stored(text_stores["b"])
    f = open_features(text_stores["a"])
    stream = TokenStream([text_stores["a"], text_stores["b"]], LAYERS, 100, window=3, exclude=exclude,
                         return_index=True, seed=5, dtype="float16")  # fmt: skip
    got = []
    for values, rows in stream:
        rows = rows.numpy()
        assert rows.shape == (len(rows),) and sorted(values) == [(0, LAYERS[0]), (0, LAYERS[1]), (1, LAYERS[0]),
                                                                  (1, LAYERS[1])]  # fmt: skip
        for layer in LAYERS:
            np.testing.assert_array_equal(values[(0, layer)].numpy(), a[layer][rows])
            np.testing.assert_array_equal(values[(1, layer)].numpy(), b[layer][rows])
        got.append(rows)
    rows = np.concatenate(got)
    position = np.arange(f.num_samples) - np.repeat(f.offsets[:-1], np.diff(f.offsets))
    keep = np.ones(f.num_samples, dtype=bool)
    if exclude:
        keep = ~f.special & (position >= 2)
        assert keep.sum() < f.num_samples - f.num_contexts
    assert Counter(rows.tolist()) == Counter(np.flatnonzero(keep).tolist())


def test_stacked_batches_are_sources_store_by_store(text_stores):
    a, b = stored(text_stores["a"]), stored(text_stores["b"])
    stream = TokenStream([text_stores["a"], text_stores["b"]], LAYERS, 64, return_index=True, stack=True)
    count = 0
    for values, rows in stream:
        rows = rows.numpy()
        assert values.shape == (len(rows), 4, 32) and values.dtype == torch.float32
        expected = np.stack([a[LAYERS[0]], a[LAYERS[1]], b[LAYERS[0]], b[LAYERS[1]]], axis=1)[rows]
        np.testing.assert_array_equal(values.numpy(), expected.astype(np.float32))
        count += len(rows)
    assert count == open_features(text_stores["a"]).num_samples
    # one layer per store, named per store; high_norm's medians are per source
    per_store = TokenStream([text_stores["a"], text_stores["b"]], [[LAYERS[0]], [LAYERS[1]]], 64,
                            exclude="high_norm:1.5", stack=True)  # fmt: skip
    assert sorted(per_store.median_norms) == [(0, LAYERS[0]), (1, LAYERS[1])]
    f = open_features(text_stores["b"])
    assert f.num_chunks > NORM_SAMPLE_CHUNKS  # the median of the rows of 32 chunks drawn with seed 0
    drawn = np.random.default_rng(0).choice(f.num_chunks, NORM_SAMPLE_CHUNKS, replace=False)
    sampled = np.isin(np.arange(f.num_samples) // CHUNK, drawn)
    expected = np.median(np.linalg.norm(b[LAYERS[1]][sampled].astype(np.float32), axis=1))
    assert per_store.median_norms[(1, LAYERS[1])] == pytest.approx(expected, rel=1e-5)
    assert next(iter(per_store)).shape == (64, 2, 32)


def test_two_ranks_of_two_workers_read_each_token_once(text_stores):
    f = open_features(text_stores["a"])
    a, b = stored(text_stores["a"], [LAYERS[1]]), stored(text_stores["b"], [LAYERS[1]])
    per_rank = []
    for rank in (0, 1):
        stream = TokenStream([text_stores["a"], text_stores["b"]], LAYERS[1], 50, rank=rank, world_size=2,
                             return_index=True, stack=True, window=2)  # fmt: skip
        rows = []
        for values, index in DataLoader(stream, batch_size=None, num_workers=2):
            index = index.numpy()
            np.testing.assert_array_equal(values[:, 0].numpy(), a[LAYERS[1]][index].astype(np.float32))
            np.testing.assert_array_equal(values[:, 1].numpy(), b[LAYERS[1]][index].astype(np.float32))
            rows.append(index)
        rows = np.concatenate(rows)
        order = np.random.default_rng((0, 0)).permutation(f.num_chunks)  # the chunks are the rank's
        assert set((rows // CHUNK).tolist()) == set(order[rank::2].tolist())
        per_rank.append(rows)
    every = np.concatenate(per_rank)
    assert len(every) == f.num_samples and np.array_equal(np.sort(every), np.arange(f.num_samples))


@pytest.mark.parametrize(
    ("other", "difference"),
    [
        ("llama", r"another tokenizer \(sha256 [0-9a-f]{12} vs [0-9a-f]{12}\)"),
        ("pack32", r"--pack 64 vs --pack 32"),
        ("chunk128", r"chunks of 64 tokens vs 128 \(--chunk-size\)"),
    ],
)
def test_stores_of_other_tokens_are_refused_in_one_line(text_stores, other, difference):
    with pytest.raises(UnalignedStoresError) as caught:
        TokenStream([text_stores["a"], text_stores[other]], LAYERS[0], 8)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError) and "\n" not in message
    assert f"{text_stores[other]} does not hold the tokens of {text_stores['a']}: " in message
    assert re.search(difference, message) and "same tokenizer, --pack and --chunk-size" in message


def test_one_changed_token_id_is_found_by_its_chunk_checksum(text_stores, tmp_path):
    changed = tmp_path / "changed.zarr"
    shutil.copytree(text_stores["b"], changed)
    ids = zarr.open_group(changed, mode="r+")["token_ids"]
    token = 7 * CHUNK + 13
    was = int(ids[token])
    ids[token] = was + 1  # through zarr: a valid object with its own checksum, other bytes
    # ... and recorded as the chunk's (a store that holds other tokens, not a damaged one: issue 45's place
    # check would name the object otherwise)
    group = zarr.open_group(changed, mode="r+")
    digests, column = group["digests"], list(group["digests"].attrs["arrays"]).index("token_ids")
    row = digests[7]
    row[column] = int.from_bytes((changed / "token_ids" / "c" / "7").read_bytes()[-4:], "little")
    digests[7] = row
    with pytest.raises(UnalignedStoresError, match=rf": token {token} \(chunk 7\) has token_ids {was} vs {was + 1};"):
        TokenStream([text_stores["a"], changed], LAYERS[0], 8)


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    """A random-weight timm ViT on 13 images of 48 px (3 x 3 patches and CLS), one of them undecodable and
    skipped: blocks.1 and blocks.3 kept whole (10 tokens of 192), the patch embedding's NCHW map (192, 3, 3)."""
    root = tmp_path_factory.mktemp("vit")
    make_png_tree(root / "images", {"a": 7, "b": 6})
    (root / "images" / "b" / "002.png").write_bytes(b"not an image")
    out = root / "vit.zarr"
    assert extract_main([
        "--model", "timm:vit_tiny_patch16_224", "--weights", "none", "--layers", "blocks.1", "blocks.3",
        "patch_embed.proj", "--pool", "none", "--data", f"imagefolder:{root / 'images'}", "--image-size", "48",
        "--chunk-size", "4", "--batch-size", "4", "--num-workers", "0", "--skip-bad-images", "--out", str(out),
    ]) == 0  # fmt: skip
    return out


def test_vit_store_records_its_layouts(vit):
    f = open_features(vit)
    assert f.shapes == {"blocks.1": (10, 192), "blocks.3": (10, 192), "patch_embed.proj": (192, 3, 3)}
    assert {layer: f.layout(layer) for layer in f.layers} == {
        "blocks.1": "NLC", "blocks.3": "NLC", "patch_embed.proj": "NCHW"
    }  # fmt: skip
    assert f.valid.sum() == 12 and np.isnan(f.load("blocks.1")[~f.valid]).all()


@pytest.mark.parametrize(
    ("layers", "exclude", "positions"),
    [("blocks.1", "first:1", 10), (["blocks.1", "blocks.3"], (), 10), ("patch_embed.proj", "first:2", 9)],
)
def test_an_epoch_is_the_valid_images_patches_once(vit, layers, exclude, positions):
    f = open_features(vit)
    names = [layers] if isinstance(layers, str) else layers
    # the stored array, its positions as rows: NLC as stored; NCHW channels last, patch h * 3 + w
    arrays = {layer: f.load(layer, dtype=None) for layer in names}
    arrays = {k: v.transpose(0, 2, 3, 1).reshape(len(v), -1, 192) if v.ndim == 4 else v for k, v in arrays.items()}
    stream = TokenStream(vit, layers, 16, window=2, exclude=exclude, return_index=True, threads=1)
    pairs = []
    for values, index in stream:
        assert index.dtype == torch.int64 and index.shape == (len(index), 2)
        image, patch = index.numpy().T
        for layer in names:
            value = values if isinstance(layers, str) else values[layer]
            np.testing.assert_array_equal(value.numpy(), arrays[layer][image, patch].astype(np.float32))
        pairs += list(zip(image.tolist(), patch.tolist(), strict=True))
    first = int(exclude.partition(":")[2]) if exclude else 0
    expected = [(i, p) for i in np.flatnonzero(f.valid).tolist() for p in range(first, positions)]
    assert Counter(pairs) == Counter(expected)


def test_patch_streams_with_ranks_workers_and_stack(vit):
    f = open_features(vit)
    blocks = np.stack([f.load("blocks.1"), f.load("blocks.3")], axis=2)  # (N, 10, 2, 192)
    every = []
    for rank in (0, 1):
        # float16 as stored: zarr decodes each layer straight into its column of the stacked window
        stream = TokenStream(vit, ["blocks.1", "blocks.3"], 7, rank=rank, world_size=2, stack=True, dtype="float16",
                             exclude=["first:1", "high_norm:1.1"], return_index=True, window=1)  # fmt: skip
        for values, index in DataLoader(stream, batch_size=None, num_workers=2):
            image, patch = index.numpy().T
            assert values.dtype == torch.float16 and values.shape == (len(image), 2, 192)
            np.testing.assert_array_equal(values.float().numpy(), blocks[image, patch])
            every += list(zip(image.tolist(), patch.tolist(), strict=True))
    assert len(every) == len(set(every))
    # high_norm, by numpy: over 1.1 x the median norm (of the rows first:1 keeps) in either layer
    norms = np.linalg.norm(blocks[f.valid][:, 1:].reshape(-1, 2, 192), axis=2)
    kept = (norms <= 1.1 * np.median(norms, axis=0)).all(axis=1)
    assert 0 < (~kept).sum() and len(every) == kept.sum()


def test_patch_layers_are_refused_where_they_do_not_fit(vit):
    with pytest.raises(ExtractError, match=r"different numbers of patches per image .*'blocks.1': 10.*: 9"):
        TokenStream(vit, ["blocks.1", "patch_embed.proj"], 8)
    with pytest.raises(ExcludeRuleError, match=r"is an image store, which has no special tokens; use 'first:K'"):
        TokenStream(vit, "blocks.1", 8, exclude="special")
    with pytest.raises(UnalignedStoresError, match=r"is a store of kind 'images', not of tokens"):
        TokenStream([vit, vit], "blocks.1", 8)


def test_per_position_statistics_equal_numpy(vit):
    f = open_features(vit)
    for layer in f.layers:
        values = f.load(layer, dtype=None).astype(np.float64)
        rows = (values.transpose(0, 2, 3, 1) if values.ndim == 4 else values).reshape(-1, 192)
        rows = rows[~np.isnan(rows).any(axis=1)]
        got = f.stats(layer)
        assert got["count"] == len(rows) == 12 * (10 if values.ndim == 3 else 9)  # the valid images' patches
        # the contract's float32 blocks (docs/store-format.md): within their bound of float64's
        assert_close_to_float64(got, rows)
        assert got["max_abs"] == np.abs(rows).max() and got["mean"].shape == (192,)


def test_feature_dataset_reads_patch_rows(vit):
    f = open_features(vit)
    dataset = FeatureDataset(vit, ["blocks.3", "blocks.1"], rows="patches", cache_chunks=2)
    assert len(dataset) == 13 * 10 and dataset.positions == 10 and dataset.chunk_rows == 40
    blocks = f.load("blocks.3")
    for index in (0, 11, 57, 129):
        values, label = dataset[index]
        image, patch = divmod(index, 10)
        np.testing.assert_array_equal(values["blocks.3"].numpy(), blocks[image, patch])
        assert label == f.labels[image]
    maps = FeatureDataset(vit, "patch_embed.proj", rows="patches")
    conv = f.load("patch_embed.proj")
    values, _ = maps[4 * 9 + 5]  # image 4, patch (1, 2)
    np.testing.assert_array_equal(values.numpy(), conv[4, :, 1, 2])
    no_cls = np.arange(len(dataset)) % dataset.positions >= 1
    sampler = ChunkShuffleSampler(len(dataset), dataset.chunk_rows, 32, window=2, subset=no_cls)
    seen = [i for batch in sampler for i in batch]
    assert sorted(seen) == np.flatnonzero(no_cls).tolist()
    with pytest.raises(ValueError, match="rows='patches' reads each patch's row: leave pool=None"):
        FeatureDataset(vit, "blocks.1", rows="patches", pool="cls")


def test_saelens_export_of_patches(vit, tmp_path):
    datasets = pytest.importorskip("datasets")
    from extract.analysis.export import export_saelens

    f = open_features(vit)
    cache = export_saelens(vit, tmp_path / "cache", "blocks.3", hook_name="blocks.3.hook_resid_post")
    assert (cache.contexts, cache.context_size, cache.d_in) == (12, 10, 192)  # the valid images, CLS included
    ds = datasets.load_from_disk(str(cache.path))
    # SAELens's cache features (sae_lens CacheActivationsRunner) without token_ids, which ActivationsStore
    # reads only when the column is there
    assert ds.features == datasets.Features(
        {"blocks.3.hook_resid_post": datasets.Array2D(shape=(10, 192), dtype="float16")}
    )
    exported = ds.with_format("numpy")["blocks.3.hook_resid_post"][:]
    np.testing.assert_array_equal(exported, f.load("blocks.3", dtype=None)[f.valid])
    assert cache.scaling_factor == pytest.approx(f.stats("blocks.3")["scaling_factor"])
