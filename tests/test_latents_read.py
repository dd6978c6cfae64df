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
from text_models import real_documents, save_text_model, write_jsonl
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
    codes.attrs.update(d_sae=D_SAE, k=K, hook_name=layer, architecture="topk", sae_path="sae/", sae_sha256="0" * 64)
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
