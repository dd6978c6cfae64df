"""Issue 37: ``TokenStream`` reads an uncompressed layer's chunk objects straight into its window and checks
their crc32c in place (``extract.read.direct``). Against zarr's own read of the same objects: byte for
byte, for every dtype the stores hold and for the padded last chunk; compressed stores (and any other
codec chain) are left to zarr and read the same; a flipped byte, a truncated object and a lost one are
``StoreDamagedError`` naming the chunk, through the stream."""

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import Crc32cCodec

from extract import TokenStream, open_features
from extract.errors import StoreDamagedError
from extract.read import direct
from extract.read.direct import ChecksumMismatch, direct_chunks
from extract.store import dtypes
from extract.store.store import FeatureStore
from extract.store.text_arrays import TextArrays

LAYER = "blocks.0.hook_resid_post"
CONTEXT = 16
CHUNK = 48
TOKENS = 7 * CONTEXT * 3 + CONTEXT  # 352: 8 chunks, the last one partial (16 of 48 rows)
DIM = 24


def token_store(path, dtype: str, compressor: str, seed: int = 0):
    """A complete token store of one layer of ``dtype`` over contexts of ``CONTEXT`` (first token special),
    written through ``FeatureStore`` as a job writes it; returns the path and the rows as stored (bits
    for bfloat16)."""
    contexts = TOKENS // CONTEXT
    text = TextArrays(
        offsets=np.arange(contexts + 1, dtype=np.int64) * CONTEXT,
        labels=np.full(contexts, -1, dtype=np.int64),
        valid=np.ones(contexts, dtype=bool),
    )
    store = FeatureStore.create(
        path, shapes={LAYER: (DIM,)}, num_samples=TOKENS, chunk_size=CHUNK, dtype=dtype, compressor=compressor,
        attrs={"status": "running", "layers": [LAYER], "num_samples": TOKENS, "chunk_size": CHUNK},
        kind="tokens", text=text,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    values = torch.from_numpy(rng.standard_normal((TOKENS, DIM), dtype=np.float32) * 4)
    special = np.zeros(TOKENS, dtype=bool)
    special[::CONTEXT] = True
    token_ids = np.random.default_rng(0).integers(1, 1000, TOKENS, dtype=np.int32)  # every seed's: alignable
    for chunk, start in enumerate(range(0, TOKENS, CHUNK)):
        stop = min(start + CHUNK, TOKENS)
        rows = values[start:stop].to(getattr(torch, dtype))
        stored = rows.view(torch.uint16).numpy() if dtype == "bfloat16" else rows.numpy()
        columns = {"token_ids": token_ids[start:stop], "special": special[start:stop]}
        store.write_chunk(chunk, start, stop, {LAYER: stored}, None, None, columns)
    store.update_attrs(status="complete")
    expected = values.to(getattr(torch, dtype))
    return path, (expected.view(torch.uint16) if dtype == "bfloat16" else expected).numpy()


def object_of(path, chunk: int):
    return path / "features" / LAYER / "c" / str(chunk) / "0"


def counted_direct_reads(monkeypatch) -> list[int]:
    """A list that grows by one for every object read straight from its file (not handed back to zarr)."""
    reads: list[int] = []
    original = direct._extend  # the checksum over a mapped object: once an object, only on the direct read
    # an object's checksum starts at 0 (a padded last chunk's goes on over its padding)
    monkeypatch.setattr(
        direct, "_extend", lambda crc, data: (crc == 0 and reads.append(len(data))) or original(crc, data)
    )
    return reads


def every_row(stream) -> tuple[np.ndarray, np.ndarray]:
    """One epoch's values (bits for bfloat16) and rows, in the order the stream yields them."""
    values, rows = [], []
    for batch, index in stream:
        values.append((batch.view(torch.uint16) if batch.dtype == torch.bfloat16 else batch).numpy())
        rows.append(index.numpy())
    return np.concatenate(values), np.concatenate(rows)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_direct_read_is_zarrs_read_byte_for_byte_and_the_stream_uses_it(tmp_path, dtype, monkeypatch):
    path, stored = token_store(tmp_path / "s.zarr", dtype, "none")
    array = open_features(path).array(LAYER)
    reader = direct_chunks(array)
    assert reader is not None and dtypes.is_bfloat16(array) == (dtype == "bfloat16")
    buffer = np.empty((CHUNK, DIM), dtype=array.dtype)
    for chunk in range(-(-TOKENS // CHUNK)):
        start, stop = chunk * CHUNK, min(TOKENS, (chunk + 1) * CHUNK)
        got = reader.read(chunk, buffer, fallback=lambda: pytest.fail("the object is there"))
        assert got.tobytes() == np.asarray(array[start:stop]).tobytes() == stored[start:stop].tobytes()

    reads = counted_direct_reads(monkeypatch)
    for out in (dtype, "float32"):  # straight into the window, and through the conversion's chunk
        values, rows = every_row(TokenStream(path, LAYER, 40, window=3, threads=2, dtype=out, return_index=True))
        assert sorted(rows.tolist()) == list(range(TOKENS))
        expected = torch.from_numpy(stored[rows])
        if dtype == "bfloat16":
            expected = expected.view(torch.bfloat16)
        expected = expected.to(getattr(torch, out))
        assert np.array_equal(values, (expected.view(torch.uint16) if out == "bfloat16" else expected).numpy())
    assert len(reads) == 2 * -(-TOKENS // CHUNK)  # every chunk of both passes read straight from its file


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_stacked_window_of_two_stores_takes_the_direct_read_and_equals_the_stores(tmp_path, dtype, monkeypatch):
    (one, first), (other, second) = (token_store(tmp_path / f"{i}.zarr", dtype, "none", seed=i) for i in (0, 1))
    reads = counted_direct_reads(monkeypatch)
    stream = TokenStream([one, other], LAYER, 40, window=3, dtype=dtype, stack=True, return_index=True)
    values, rows = every_row(stream)
    assert sorted(rows.tolist()) == list(range(TOKENS))
    assert np.array_equal(values, np.stack([first[rows], second[rows]], axis=1))
    assert len(reads) == 2 * -(-TOKENS // CHUNK)  # every chunk of both passes read straight from its file


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint16", "bool", "float64"])
def test_the_direct_read_of_other_dtypes_and_row_shapes_is_zarrs(tmp_path, dtype):
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((50, 3, 5)) * 1000).astype(dtype)
    array = zarr.create_array(
        tmp_path / "a.zarr", shape=values.shape, chunks=(8, 3, 5), dtype=dtype, compressors=[Crc32cCodec()]
    )
    array[:] = values
    reader = direct_chunks(zarr.open_array(tmp_path / "a.zarr", mode="r"))
    assert reader is not None
    into = np.empty((8, 3, 5), dtype=dtype)
    for chunk in range(7):
        got = reader.read(chunk, into, fallback=lambda: pytest.fail("the object is there"))
        assert got.tobytes() == values[chunk * 8 : chunk * 8 + 8].tobytes()


def test_other_codec_chains_are_left_to_zarr(tmp_path):
    path, stored = token_store(tmp_path / "z.zarr", "float16", "zstd")
    assert direct_chunks(open_features(path).array(LAYER)) is None
    values, rows = every_row(TokenStream(path, LAYER, 40, window=2, dtype="float16", return_index=True))
    assert np.array_equal(values, stored[rows])
    sharded = zarr.create_array(
        tmp_path / "sharded.zarr", shape=(64, 4), chunks=(8, 4), shards=(32, 4), dtype="float32",
        compressors=[Crc32cCodec()],
    )  # fmt: skip
    split = zarr.create_array(tmp_path / "split.zarr", shape=(64, 4), chunks=(8, 2), dtype="float32",
                              compressors=[Crc32cCodec()])  # fmt: skip
    unchecked = zarr.create_array(tmp_path / "plain.zarr", shape=(64, 4), chunks=(8, 4), dtype="float32",
                                  compressors=None)  # fmt: skip
    memory = zarr.create_array(zarr.storage.MemoryStore(), shape=(64, 4), chunks=(8, 4), dtype="float32",
                               compressors=[Crc32cCodec()])  # fmt: skip
    assert [direct_chunks(a) for a in (sharded, split, unchecked, memory)] == [None] * 4


def test_a_destination_that_does_not_fit_and_an_absent_object_are_read_by_zarr(tmp_path):
    path, stored = token_store(tmp_path / "s.zarr", "float16", "none")
    reader = direct_chunks(open_features(path).array(LAYER))
    strided = np.empty((CHUNK, 2, DIM), dtype=np.float16)[:, 0]
    assert reader.read(1, strided, fallback=lambda: "zarr") == "zarr"
    assert reader.read(1, np.empty((CHUNK, DIM), np.float32), fallback=lambda: "zarr") == "zarr"
    object_of(path, 2).unlink()
    assert reader.read(2, np.empty((CHUNK, DIM), np.float16), fallback=lambda: "zarr") == "zarr"


@pytest.mark.parametrize("how", ["flip", "truncate", "extend"])
@pytest.mark.parametrize("chunk", [3, 7])  # a whole chunk, and the padded last one
def test_a_damaged_object_is_named_by_the_stream(tmp_path, how, chunk):
    path, _ = token_store(tmp_path / "s.zarr", "float16", "none")
    target = object_of(path, chunk)
    data = bytearray(target.read_bytes())
    reader = direct_chunks(open_features(path).array(LAYER))
    if how == "flip":
        data[len(data) - 7] ^= 0x10  # in the padding of the last chunk: zarr checks those bytes too
    target.write_bytes(bytes(data[:-1]) if how == "truncate" else bytes(data) + (b"\0" if how == "extend" else b""))
    with pytest.raises(ChecksumMismatch):
        reader.read(chunk, np.empty((CHUNK, DIM), np.float16), fallback=lambda: pytest.fail("the object is there"))
    stream = TokenStream(path, LAYER, 40, window=2, dtype="float16")
    with pytest.raises(StoreDamagedError) as error:
        list(stream)
    start, stop = chunk * CHUNK, min(TOKENS, (chunk + 1) * CHUNK) - 1
    message = str(error.value)
    assert f"layer '{LAYER}', chunk {chunk} (samples {start}-{stop}) fails its check" in message
    assert "\n" not in message and "--repair" in message


def test_a_lost_object_is_named_by_the_stream(tmp_path):
    path, _ = token_store(tmp_path / "s.zarr", "float16", "none")
    object_of(path, 4).unlink()
    with pytest.raises(StoreDamagedError, match=rf"layer '{LAYER}', chunk 4 \(samples 192-239\) is missing"):
        list(TokenStream(path, LAYER, 40, dtype="float32"))


HIDDEN_CRC32C = """
import sys
sys.modules["crc32c"] = None  # import crc32c raises ImportError, as where the package is not installed
import numpy as np, torch
from extract import TokenStream, open_features
from extract.errors import StoreDamagedError
from extract.read.direct import direct_chunks

path, out, layer = sys.argv[1:4]
assert direct_chunks(open_features(path).array(layer)) is None, "the direct read must stand aside"
values, rows = [], []
for batch, index in TokenStream(path, layer, 40, dtype="float16", return_index=True):
    values.append(batch.numpy())
    rows.append(index.numpy())
np.savez(out, values=np.concatenate(values), rows=np.concatenate(rows))
"""


def test_without_the_crc32c_package_the_stream_reads_through_zarr(tmp_path):
    """Issue 47 item 5: with ``crc32c`` hidden (in a subprocess), ``TokenStream`` on an uncompressed store
    (the direct read's) reads every chunk through zarr and yields zarr's rows, each once; a flipped byte is
    still the error naming its chunk."""
    import subprocess
    import sys

    from helpers import ROOT

    path, expected = token_store(tmp_path / "s.zarr", "float16", "none")
    environment = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = [sys.executable, "-c", HIDDEN_CRC32C, str(path), str(tmp_path / "out.npz"), LAYER]
    done = subprocess.run(run, capture_output=True, text=True, env=environment, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    assert np.array_equal(np.sort(got["rows"]), np.arange(TOKENS))
    np.testing.assert_array_equal(got["values"], zarr.open_array(path / "features" / LAYER, mode="r")[:][got["rows"]])
    np.testing.assert_array_equal(got["values"], expected[got["rows"]])
    data = bytearray(object_of(path, 3).read_bytes())
    data[10] ^= 0xFF
    object_of(path, 3).write_bytes(bytes(data))
    done = subprocess.run(run, capture_output=True, text=True, env=environment, timeout=600)
    assert done.returncode != 0 and "StoreDamagedError" in done.stderr, done.stderr[-3000:]
    assert f"chunk 3 (samples {3 * CHUNK}-{4 * CHUNK - 1}) fails its check" in done.stderr, done.stderr[-3000:]
