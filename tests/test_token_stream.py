"""Issue 19, ``TokenStream``: shuffled batches of a token store's rows. Against numpy over the stored
arrays: every kept token exactly once per epoch (as (context, position) pairs), with ranks and DataLoader
workers partitioning them; each exclude rule; the values equal ``Features.load``; batches mix the
contexts of their window; epochs reshuffle deterministically; bad rules, image stores and unknown
layers are refused in one line."""

import shutil
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from helpers.stores import array_store
from helpers.text_models import real_documents, save_text_model, write_jsonl
from torch.utils.data import DataLoader

from extract import TokenStream, open_features
from extract.cli.extract import main as extract_main
from extract.errors import ExtractError, LayerNotFoundError, StoreDamagedError
from extract.read import tokens as token_module
from extract.read.features import Features
from extract.read.tokens import ExcludeRuleError

LAYERS = ["transformer.h.0", "hidden_states.2"]
CHUNK = 64


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A packed store (contexts of 32 tokens, each starting with BOS; 2 layers) and a ragged one (documents
    of their own lengths, up to 64), both in chunks of 64 tokens, so there are many chunks."""
    root = tmp_path_factory.mktemp("stream")
    data = write_jsonl(root / "docs.jsonl", real_documents(40))
    model = save_text_model("gpt2", root / "gpt2")
    common = ["--model", f"hf:{model}", "--data", f"text:{data}", "--chunk-size", str(CHUNK), "--dtype", "float16"]
    packed, ragged = root / "packed.zarr", root / "ragged.zarr"
    assert (
        extract_main([*common, "--layers", *LAYERS, "--pack", "32", "--context-length", "32", "--out", str(packed)])
        == 0
    )
    assert extract_main([*common, "--layers", LAYERS[0], "--context-length", "64", "--out", str(ragged)]) == 0
    return {"packed": packed, "ragged": ragged}


def epoch_rows(stream, **loader) -> list[np.ndarray]:
    """The rows of every batch of one epoch, in order (through a DataLoader when ``loader`` says so)."""
    batches = DataLoader(stream, batch_size=None, **loader) if loader else stream
    return [rows.numpy() for _, rows in batches]


def pairs(f, rows: np.ndarray) -> Counter:
    """The multiset of (context or document, position) of ``rows``, by the reader's own maps."""
    docs = f.text.documents_of(rows)
    return Counter(zip(docs.tolist(), (rows - f.text.offsets[docs]).tolist(), strict=True))


def numpy_kept(f, exclude, layers) -> np.ndarray:
    """The rows ``exclude`` keeps, computed independently: numpy over the stored arrays, norms in float64."""
    lengths = np.diff(f.text.offsets)
    position = np.concatenate([np.arange(n) for n in lengths])
    keep = np.ones(f.num_samples, dtype=bool)
    for rule in exclude:
        name, _, value = rule.partition(":")
        if name == "special":
            keep &= ~f.text.special
        elif name == "first":
            keep &= position >= int(value)
    for rule in exclude:
        if rule.startswith("high_norm:"):
            chunks = np.arange(f.num_chunks)
            if f.num_chunks > token_module.NORM_SAMPLE_CHUNKS:
                chunks = np.random.default_rng(0).choice(f.num_chunks, token_module.NORM_SAMPLE_CHUNKS, replace=False)
            sampled = np.isin(np.arange(f.num_samples) // f.chunk_size, chunks) & keep
            over = np.zeros(f.num_samples, dtype=bool)
            for layer in layers:
                norms = np.linalg.norm(f.load(layer, dtype="float64"), axis=1)
                over |= norms > float(rule.partition(":")[2]) * np.median(norms[sampled])
            keep &= ~over
    return np.flatnonzero(keep)


CASES = [
    ("packed", (), LAYERS[0]),
    ("packed", ("special",), LAYERS),
    ("packed", ("special", "first:3"), LAYERS[1]),
    ("ragged", ("first:5",), LAYERS[0]),
    ("ragged", ("high_norm:1.3",), LAYERS[0]),  # 31 chunks: the median of the whole store
    ("packed", ("special", "high_norm:1.2"), LAYERS),  # 106 chunks: of 32 drawn; a row over in either layer goes
]


@pytest.mark.parametrize(("name", "exclude", "layers"), CASES)
def test_every_kept_token_once_per_epoch_with_the_stored_values(stores, name, exclude, layers):
    f = open_features(stores[name])
    stream = TokenStream(stores[name], layers, 48, window=4, exclude=exclude, return_index=True, seed=3)
    expected = numpy_kept(f, exclude, layers if isinstance(layers, list) else [layers])
    assert 0 < len(expected) < f.num_samples or not exclude
    got = []
    stored = {layer: f.load(layer) for layer in LAYERS if layer in f.layers}
    for values, rows in stream:
        assert rows.dtype == torch.int64
        for layer in layers if isinstance(layers, list) else [layers]:
            value = values[layer] if isinstance(layers, list) else values
            assert value.dtype == torch.float32 and value.shape == (len(rows), f.shapes[layer][0])
            np.testing.assert_array_equal(value.numpy(), stored[layer][rows.numpy()])
        got.append(rows.numpy())
    assert all(len(rows) == 48 for rows in got[:-1]) and 0 < len(got[-1]) <= 48
    rows = np.concatenate(got)
    assert pairs(f, rows) == pairs(f, expected)  # each (context, position) once: no repeats, none missing
    if "special" in exclude:
        assert f.text.special.sum() > 100 and not f.text.special[rows].any()


def test_drop_last_and_output_dtypes(stores):
    f = open_features(stores["packed"])
    stored = f.load(LAYERS[0], dtype=None)
    for dtype, threads in (("float16", 0), ("bfloat16", 2), ("float64", 1)):
        stream = TokenStream(
            stores["packed"], LAYERS[0], 100, drop_last=True, dtype=dtype, threads=threads, return_index=True
        )
        for epoch in (0, 1):  # the second pass reads into the first one's buffers
            stream.set_epoch(epoch)
            batches = list(stream)
            assert [len(rows) for _, rows in batches] == [100] * (f.num_samples // 100)
            for values, rows in batches[:3] + batches[-3:]:
                assert values.dtype == getattr(torch, dtype)
                assert torch.equal(values, torch.from_numpy(stored[rows.numpy()]).to(getattr(torch, dtype)))


def test_batches_mix_the_contexts_of_their_window(stores):
    """A window of 8 full chunks is 512 rows, 16 contexts of 32; a batch of 64 draws from all of them, so
    by chance it touches about 15.7 of the 16 (one context's run would be 1 or 2, a chunk's 2). Nothing is
    excluded, so the batches are the windows' rows in turn: a batch within one window is that window's."""
    f = open_features(stores["packed"])
    stream = TokenStream(stores["packed"], LAYERS[0], 64, window=8, return_index=True)
    chunks = stream.chunks()
    windows = [chunks[i : i + 8] for i in range(0, len(chunks), 8)]
    edges = np.cumsum([sum(min(CHUNK, f.num_samples - c * CHUNK) for c in window) for window in windows])
    checked = 0
    for j, rows in enumerate(epoch_rows(stream)):
        w = int(np.searchsorted(edges, 64 * j, side="right"))
        if 64 * j + len(rows) > edges[w] or len(windows[w]) < 8 or edges[w] - (edges[w - 1] if w else 0) < 512:
            continue  # straddles two windows, or a window short of 16 contexts
        window_rows = np.concatenate([np.arange(c * CHUNK, (c + 1) * CHUNK) for c in windows[w]])
        available = set(f.text.documents_of(window_rows).tolist())
        contexts = set(f.text.documents_of(rows).tolist())
        assert len(available) == 16 and contexts <= available
        assert len(contexts) >= 0.8 * len(available), (j, len(contexts))
        assert len(set((rows // CHUNK).tolist())) >= 7  # rows from (nearly) every chunk of the window
        checked += 1
    assert checked >= 0.8 * f.num_samples // 64


def test_set_epoch_reshuffles_and_the_same_seed_and_epoch_repeat(stores):
    def order(seed, epoch):
        stream = TokenStream(stores["packed"], LAYERS[0], 64, seed=seed, return_index=True)
        stream.set_epoch(epoch)
        return np.concatenate(epoch_rows(stream))

    first = order(0, 0)
    assert np.array_equal(first, order(0, 0))  # a fresh stream, the same order
    assert np.array_equal(np.sort(first), np.arange(len(first)))
    for other in (order(0, 1), order(1, 0)):
        assert np.array_equal(np.sort(other), np.sort(first))
        assert (other != first).mean() > 0.9
    again = TokenStream(stores["packed"], LAYERS[0], 64, return_index=True)
    again.set_epoch(1)
    again.set_epoch(0)  # the epoch alone decides, not how many there were
    assert np.array_equal(np.concatenate(epoch_rows(again)), first)


def test_ranks_and_workers_partition_the_tokens(stores):
    f = open_features(stores["packed"])
    exclude = ["special"]
    per_rank = []
    for rank in (0, 1):
        stream = TokenStream(stores["packed"], LAYERS, 50, rank=rank, world_size=2, exclude=exclude, return_index=True)
        alone = np.concatenate(epoch_rows(stream))
        workers = np.concatenate(epoch_rows(stream, num_workers=2))
        assert len(workers) == len(np.unique(workers)) == len(alone)
        assert np.array_equal(np.sort(workers), np.sort(alone))  # two workers read this rank's tokens, each once
        # rank r reads whole chunks: every world_size-th of the epoch's order, the same on every rank
        order = np.random.default_rng((0, 0)).permutation(f.num_chunks)
        assert set((alone // CHUNK).tolist()) == set(order[rank::2].tolist())
        per_rank.append(alone)
    assert not set(per_rank[0].tolist()) & set(per_rank[1].tolist())
    assert pairs(f, np.concatenate(per_rank)) == pairs(f, numpy_kept(f, exclude, LAYERS))


def test_worker_streams_are_disjoint_chunks(stores):
    stream = TokenStream(stores["ragged"], LAYERS[0], 32, rank=1, world_size=3)
    mine = stream.chunks()
    parts = [stream.chunks(w, 3) for w in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == sorted(mine.tolist())
    assert sum(map(len, parts)) == len(set(np.concatenate(parts).tolist()))


@pytest.mark.parametrize(
    "rule", ["sepcial", "first:0", "first:x", "first", "high_norm:-1", "high_norm", "special:1", 3]
)
def test_a_bad_rule_is_refused_naming_it_and_the_forms(stores, rule):
    with pytest.raises(ExcludeRuleError) as caught:
        TokenStream(stores["packed"], LAYERS[0], 8, exclude=["special", rule])
    message = str(caught.value)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, ExtractError)
    assert "\n" not in message and repr(rule) in message and "'first:K'" in message and "'high_norm:M'" in message


def test_an_image_store_and_an_unknown_layer_are_refused(stores, tmp_path):
    images = array_store(tmp_path / "i.zarr", {"fc": np.zeros((10, 4), np.float32)}, np.zeros(10, np.int64), 4)
    with pytest.raises(
        ExtractError, match=r"layer 'fc' of this image store is one \(4,\) row per image, pooled at extraction, not "
        r"one per patch; read it with FeatureDataset"
    ) as caught:
        TokenStream(images, "fc", 8)
    assert "\n" not in str(caught.value)
    with pytest.raises(LayerNotFoundError, match="has no layer 'transformer.h.9'.*closest"):
        TokenStream(stores["packed"], ["transformer.h.0", "transformer.h.9"], 8)


def test_a_lost_chunk_is_named_not_streamed_as_nan(stores, tmp_path):
    damaged = tmp_path / "damaged.zarr"
    shutil.copytree(stores["ragged"], damaged)
    (damaged / "features" / LAYERS[0] / "c" / "5" / "0").unlink()
    with pytest.raises(StoreDamagedError, match=r"layer 'transformer.h.0', chunk 5 \(samples 320-383\) is missing"):
        for _ in TokenStream(damaged, LAYERS[0], 32, threads=2):
            pass


OLD_NAMES = (
    "offsets", "token_ids", "load_token_ids", "special", "doc", "doc_position", "num_documents", "num_contexts",
    "num_source_documents", "token_documents", "documents_of", "token_positions", "document",
)  # fmt: skip


@pytest.mark.filterwarnings(r"ignore:Features\.\w+ is deprecated:DeprecationWarning")  # asserted below
@pytest.mark.parametrize("name", ["packed", "ragged"])
def test_the_text_view_and_the_old_names_agree(stores, name, tmp_path):
    f = open_features(stores[name])
    view = f.text
    assert view is f.text and f.pack == view.pack and (view.pack is not None) == (name == "packed")
    for accessor in ("offsets", "token_ids", "special", "token_documents", "token_positions"):
        assert np.array_equal(getattr(f, accessor), getattr(view, accessor)), accessor
    if name == "packed":
        assert np.array_equal(f.doc, view.doc) and np.array_equal(f.doc_position, view.doc_position)
    else:
        with pytest.raises(ExtractError, match="is not packed; 'doc' belongs to stores extracted with --pack"):
            f.doc  # noqa: B018
    assert f.num_documents == view.num_documents == len(f.offsets) - 1
    picked = slice(70, 200)
    assert np.array_equal(f.load_token_ids(picked), view.load_token_ids(picked))
    assert np.array_equal(view.load_token_ids(picked), view.token_ids[picked])
    assert np.array_equal(f.documents_of(picked), view.documents_of(picked))
    assert np.array_equal(f.documents_of(np.array([0, 64, 300])), view.token_documents[[0, 64, 300]])
    assert np.array_equal(f.document(3, LAYERS[0]), view.document(3, LAYERS[0]))
    assert np.array_equal(view.document(-1, LAYERS[0]), f.load(LAYERS[0], slice(int(f.offsets[-2]), None)))
    images = array_store(tmp_path / "i.zarr", {"fc": np.zeros((10, 4), np.float32)}, np.zeros(10, np.int64), 4)
    image_features = open_features(images)
    assert image_features.pack is None  # as before the view: an image store is not packed
    for read in (lambda: image_features.text, lambda: image_features.offsets, lambda: image_features.document(0)):
        with pytest.raises(ExtractError, match=r"is an image store; offsets, token ids and documents belong to text"):
            read()


def test_the_old_names_warn_and_the_view_does_not(stores):
    """Issue 46: one spelling, ``features.text.<name>``; the 13 old names on ``Features`` still read the
    view's but warn, naming the new spelling, at the reader's line."""
    f = open_features(stores["packed"])
    aliases = [name for name, value in vars(Features).items() if type(value).__name__ == "_TextAlias"]
    assert sorted(OLD_NAMES) == sorted(aliases)
    for name in OLD_NAMES:
        said = rf"Features\.{name} is deprecated: use features\.text\.{name}"
        with pytest.warns(DeprecationWarning, match=said) as seen:
            getattr(f, name)
        assert [w.filename for w in seen] == [__file__], name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in OLD_NAMES:
            getattr(f.text, name)
        assert f.pack is not None and f.kind == "tokens" and "contexts" in repr(f)  # Features' own: no warning
