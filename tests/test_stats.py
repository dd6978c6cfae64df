"""Issue 19, statistics at write time: the per-chunk rows the writer records (``stats/<layer>``) and their
merge (``Features.stats``) against numpy over the stored data, for a token store, a pooled document store
and a pooled image store, after a resume that redoes some chunks too; verify catches a tampered or lost
statistics object and ``--repair`` has it recomputed; a store from before statistics reads as before."""

import math
import shutil

import numpy as np
import pytest
import torch
import zarr
from helpers.stats_reference import BOUND, assert_close_to_float64, reference_row, staged_store
from helpers.stores import array_store
from helpers.text_models import real_documents, save_text_model, write_jsonl

from extract import open_features
from extract.cli.extract import main as extract_main
from extract.cli.verify import main as verify_main
from extract.errors import ExtractError, StoreDamagedError
from extract.store.schema import checked, codecs
from extract.store.skeleton import Skeleton
from extract.store.stats import HEAD, chunk_row, columns
from extract.store.store import FeatureStore

TEXT_LAYERS = ["transformer.h.0", "hidden_states.3"]
IMAGE_POOLS = ["layer4=avg", "layer3=max", "layer2=none"]  # layer2 kept whole: (128, 4, 4), per position


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    write_jsonl(root / "docs.jsonl", [*real_documents(23), ""])  # the empty document: a NaN row once pooled
    return root / "docs.jsonl", save_text_model("gpt2", root / "gpt2")


def text_job(corpus, out, *extra):
    data, model = corpus
    return [
        "--model", f"hf:{model}", "--layers", *TEXT_LAYERS, "--data", f"text:{data}", "--dtype", "float16",
        "--context-length", "96", "--chunk-size", "128", "--out", str(out), *extra,
    ]  # fmt: skip


def image_job(out):
    return [
        "--model", "resnet18", "--weights", "none", "--layers", "layer2", "layer3", "layer4", "--pool", *IMAGE_POOLS,
        "--data", "synthetic:22", "--image-size", "32", "--chunk-size", "4", "--batch-size", "6", "--dtype", "float16",
        "--num-workers", "0", "--out", str(out),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tokens(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens") / "t.zarr"
    assert extract_main(text_job(corpus, out)) == 0
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    out = tmp_path_factory.mktemp("images") / "i.zarr"
    assert extract_main(image_job(out)) == 0
    return out


def numpy_stats(values: np.ndarray) -> dict:
    """The statistics computed independently, over the rows without a NaN, in float64."""
    rows = values.reshape(len(values), -1).astype(np.float64)
    rows = rows[~np.isnan(rows).any(axis=1)]
    norms = np.linalg.norm(rows, axis=1)
    return {
        "count": len(rows),
        "mean": rows.mean(axis=0),
        "std": rows.std(axis=0),
        "mean_norm": norms.mean(),
        "max_abs": np.abs(rows).max(),
        "sum": rows.sum(axis=0),
        "sumsq": np.square(rows).sum(axis=0),
        "float16_overflow": int((np.isfinite(rows) & (np.abs(rows) > 65504)).sum()),
        "infinite": int(np.isinf(rows).sum()),
    }


def assert_stats_equal_numpy(path, layer: str) -> dict:
    """Each chunk's recorded row equals the contract's arithmetic spelled out (``reference_row``) bit for
    bit, and ``stats(layer)`` numpy's float64 over the stored values within the contract's bound."""
    f = open_features(path)
    stored = f.load(layer, dtype=None)  # as stored (float16)
    assert stored.dtype == np.float16
    got = f.stats(layer)
    assert_close_to_float64(got, stored)
    # SAELens's ActivationScaler: sqrt(d_in) / mean of acts.norm(dim=-1), here over every counted row
    acts = torch.from_numpy(stored.astype(np.float64))
    acts = acts[~torch.isnan(acts).any(dim=1)]
    assert got["scaling_factor"] == pytest.approx(math.sqrt(acts.shape[1]) / acts.norm(dim=-1).mean().item(), rel=1e-6)
    rows = zarr.open_group(path, mode="r")[f"stats/{layer}"]
    assert rows.attrs["columns"] == columns(stored.shape[1])
    assert rows.dtype == np.float64 and rows.shape == (f.num_chunks, len(HEAD) + 2 * stored.shape[1])
    assert rows.chunks == (1, rows.shape[1])
    for k in range(f.num_chunks):
        chunk = stored[k * f.chunk_size : (k + 1) * f.chunk_size]
        np.testing.assert_array_equal(rows[k], reference_row(chunk), err_msg=f"chunk {k}")
        if numpy_stats(chunk)["count"]:  # and each row alone near float64's
            expected = numpy_stats(chunk)
            row = rows[k]
            assert row[0] == expected["count"] and row[2] == expected["max_abs"]
            magnitudes = np.abs(chunk[~np.isnan(chunk).any(axis=1)].astype(np.float64)).sum(axis=0)
            assert (
                np.abs(row[len(HEAD) : len(HEAD) + chunk.shape[1]] - expected["sum"]) <= BOUND * magnitudes * 1.01
            ).all()
    return got


def test_token_store_stats_equal_numpy(tokens):
    f = open_features(tokens)
    assert f.num_chunks > 4
    for layer in TEXT_LAYERS:
        got = assert_stats_equal_numpy(tokens, layer)
        assert got["count"] == f.num_samples  # every token of a token store is a counted row
    digests = zarr.open_group(tokens, mode="r")["digests"].attrs["arrays"]
    assert [name for name in digests if name.startswith("stats/")] == [f"stats/{layer}" for layer in TEXT_LAYERS]


def test_document_store_leaves_out_the_empty_document(corpus, tmp_path):
    out = tmp_path / "docs.zarr"
    assert extract_main(text_job(corpus, out, "--pool", "mean", "--chunk-size", "5")) == 0
    f = open_features(out)
    assert f.kind == "documents" and np.isnan(f.load(TEXT_LAYERS[0], [23])).all()
    for layer in TEXT_LAYERS:
        assert assert_stats_equal_numpy(out, layer)["count"] == 23


def test_a_chunk_larger_than_the_store_holds_it_whole(corpus, tokens, tmp_path):
    """Fewer documents (or tokens) than --chunk-size: one chunk, whose per-row arrays (labels, keys, token
    ids) are chunked like the features, as opening checks; the rows equal the many-chunk store's."""
    many = open_features(tokens)
    token_rows = many.load(TEXT_LAYERS[0])
    for pool, chunk in (("mean", 100), ("none", 100_000)):
        out = tmp_path / f"{pool}.zarr"
        assert extract_main(text_job(corpus, out, "--pool", pool, "--chunk-size", str(chunk))) == 0
        f = open_features(out)
        assert f.num_chunks == 1 and f.chunk_size == chunk
        if pool == "none":
            np.testing.assert_array_equal(f.token_ids, many.token_ids)
            np.testing.assert_allclose(f.load(TEXT_LAYERS[0]), token_rows, rtol=2e-3, atol=2e-3)
        else:  # each document's mean over its own stored token rows
            edges = zip(many.offsets[:23], many.offsets[1:24], strict=True)  # the 24th is the empty document
            means = np.stack([token_rows[a:b].mean(axis=0) for a, b in edges])
            np.testing.assert_allclose(f.load(TEXT_LAYERS[0])[:23], means, rtol=1e-2, atol=1e-2)
            assert f.keys.tolist() == many.keys.tolist()


def test_pooled_image_store_stats_equal_numpy(images, tmp_path):
    f = open_features(images)
    assert f.shapes["layer4"] == (512,) and f.shapes["layer2"] == (128, 4, 4)
    for layer in ("layer3", "layer4"):
        assert assert_stats_equal_numpy(images, layer)["count"] == 22
    # a map kept whole (NCHW): statistics of each position's 128 channels, every (image, h, w) a row
    maps = f.load("layer2", dtype=None)
    positions = maps.transpose(0, 2, 3, 1).reshape(-1, 128)
    got = f.stats("layer2")
    assert got["count"] == 22 * 16 and got["mean"].shape == (128,)
    assert_close_to_float64(got, positions)
    rows = zarr.open_group(images, mode="r")["stats/layer2"]
    for k in range(f.num_chunks):
        chunk = maps[k * f.chunk_size : (k + 1) * f.chunk_size]
        np.testing.assert_array_equal(rows[k], reference_row(chunk, channel_axis=1), err_msg=f"chunk {k}")
    assert zarr.open_group(images, mode="r")["stats"].attrs["layers"] == ["layer2", "layer3", "layer4"]
    # a layer whose layout the store does not record has none
    unknown = array_store(tmp_path / "u.zarr", {"x": np.ones((6, 3, 2, 2), np.float32)}, np.zeros(6, np.int64), 4)
    with pytest.raises(ExtractError, match=r"layer 'x' is stored as \(3, 2, 2\) per row .* --pool or --layout"):
        open_features(unknown).stats("x")


def test_resume_recomputes_the_stats_of_the_chunks_it_redoes(corpus, tokens, tmp_path):
    out = tmp_path / "resumed.zarr"
    shutil.copytree(tokens, out)
    store = FeatureStore.open(out)
    redo = [1, 3]
    store.integrity.clear_done(redo)
    before = {layer: store.array(f"stats/{layer}")[:] for layer in TEXT_LAYERS}
    for layer in TEXT_LAYERS:  # stale rows: only a recomputation makes them right again
        for k in redo:
            store.array(f"stats/{layer}")[k] = np.full(before[layer].shape[1], 7.0)
    assert open_features(out, allow_partial=True).stats(TEXT_LAYERS[0])["count"] < open_features(tokens).num_samples
    assert extract_main(text_job(corpus, out)) == 0
    for layer in TEXT_LAYERS:
        assert_stats_equal_numpy(out, layer)
        after = zarr.open_group(out, mode="r")[f"stats/{layer}"][:]
        kept = [k for k in range(len(after)) if k not in redo]
        np.testing.assert_array_equal(after[kept], before[layer][kept])  # the others were not rewritten


def verify(capsys, path, *flags):
    code = verify_main([str(path), *flags])
    return code, capsys.readouterr().out.strip()


def test_verify_catches_tampered_and_lost_stats_and_repair_recomputes_them(capsys, images, tmp_path):
    out = tmp_path / "tampered.zarr"
    shutil.copytree(images, out)
    rows = zarr.open_group(out, mode="r+")["stats/layer4"]
    garbled = out / "stats/layer4" / rows.metadata.encode_chunk_key((0, 0))
    data = bytearray(garbled.read_bytes())
    data[len(data) // 2] ^= 0xFF
    garbled.write_bytes(bytes(data))
    rows[2] = rows[2] * 2  # a well-formed object, with its own valid checksum, but not the one written
    (out / "stats/layer3" / rows.metadata.encode_chunk_key((4, 0))).unlink()
    code, line = verify(capsys, out)
    assert code == 1, line
    assert "3 of 6 chunks damaged" in line
    assert "chunk 0: stats/layer4 does not decode" in line
    assert "chunk 2: stats/layer4 is not the object written for this chunk" in line
    assert "chunk 4: stats/layer3 missing" in line
    with pytest.raises(StoreDamagedError, match=r"statistics of layer 'layer4', chunk 0 .* fail their check"):
        open_features(out).stats("layer4")
    with pytest.raises(StoreDamagedError, match=r"statistics of layer 'layer3', chunk 4 .* are missing"):
        open_features(out).stats("layer3")
    code, line = verify(capsys, out, "--repair")
    assert code == 1 and "cleared their done flags" in line, line
    assert FeatureStore.open(out, mode="r").pending_chunks() == [0, 2, 4]
    assert extract_main(image_job(out)) == 0
    assert verify(capsys, out) == (0, f"extract.verify: {out}: {CLEAN}")
    for layer in ("layer3", "layer4"):
        assert_stats_equal_numpy(out, layer)
    reference = zarr.open_group(images, mode="r")["stats/layer4"]
    np.testing.assert_array_equal(zarr.open_group(out, mode="r")["stats/layer4"][[0, 2]], reference[[0, 2]])


CLEAN = "all 6 done chunks are present and match their checksums and the digests recorded when they were written"


def test_a_store_from_before_statistics_reads_as_before(capsys, monkeypatch, tmp_path):
    """A store built as extract wrote them before statistics (no ``stats`` group, no digests columns for
    them): it verifies clean and reads as before; only ``stats`` refuses it, in one line."""
    monkeypatch.setattr(Skeleton, "_stats", lambda self, root, num_chunks: [])
    out = tmp_path / "old.zarr"
    assert extract_main(image_job(out)) == 0
    monkeypatch.undo()  # read with today's code
    assert "stats" not in zarr.open_group(out, mode="r")
    assert verify(capsys, out) == (0, f"extract.verify: {out}: {CLEAN}")
    f = open_features(out)
    layer4 = f.load("layer4")
    assert layer4.shape == (22, 512) and not np.isnan(layer4).any()
    with pytest.raises(ExtractError, match="written before stores kept statistics") as error:
        f.stats("layer4")
    assert len(str(error.value).splitlines()) == 1


def test_a_store_from_before_per_position_statistics_reads_as_before(capsys, monkeypatch, tmp_path):
    """A store built as extract wrote them before per-position statistics (``stats/<layer>`` for the 1-D
    layers only, no ``layers`` list on the group): written, verified and read with today's code, it
    keeps its 1-D layers' statistics, and the map kept whole has none (one line)."""

    def old_stats(self, root, num_chunks):
        group, paths = root.create_group("stats"), []
        for layer, shape in self.shapes.items():
            if len(shape) == 1:
                width = len(HEAD) + 2 * shape[0]
                group.create_array(
                    layer, shape=(num_chunks, width), chunks=(1, width), dtype="float64", fill_value=np.nan,
                    compressors=checked(codecs("zstd")), attributes={"columns": columns(shape[0])},
                )  # fmt: skip
                paths.append(f"stats/{layer}")
        return paths

    monkeypatch.setattr(Skeleton, "_stats", old_stats)
    out = tmp_path / "old.zarr"
    assert extract_main(image_job(out)) == 0
    monkeypatch.undo()
    assert "layers" not in zarr.open_group(out, mode="r")["stats"].attrs
    assert verify(capsys, out) == (0, f"extract.verify: {out}: {CLEAN}")
    for layer in ("layer3", "layer4"):
        assert_stats_equal_numpy(out, layer)
    with pytest.raises(ExtractError, match=r"layer 'layer2' .*\(or the store predates per-position statistics\)"):
        open_features(out).stats("layer2")


def test_a_chunk_row_leaves_out_nan_rows_and_counts_infinite_ones():
    values = np.array([[1, -2], [np.nan, 0], [3, 4], [0, np.nan]], dtype=np.float16)
    row, at = chunk_row(values), columns(2)
    assert row.shape == (5 + 2 * 2,) and row.dtype == np.float64
    assert row[slice(*at["count"])].tolist() == [2] and row[slice(*at["max_abs"])].tolist() == [4]
    assert row[slice(*at["sum_norm"])][0] == pytest.approx(math.sqrt(5) + 5, rel=1e-15)
    assert row[slice(*at["sum"])].tolist() == [4, 2] and row[slice(*at["sumsq"])].tolist() == [10, 20]
    beyond = np.array([[np.inf, 1], [2, 2]], dtype=np.float16)  # a value beyond float16's range, as stored
    row = chunk_row(beyond)
    assert row[slice(*at["count"])].tolist() == [2] and np.isinf(row[slice(*at["max_abs"])]).all()
    assert row[slice(*at["infinite"])].tolist() == [1] and row[slice(*at["float16_overflow"])].tolist() == [0]
    assert row[slice(*at["sum"])].tolist() == [np.inf, 3]


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.uint16).numpy()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(
    ("shape", "channel_axis"),
    [((1000, 77), None), ((333, 4096), None), ((7, 5, 3, 2), None), ((37, 24, 3, 5), 1), ((9, 7, 7, 40), 3)],
)
def test_chunk_row_is_the_contract_bit_for_bit(dtype, shape, channel_axis):
    """``chunk_row`` against the contract spelled out row by row (``reference_row``): chunks of rows that
    are not whole blocks, slabs of several blocks, positions per sample that do not divide a block, NaN
    rows (left out), the model's infinities and float16's overflow (counted), massive channels."""
    rng = np.random.default_rng(sum(shape))
    values = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.normal(0, 2, shape[-1])).astype(np.float32)
    flat = values.reshape(len(values), -1)
    flat[3] = np.nan  # an invalid sample
    flat[5, 0] = np.inf
    flat[6, -1] = 70000.0 if dtype != "float16" else 65504.0
    flat[-1, 1] = -1e-30  # tiny: float32 sums round it away, float64 would not
    if dtype == "bfloat16":
        stored = _bfloat16_bits(values)
        as_float = torch.from_numpy(stored).view(torch.bfloat16).float().numpy()
        row = chunk_row(stored, channel_axis, bfloat16=True)
    else:
        stored = values.astype(dtype)
        as_float = stored.astype(np.float32)
        row = chunk_row(stored, channel_axis)
    np.testing.assert_array_equal(row, reference_row(as_float, channel_axis))
    positions = 1 if channel_axis is None else values.size // len(values) // shape[channel_axis]
    assert row[HEAD.index("infinite")] == 1 and row[HEAD.index("count")] < len(values) * positions  # a NaN row left out
    # the same chunk cut differently (another slab size) gives the same row: only the chunk decides
    import extract.store.stats as stats_module

    slab = stats_module.SLAB_VALUES
    stats_module.SLAB_VALUES = 1000
    try:
        again = chunk_row(stored, channel_axis, bfloat16=dtype == "bfloat16")
    finally:
        stats_module.SLAB_VALUES = slab
    np.testing.assert_array_equal(again, row)


def _layers(n: int = 150) -> dict[str, np.ndarray]:
    """Rows of 1-D features and maps kept whole, a NaN sample, the model's inf, values past float16."""
    rng = np.random.default_rng(3)
    flat = (rng.standard_normal((n, 300)) * np.exp(rng.normal(0, 2, 300))).astype(np.float32)
    flat[17] = np.nan
    flat[40, 3], flat[41, 5] = np.inf, 70000.0
    maps = rng.standard_normal((n, 24, 3, 5)).astype(np.float32)
    maps[90, :, 1, 1] = np.nan
    return {"h": flat, "m": maps}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_statistics_computed_where_the_rows_are_equal_the_hosts_bit_for_bit(tmp_path, dtype):
    """The device path (``block_stats.py``, here run by torch on the CPU: the same elementwise float32
    operations a GPU runs) computes whole blocks of each chunk's rows before the copy; the host the rest.
    The store's statistics equal the host's alone and the contract's spelled out, for batches that cut
    the chunks and their blocks anywhere (and so, for any number of processes)."""
    layers = _layers()
    if dtype == "float16":
        layers["h"] = np.where(np.abs(layers["h"]) > 65504, np.inf, layers["h"]).astype(np.float32)
    alone = staged_store(tmp_path / "host.zarr", layers, dtype, 64, 50, "cpu", device_stats=False)
    expected = {layer: alone.array(f"stats/{layer}")[:] for layer in layers}
    for batch in (7, 50, 64, 150):
        store = staged_store(tmp_path / f"device-{batch}.zarr", layers, dtype, 64, batch, "cpu", device_stats=True)
        for layer in layers:
            np.testing.assert_array_equal(store.array(f"stats/{layer}")[:], expected[layer], err_msg=f"{layer} {batch}")
    stored = open_features(tmp_path / "device-64.zarr", allow_partial=True).load("m", dtype="float32")  # exact
    for k in range(3):
        row = reference_row(stored[k * 64 : (k + 1) * 64], channel_axis=1)
        np.testing.assert_array_equal(expected["m"][k], row)


def test_device_blocks_skip_the_hosts_work_and_keep_its_bits(monkeypatch):
    """``block_stats`` + ``Partial``: whole blocks only, aligned on the chunk's first row; a slab the device
    covers is taken as it is (a poisoned buffer would show), one it does not is computed on the host."""
    from extract.capture.block_stats import block_stats, stored_rows
    from extract.store import stats
    from extract.store.stats import Partial

    monkeypatch.setattr(stats, "SLAB_VALUES", 16 * 300)  # slabs of one block
    values = _layers(96)["h"].astype(np.float16)
    host = chunk_row(values)
    partial = Partial(96 // 16, 300)
    for first, end in ((0, 37), (37, 96)):  # two batches: rows 32..47 form the block the cut leaves out
        part = block_stats(stored_rows(torch.from_numpy(values[first:end]), None), first)
        partial.add(part.numpy())
    assert partial.covered.tolist() == [True, True, False, True, True, True]
    np.testing.assert_array_equal(chunk_row(values, partial=partial), host)
    partial.sums[0] = 1e30  # a covered slab is read from the partial, not recomputed
    assert chunk_row(values, partial=partial)[len(HEAD)] > 1e29
    partial.sums[2] = 1e30  # an uncovered one is the host's
    assert chunk_row(values, partial=partial)[len(HEAD)] > 1e29 and partial.covered.sum() == 5
