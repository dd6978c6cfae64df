"""Issue 37, ``TokenStream`` on object storage: every chunk object of a window fetched at once
(``extract.read.prefetch``), then decoded by zarr. Token stores made by the CLI and uploaded to moto's S3
server: an epoch over the URL yields the local copy's batches byte for byte (zstd and uncompressed, float16
and bfloat16), each object fetched once; the window's GETs are in flight together at the server (more than
the 2 reading threads, where the per-chunk read never has more than 2); a flipped byte in one object is the
``StoreDamagedError`` naming its chunk that the per-chunk read gives."""

import threading
from collections import Counter

import numpy as np
import pytest
import torch
from helpers.s3 import s3_per_module, upload  # noqa: F401 - s3_per_module: this module's s3
from helpers.text_models import real_documents, save_text_model, write_jsonl

from extract import TokenStream, open_features
from extract.cli.extract import main as extract_main
from extract.errors import StoreDamagedError
from extract.read import prefetch

LAYERS = ["transformer.h.0", "transformer.h.1"]
CHUNK = 48
# (compressor, dtype) of each store; token stores default to no compressor
KINDS = [("zstd", "float16"), ("none", "float16"), ("none", "bfloat16")]



@pytest.fixture(scope="module")
def stores(tmp_path_factory, s3):
    """Per (compressor, dtype): (local path, its URL), 2 layers of a tiny GPT-2 over packed contexts of 16
    tokens, in chunks of 48 tokens (6 documents: 16 chunks), made by the CLI and uploaded."""
    root = tmp_path_factory.mktemp("prefetch")
    data = write_jsonl(root / "docs.jsonl", real_documents(6))
    model = save_text_model("gpt2", root / "gpt2", positions=32)
    made = {}
    for compressor, dtype in KINDS:
        name = f"{compressor}-{dtype}.zarr"
        local = root / name
        assert extract_main(["--model", f"hf:{model}", "--data", f"text:{data}", "--chunk-size", str(CHUNK),
                             "--dtype", dtype, "--compressor", compressor, "--layers", *LAYERS, "--pack", "16",
                             "--context-length", "16", "--out", str(local)]) == 0  # fmt: skip
        made[compressor, dtype] = local, upload(s3, local, name)
    return made


def epoch(stream) -> tuple[list[dict[str, np.ndarray]], list[np.ndarray]]:
    """One epoch's batches (each layer's rows as their bits) and rows, in the order the stream yields them."""
    values, rows = [], []
    for batch, index in stream:
        values.append({layer: tensor.view(torch.int16).numpy() for layer, tensor in batch.items()})
        rows.append(index.numpy())
    return values, rows


@pytest.fixture
def chunk_gets(monkeypatch):
    """Count the GETs of chunk objects at moto (``keys``), and the most of a layer's in flight at once
    (``peak``); with ``hold`` set, a layer's GET waits (2 s at most) until that many have been in flight at
    once, so that GETs sent together are seen together however the server's threads are scheduled."""
    from moto.s3.responses import S3Response

    seen = {"in_flight": 0, "peak": 0, "hold": 0, "keys": Counter()}
    changed = threading.Condition()
    original = S3Response.get_object

    def get_object(self):
        key = self.parse_key_name()
        if "/c/" in key:
            seen["keys"][key] += 1
        if "/features/" not in key or "/c/" not in key:
            return original(self)
        with changed:
            seen["in_flight"] += 1
            seen["peak"] = max(seen["peak"], seen["in_flight"])
            changed.notify_all()
            changed.wait_for(lambda: seen["peak"] >= seen["hold"], timeout=2)  # the peak, once reached, frees all
        try:
            return original(self)
        finally:
            with changed:
                seen["in_flight"] -= 1

    monkeypatch.setattr(S3Response, "get_object", get_object)
    return seen


@pytest.mark.parametrize("kind", KINDS, ids=["-".join(kind) for kind in KINDS])
def test_an_epoch_over_s3_is_the_local_copys_batches_each_object_fetched_once(stores, chunk_gets, kind):
    local, url = stores[kind]
    f = open_features(local)
    streams = [TokenStream(store, LAYERS, 40, window=4, exclude="special", return_index=True, seed=3,
                           dtype="bfloat16" if kind[1] == "bfloat16" else "float16") for store in (local, url)]  # fmt: skip
    assert prefetch.prefetchable(open_features(url).array(LAYERS[0]))
    assert not prefetch.prefetchable(f.array(LAYERS[0]))  # a local store keeps its own read
    (values_local, rows_local), (values_s3, rows_s3) = epoch(streams[0]), epoch(streams[1])
    assert len(rows_s3) == len(rows_local) > 4
    for a, b in zip(rows_local, rows_s3, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(values_local, values_s3, strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[layer], b[layer]) for layer in a)
    assert np.concatenate(rows_s3).size == int((~f.text.special).sum())
    # every object of both layers and of the special flags, fetched once (none again by a per-chunk read)
    read = {key: count for key, count in chunk_gets["keys"].items() if "/features/" in key or "/special/" in key}
    arrays = Counter(key.rpartition("/c/")[0].rpartition(".zarr/")[2] for key in read)
    assert arrays == {f"features/{layer}": f.num_chunks for layer in LAYERS} | {"special": f.num_chunks}
    assert set(read.values()) == {1}


def test_the_windows_gets_are_in_flight_at_once_not_one_a_thread(stores, chunk_gets, monkeypatch):
    _, url = stores["none", "float16"]
    chunk_gets["hold"] = 8  # a window's 4 chunks of 2 layers
    list(TokenStream(url, LAYERS, 64, window=4, threads=2))
    assert chunk_gets["peak"] >= 8 > 2  # every object of a window at once, with 2 reading threads
    chunk_gets.update(hold=0, peak=0)
    monkeypatch.setattr(prefetch, "prefetchable", lambda array: False)  # the per-chunk read, as before
    list(TokenStream(url, LAYERS, 64, window=4, threads=2))
    assert 1 <= chunk_gets["peak"] <= 2


@pytest.fixture
def flipped(stores, s3):
    """Flip a byte in the middle of chunk 5's object of the second layer, on S3, for a test; put it back after."""
    changed = []

    def flip(compressor: str) -> str:
        _, url = stores[compressor, "float16"]
        client, key = s3.server.client(), f"{s3.prefix}/{compressor}-float16.zarr/features/{LAYERS[1]}/c/5/0"
        original = client.get_object(Bucket=s3.server.bucket, Key=key)["Body"].read()
        body = bytearray(original)
        body[len(body) // 2] ^= 0x10
        client.put_object(Bucket=s3.server.bucket, Key=key, Body=bytes(body))
        changed.append((client, key, original))
        return url

    yield flip
    for client, key, original in changed:
        client.put_object(Bucket=s3.server.bucket, Key=key, Body=original)


@pytest.mark.parametrize("compressor", ["zstd", "none"])
def test_a_flipped_byte_in_a_chunk_object_on_s3_is_the_damage_naming_its_chunk(flipped, monkeypatch, compressor):
    url = flipped(compressor)
    with pytest.raises(StoreDamagedError) as prefetched:
        list(TokenStream(url, LAYERS, 64, window=8))
    assert f"layer '{LAYERS[1]}', chunk 5 (samples 240-287) fails its check" in str(prefetched.value)
    monkeypatch.setattr(prefetch, "prefetchable", lambda array: False)
    with pytest.raises(StoreDamagedError) as per_chunk:
        list(TokenStream(url, LAYERS, 64, window=8))
    assert str(prefetched.value) == str(per_chunk.value)


def test_stacked_and_in_consumer_streams_over_s3_are_the_local_copys(stores):
    """The window's stacked (rows, sources, D) buffer and ``threads=0`` (the reads in the consumer, after the
    window's GETs were started) take the prefetched objects too."""
    local, url = stores["zstd", "float16"]
    for options in ({"stack": True}, {"threads": 0}):
        batches = [list(TokenStream(store, LAYERS, 40, window=4, return_index=True, seed=5, dtype="float16",
                                    **options)) for store in (local, url)]  # fmt: skip
        assert len(batches[0]) == len(batches[1]) > 4
        for (a, rows_a), (b, rows_b) in zip(*batches, strict=True):
            assert torch.equal(rows_a, rows_b)
            pairs = [(a, b)] if options.get("stack") else [(a[layer], b[layer]) for layer in LAYERS]
            assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in pairs)


def test_a_spawned_dataloader_worker_opens_the_store_and_prefetches_in_its_own_process(stores, chunk_gets):
    from torch.utils.data import DataLoader

    local, url = stores["none", "float16"]
    expected = [rows.numpy() for _, rows in TokenStream(local, LAYERS[0], 64, window=4, return_index=True)]
    stream = TokenStream(url, LAYERS[0], 64, window=4, return_index=True)
    chunk_gets.update(hold=4, peak=0)  # the server is in this process: it sees the worker's GETs
    loader = DataLoader(stream, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    got = [rows.numpy() for _, rows in loader]
    assert len(got) == len(expected) and all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert chunk_gets["peak"] >= 4  # a window's 4 objects at once, from the worker's own event loop
