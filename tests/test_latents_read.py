"""Issue 32, read side: a store's SAE codes (``latents/<layer>``) read back as sparse matrices, one latent
dense, per-latent statistics, through ``TokenStream``, and each latent's top contexts (``extract top``),
against the reference codes the store was filled from and brute force in numpy over them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr
from helpers.no_torch import imported_by
from helpers.text_models import real_documents, save_text_model, write_jsonl
from zarr.codecs import Crc32cCodec, ZstdCodec

from extract import open_features
from extract.cli.extract import main as extract_main
from extract.errors import LayerNotFoundError, StoreDamagedError

LAYER = "transformer.h.1"
CHUNK, D_SAE, K = 64, 48, 5


# --- test helper: the SAE codes layout of the write side (--sae LAYER=PATH), written directly with zarr until
# --- that side lands; the lead replaces it with an end-to-end test.
def random_codes(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-k codes as the encoder stores them, and the dense codes they came from (some rows with more than
    K active: their smallest are dropped). Values from a coarse set, so there are many ties."""
    rng = np.random.default_rng(seed)
    dense = np.zeros((rows, D_SAE), dtype=np.float16)
    indices = np.full((rows, K), -1, dtype=np.int32)
    values = np.zeros((rows, K), dtype=np.float16)
    for r in range(rows):
        m = rng.integers(0, K + 3)
        latent = rng.choice(D_SAE, m, replace=False)
        dense[r, latent] = (rng.integers(1, 9, m) / 4).astype(np.float16)
        order = np.lexsort((latent, -dense[r, latent].astype(np.float32)))[:K]  # ties: the lower latent
        indices[r, : len(order)], values[r, : len(order)] = latent[order], dense[r, latent[order]]
    return indices, values, dense


def add_codes(path, layer: str, indices: np.ndarray, values: np.ndarray, dense: np.ndarray) -> None:
    group = zarr.open_group(str(path), mode="r+")
    rows = len(indices)
    codes = group.create_group(f"latents/{layer}")
    record = dict(d_sae=D_SAE, k=K, hook_name=layer, architecture="topk", sae_path="sae/", sae_sha256="0" * 64)
    codes.attrs.update(record)
    group.attrs["latents"] = {**group.attrs.get("latents", {}), layer: record}  # as the job records its codes
    for name, data, fill in (("indices", indices, -1), ("values", values, 0)):
        array = codes.create_array(
            name, shape=data.shape, chunks=(CHUNK, K), dtype=data.dtype, fill_value=fill,
            compressors=[ZstdCodec(level=1), Crc32cCodec()],
        )  # fmt: skip
        array[:] = data
    chunks = -(-rows // CHUNK)
    columns = {"count": [0, D_SAE], "sum": [D_SAE, 2 * D_SAE], "max": [2 * D_SAE, 3 * D_SAE]}
    columns |= {"rows_over_k": [3 * D_SAE, 3 * D_SAE + 1], "dropped_mass": [3 * D_SAE + 1, 3 * D_SAE + 2]}
    table = np.zeros((chunks, 3 * D_SAE + 2))
    for c in range(chunks):
        d = dense[c * CHUNK : (c + 1) * CHUNK].astype(np.float64)
        kept = values[c * CHUNK : (c + 1) * CHUNK].astype(np.float64)
        table[c] = np.concatenate(
            [(d != 0).sum(0), d.sum(0), d.max(0), [((d != 0).sum(1) > K).sum()], [d.sum() - kept.sum()]]
        )
    stats = group.create_array(
        f"stats/latents/{layer}", shape=table.shape, chunks=(1, table.shape[1]), dtype="float64",
        compressors=[ZstdCodec(level=1), Crc32cCodec()],
    )  # fmt: skip
    stats[:] = table
    stats.attrs["columns"] = columns


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A ragged token store of a tiny gpt2 (documents of up to 64 tokens, chunks of 64) with SAE codes of
    one layer, and the reference codes: (path, indices, values, dense)."""
    root = tmp_path_factory.mktemp("codes")
    data = write_jsonl(root / "docs.jsonl", real_documents(30))
    model = save_text_model("gpt2", root / "gpt2")
    path = root / "store.zarr"
    args = ["--model", f"hf:{model}", "--data", f"text:{data}", "--chunk-size", str(CHUNK), "--dtype", "float16"]
    assert extract_main([*args, "--layers", LAYER, "--context-length", "64", "--out", str(path)]) == 0
    rows = open_features(path).num_samples
    indices, values, dense = random_codes(rows)
    add_codes(path, LAYER, indices, values, dense)
    return path, indices, values, dense


def test_latents_sparse_equal_reference(store):
    path, indices, values, dense = store
    f = open_features(path)
    whole = f.latents(LAYER)
    assert whole.shape == (f.num_samples, D_SAE) and whole.nnz == int((indices >= 0).sum())
    kept = np.zeros_like(dense, dtype=np.float32)
    r, s = np.nonzero(indices >= 0)
    kept[r, indices[r, s]] = values[r, s]
    np.testing.assert_array_equal(whole.toarray(), kept)
    part = f.latents(LAYER, rows=slice(70, 200), as_torch=True)
    assert part.layout == torch.sparse_csr and part.shape == (130, D_SAE)
    assert part._nnz() == int((indices[70:200] >= 0).sum())
    np.testing.assert_array_equal(part.to_dense().numpy(), kept[70:200])
    for latent in (0, 7, D_SAE - 1):
        column = f.latent(LAYER, latent)
        assert column.dtype == np.float32
        np.testing.assert_array_equal(column, kept[:, latent])


def test_latent_stats_equal_dense(store):
    path, indices, values, dense = store
    stats = open_features(path).stats(f"latents/{LAYER}")
    d = dense.astype(np.float64)
    n = len(d)
    assert stats["rows"] == n
    np.testing.assert_array_equal(stats["count"], (d != 0).sum(0))
    np.testing.assert_allclose(stats["frequency"], (d != 0).mean(0))
    np.testing.assert_allclose(stats["mean"], d.mean(0))
    np.testing.assert_allclose(stats["max"], d.max(0))
    assert stats["rows_over_k"] == int(((d != 0).sum(1) > K).sum())
    np.testing.assert_allclose(stats["dropped_mass"], d.sum() - values.astype(np.float64).sum())


def test_unknown_layer_lists_the_layers_with_codes(store):
    f = open_features(store[0])
    with pytest.raises(LayerNotFoundError, match=f"has codes of {LAYER}") as e:
        f.latents("transformer.h.0")
    assert "\n" not in str(e.value)


def test_damaged_codes_chunk_named(store, tmp_path):
    import shutil

    path = tmp_path / "damaged.zarr"
    shutil.copytree(store[0], path)
    target = path / "latents" / LAYER / "values" / "c" / "2" / "0"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    f = open_features(path)
    with pytest.raises(StoreDamagedError, match=r"latents/transformer.h.1/values.*chunk 2 \(samples 128-191\)"):
        f.latent(LAYER, 3)
    np.testing.assert_array_equal(f.latents(LAYER, rows=slice(0, 128)).nnz, (store[1][:128] >= 0).sum())
    (path / "latents" / LAYER / "indices" / "c" / "1" / "0").unlink()
    with pytest.raises(StoreDamagedError, match=r"indices.*chunk 1 .*is missing"):
        open_features(path).latents(LAYER, rows=slice(0, 100))


def brute_force_top(indices: np.ndarray, values: np.ndarray, k: int) -> dict[int, list[tuple[int, float]]]:
    """Every latent's k best (row, value) over the stored codes: value descending, then the lower row."""
    best = {}
    for latent in range(D_SAE):
        rows, slots = np.nonzero(indices == latent)
        v = values[rows, slots].astype(np.float32)
        order = np.lexsort((rows, -v))[:k]
        if len(order):
            best[latent] = [(int(rows[i]), float(v[i])) for i in order]
    return best


def test_top_command_equals_brute_force(store, tmp_path, capsys):
    import pyarrow.parquet as pq

    from extract.cli.top import main as top_main

    path, indices, values, _ = store
    f = open_features(path)
    out = tmp_path / "top"
    assert top_main([str(path), "--layer", LAYER, "-k", "3", "--context", "4", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    table = pq.read_table(out / "top.parquet").to_pylist()
    expected = brute_force_top(indices, values, 3)
    got: dict[int, list[tuple[int, float]]] = {}
    for record in sorted(table, key=lambda r: (r["latent"], r["rank"])):
        got.setdefault(record["latent"], []).append((record["row"], record["activation"]))
    assert got == expected
    token_ids, offsets, keys = f.text.token_ids, f.text.offsets, f.keys
    kept = np.zeros((f.num_samples, D_SAE), dtype=np.float32)
    r, s = np.nonzero(indices >= 0)
    kept[r, indices[r, s]] = values[r, s]
    for record in table:  # each context: its document, position, tokens and the latent's activation on each
        row = record["row"]
        doc = int(np.searchsorted(offsets, row, side="right") - 1)
        lo, hi = max(offsets[doc], row - 4), min(offsets[doc + 1], row + 5)
        assert (record["key"], record["position"]) == (keys[doc], row - offsets[doc])
        assert record["context_tokens"] == token_ids[lo:hi].tolist() and record["center"] == row - lo
        assert record["context_activations"] == kept[lo:hi, record["latent"]].tolist()
    dashboard = json.loads((out / "saedashboard.json").read_text())
    assert {feature["feature_index"] for feature in dashboard["features"]} == set(expected)
    delphi = json.loads((out / "delphi.json").read_text())
    counts = (kept != 0).sum(0)
    for latent, record in delphi["latents"].items():
        assert record["per_token_frequency"] == pytest.approx(counts[int(latent)] / f.num_samples)
    frequent = np.argsort(-counts, kind="stable")[:8]
    page = (out / "top.html").read_text()
    assert all(f"id='latent-{latent}'" in page for latent in frequent)

    chosen = tmp_path / "chosen"
    assert top_main([str(path), "--layer", LAYER, "--latents", "1,5,9", "-k", "2", "--out", str(chosen)]) == 0
    picked = pq.read_table(chosen / "top.parquet").to_pylist()
    assert {r["latent"] for r in picked} == {1, 5, 9} & set(expected)
    assert all(r["row"] == expected[r["latent"]][r["rank"]][0] for r in picked)


def test_top_bad_layer_one_line(store):
    run = subprocess.run(
        [sys.executable, "-m", "extract.top", str(store[0]), "--layer", "transformer.h.9"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and f"has codes of {LAYER}" in run.stderr, run.stderr


@pytest.mark.parametrize("workers", [0, 2])
def test_token_stream_over_codes(store, workers):
    from torch.utils.data import DataLoader

    from extract import TokenStream

    path, indices, values, _ = store
    f = open_features(path)
    kept = np.zeros((f.num_samples, D_SAE), dtype=np.float32)
    r, s = np.nonzero(indices >= 0)
    kept[r, indices[r, s]] = values[r, s]
    dense = f.load(LAYER)
    stream = TokenStream(path, [f"latents/{LAYER}", LAYER], batch_size=50, window=3, seed=4, return_index=True)
    loader = DataLoader(stream, batch_size=None, num_workers=workers) if workers else stream
    seen = []
    for batch, rows in loader:
        codes = batch[f"latents/{LAYER}"]
        assert codes.layout == torch.sparse_csr and codes.shape == (len(rows), D_SAE)
        np.testing.assert_array_equal(codes.to_dense().numpy(), kept[rows.numpy()])
        np.testing.assert_array_equal(batch[LAYER].numpy(), dense[rows.numpy()])
        seen.append(rows.numpy())
    seen = np.concatenate(seen)
    assert len(seen) == f.num_samples and np.array_equal(np.sort(seen), np.arange(f.num_samples))
    ranks = [
        np.concatenate([rows.numpy() for _, rows in TokenStream(path, f"latents/{LAYER}", 64, rank=rank,
                                                               world_size=2, exclude="special", return_index=True)])
        for rank in range(2)
    ]  # fmt: skip
    both = np.concatenate(ranks)
    assert len(both) == len(set(both.tolist())) and set(both.tolist()) == set(np.flatnonzero(~f.text.special).tolist())


def test_a_numpy_reader_of_tokens_and_codes_imports_no_torch(store):
    """Issue 46: a token store's rows (float16, read as float32), its text view, its SAE codes (scipy's
    sparse matrix, one latent, their statistics) and xarray, in a fresh interpreter without torch."""
    script = """
    import numpy as np, scipy.sparse, xarray as xr, zarr
    from extract import open_features
    f = open_features(path)
    raw = zarr.open_group(path, mode="r")
    assert np.array_equal(f.load(layer), raw[f"features/{layer}"][:].astype(np.float32))
    assert np.array_equal(f.load(layer, [9, 2, 2]), raw[f"features/{layer}"][[9, 2, 2]].astype(np.float32))
    text = f.text
    assert np.array_equal(text.token_ids, raw["token_ids"][:]) and np.array_equal(text.offsets, raw["offsets"][:])
    assert text.num_contexts == text.num_documents == text.num_source_documents == len(f.keys) == len(f.labels)
    assert text.document(1, layer).shape == (int(np.diff(text.offsets)[1]), f.shapes[layer][0])
    assert f.valid.all() and "tokens of" in repr(f)
    codes = f.latents(layer)
    assert isinstance(codes, scipy.sparse.csr_array) and codes.shape == (f.num_samples, d_sae)
    assert np.array_equal(f.latent(layer, 3), codes[:, [3]].toarray()[:, 0])
    assert f.codes(layer, slice(0, 10))[0].shape[0] == 10 and f.stats("latents/" + layer)["count"].shape == (d_sae,)
    ds = xr.open_zarr(path, group="features", consolidated=False)
    assert ds[layer].shape == (f.num_samples, f.shapes[layer][0])
    """
    assert imported_by(script, path=store[0], layer=LAYER, d_sae=D_SAE) == []
