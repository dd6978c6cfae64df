"""Issue 31, bf16 where it matters: ``--dtype bfloat16`` stores the bfloat16 rounding of what the model
computed, bit for bit (against the model run here with plain hooks, and transformers run on each document
alone), and reads it back as ``torch.bfloat16`` (load, FeatureDataset, TokenStream) or float32 (numpy,
xarray); a value that float16 would store as inf stops the job before anything is written when the set-up
forward already shows it; the statistics count the values beyond float16's range as numpy does, and the
model's own infinities apart. (The stop in the middle of a run: tests/test_robustness.py.)"""

import json
import math
import shutil

import numpy as np
import pytest
import torch
import zarr
from helpers import TINY, tiny_models
from helpers.cli import one_line_error
from helpers.no_torch import imported_by
from helpers.reference import reference, synthetic_images
from helpers.text_models import real_documents, save_text_model, write_jsonl

from extract import FeatureDataset, TokenStream, open_features
from extract.capture.cast import overflows
from extract.cli.extract import main as extract_main
from extract.cli.verify import main as verify_main
from extract.read import decode_bfloat16
from extract.read import features as features_module
from extract.store.stats import chunk_row, columns, merge

IMAGES = ["--data", "synthetic:10", "--image-size", "32", "--num-workers", "0", "--chunk-size", "4",
          "--batch-size", "3"]  # fmt: skip


def bits(values) -> torch.Tensor:
    """The bfloat16 rounding of ``values`` (numpy or torch), as its bits."""
    tensor = torch.as_tensor(values)
    return tensor.to(torch.bfloat16).view(torch.int16)


def test_the_cast_check_agrees_with_torchs_own_rounding():
    for peak in (65504.0, 65519.0, 65519.99609375, 65520.0, 1e6, 3.3895e38, 3.4e38):
        for dtype in (torch.float16, torch.bfloat16):
            cast = torch.tensor(peak, dtype=torch.float32).to(dtype)
            assert overflows(peak, dtype) == bool(torch.isinf(cast)), (peak, dtype)


def test_float16_is_refused_in_the_set_up_forward_before_a_store_exists(cli, tmp_path):
    out = tmp_path / "loud.zarr"
    code, _, err = cli("--model", f"{TINY}:loud_bias_net", "--layers", "conv", *IMAGES, "--out", out)
    line = one_line_error(err)
    peak = tiny_models.loud_bias_net().conv(torch.zeros(2, 3, 32, 32)).abs().max().item()  # the set-up batch: zeros
    assert code == 2 and "layer 'conv'" in line and "in the set-up forward" in line, line
    assert f"|x| = {peak:.4g}" in line and "--dtype bfloat16" in line
    assert list(tmp_path.iterdir()) == []  # no store, no lock, nothing beside it


@pytest.fixture(scope="module")
def loud(tmp_path_factory):
    """loud_net in bfloat16: conv whole (4, 8, 8) a sample, head (2,) a sample; and the model's values."""
    out = tmp_path_factory.mktemp("bf16") / "loud.zarr"
    job = ["--model", f"{TINY}:loud_net", "--layers", "conv", "head", *IMAGES, "--dtype", "bfloat16", "--out", out]
    assert extract_main([str(a) for a in job]) == 0
    layers = {"conv": ("conv", None), "head": ("head", None)}
    return out, job, reference(tiny_models.loud_net().eval(), synthetic_images(10), layers)


def test_an_image_store_holds_the_models_values_rounded_to_bfloat16_bit_for_bit(loud):
    out, _, expected = loud
    f = open_features(out)
    assert f.storage_dtypes == {"conv": "bfloat16", "head": "bfloat16"} and f.attrs["dtype"] == "bfloat16"
    assert "conv [4, 8, 8] bfloat16" in repr(f)
    raw = zarr.open_group(out, mode="r")["features/conv"]
    assert raw.dtype == np.uint16 and raw.attrs["extract_dtype"] == "bfloat16"
    for layer in ("conv", "head"):
        assert np.abs(expected[layer]).max() > 65504  # float16 could not hold it
        stored = f.load(layer, dtype=None, as_torch=True)
        assert stored.dtype == torch.bfloat16 and torch.equal(stored.view(torch.int16), bits(expected[layer]))
        again = f.load(layer, dtype="bfloat16", as_torch=True)
        assert torch.equal(again.view(torch.int16), stored.view(torch.int16))
        # numpy has no bfloat16: float32, exactly the bfloat16 values; in any order, repeats too
        rounded = torch.from_numpy(expected[layer]).to(torch.bfloat16).float().numpy()
        for read in (f.load(layer), f.load(layer, dtype=None)):
            assert read.dtype == np.float32 and np.array_equal(read, rounded)
        np.testing.assert_array_equal(f.load(layer, [7, 2, 2, 0]), rounded[[7, 2, 2, 0]])
        assert np.array_equal(np.asarray(zarr.open_group(out, mode="r")[f"features/{layer}"][:]).view(np.int16),
                              bits(expected[layer]).numpy())  # fmt: skip
    assert f.dtypes == {"conv": np.float32, "head": np.float32}
    # pooled on read: the mean of the bfloat16 values, in float32
    mean = torch.from_numpy(expected["conv"]).to(torch.bfloat16).float().mean(dim=(2, 3)).numpy()
    np.testing.assert_allclose(f.load("conv", pool="avg"), mean, rtol=1e-6)


def test_feature_dataset_and_xarray_read_a_bfloat16_store(loud):
    out, _, expected = loud
    as_bf16 = FeatureDataset(out, ["conv", "head"], dtype="bfloat16")
    as_float = FeatureDataset(out, "head")
    for i in (0, 5, 9):
        values, _ = as_bf16[i]
        assert values["head"].dtype == torch.bfloat16
        assert torch.equal(values["head"].view(torch.int16), bits(expected["head"][i]))
        assert torch.equal(values["conv"].view(torch.int16), bits(expected["conv"][i]))
        assert torch.equal(as_float[i][0], values["head"].float())
    xr = pytest.importorskip("xarray")
    ds = decode_bfloat16(xr.open_zarr(out, group="features", consolidated=False))
    assert ds["head"].dtype == np.float32 and "extract_dtype" not in ds["head"].attrs
    np.testing.assert_array_equal(ds["head"].values, open_features(out).load("head"))
    np.testing.assert_array_equal(ds["conv"][3:5, 1].values, open_features(out).load("conv")[3:5, 1])


@pytest.mark.parametrize("torch_imported", [False, True])
def test_a_numpy_reader_of_a_bfloat16_store_widens_in_numpy_without_torch(loud, monkeypatch, torch_imported):
    """Issue 46: numpy widens the stored bits to float32 (exact) and casts from there, as torch did from its
    bfloat16 view: the same values, without importing torch; xarray's decoding too."""
    monkeypatch.setattr(features_module, "_torch_imported", lambda: torch_imported)
    out = loud[0]
    f = open_features(out)
    picked = [3, 1, 3, 9]
    for layer in ("conv", "head"):
        bits_stored = zarr.open_group(out, mode="r")[f"features/{layer}"][:]
        as_bf16 = torch.from_numpy(bits_stored).view(torch.bfloat16)
        assert f.load(layer).tobytes() == as_bf16.float().numpy().tobytes()
        assert f.load(layer, picked, dtype="float16").tobytes() == as_bf16[picked].half().numpy().tobytes()
        assert torch.equal(f.load(layer, picked, as_torch=True), as_bf16[picked].float())
    script = """
    import numpy as np, xarray as xr, zarr
    from extract import open_features
    from extract.read import decode_bfloat16
    from extract.store.dtypes import to_float32
    f = open_features(path)
    ds = decode_bfloat16(xr.open_zarr(path, group="features", consolidated=False))
    for layer in f.layers:
        widened = to_float32(zarr.open_group(path, mode="r")[f"features/{layer}"][:])
        assert np.array_equal(f.load(layer), widened) and np.array_equal(ds[layer].values, widened)
        assert np.array_equal(f.load(layer, [4, 0], dtype="float64"), widened[[4, 0]].astype(np.float64))
    """
    assert imported_by(script, path=out) == []


def test_verify_repair_and_resume_leave_a_bfloat16_store_bit_for_bit(loud, tmp_path, capsys):
    out, job, _ = loud
    copy = tmp_path / "copy.zarr"
    shutil.copytree(out, copy)
    assert verify_main([str(copy)]) == 0
    raw = zarr.open_group(copy, mode="r")["features/conv"]
    (copy / "features/conv" / raw.metadata.encode_chunk_key((1, 0, 0, 0))).unlink()
    assert verify_main([str(copy), "--repair"]) == 1
    capsys.readouterr()
    rerun = [str(copy) if str(a) == str(out) else str(a) for a in job]
    assert extract_main(rerun) == 0 and "resuming" in capsys.readouterr().err
    assert verify_main([str(copy)]) == 0
    for layer in ("conv", "head"):
        a, b = (zarr.open_group(path, mode="r")[f"features/{layer}"][:] for path in (out, copy))
        assert np.array_equal(a, b)


def numpy_counts(values: np.ndarray) -> tuple[int, int]:
    """(finite values with |x| > 65504, ±inf values), over the rows without a NaN."""
    rows = values[~np.isnan(values).any(axis=1)]
    return int((np.isfinite(rows) & (np.abs(rows) > 65504)).sum()), int(np.isinf(rows).sum())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stats_count_the_values_beyond_float16_as_numpy_does(cli, tmp_path, dtype):
    out = tmp_path / f"{dtype}.zarr"
    code, _, err = cli("--model", f"{TINY}:massive_net", "--layers", "conv", "--pool", "avg", *IMAGES,
                       "--data", "synthetic:16", "--dtype", dtype, "--out", out)  # fmt: skip
    assert code == 0, err
    f = open_features(out)
    stored = f.load("conv")  # float32: of a bfloat16 store, its values exactly
    beyond, infinite = numpy_counts(stored)
    assert 0 < beyond < 16 and infinite == 0  # channel 5 straddles 65504
    got = f.stats("conv")
    assert (got["float16_overflow"], got["infinite"]) == (beyond, infinite)
    assert got["max_abs"] == np.abs(stored).max()
    rows = zarr.open_group(out, mode="r")["stats/conv"]
    at = rows.attrs["columns"]
    for k in range(f.num_chunks):
        chunk = stored[k * f.chunk_size : (k + 1) * f.chunk_size]
        assert (rows[k][at["float16_overflow"][0]], rows[k][at["infinite"][0]]) == numpy_counts(chunk)


def test_the_models_own_inf_is_stored_and_counted_not_blamed_on_the_cast(cli, tmp_path):
    out = tmp_path / "own.zarr"
    code, _, err = cli("--model", f"{TINY}:own_inf_net", "--layers", "own", "--pool", "avg", *IMAGES, "--out", out)
    assert code == 0, err  # float16: the finite values fit; the model's inf is its own
    warning = [line for line in err.splitlines() if "WARNING" in line]
    assert len(warning) == 1 and "layer 'own': 10 values were inf in the model's own output" in warning[0]
    f = open_features(out)
    stored = f.load("own", dtype=None)
    assert stored.dtype == np.float16 and np.isposinf(stored[:, 0]).all() and np.isfinite(stored[:, 1:]).all()
    expected = reference(tiny_models.own_inf_net().eval(), synthetic_images(10), {"own": ("own", None)}, "avg")
    np.testing.assert_array_equal(stored, expected["own"].astype(np.float16))
    got = f.stats("own")
    assert (got["float16_overflow"], got["infinite"]) == numpy_counts(stored) == (0, 10)


def test_a_chunk_row_counts_float16_overflow_and_infinities_apart_and_old_layouts_merge():
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((64, 5)) * 40000).astype(np.float32)
    values[3, 1], values[9, 4], values[10] = np.inf, -np.inf, np.nan  # a NaN row is not counted at all
    values[11, 0] = 65504.0  # float16's largest: within range
    row, at = chunk_row(values), columns(5)
    assert row.shape == (5 + 2 * 5,)
    assert (row[at["float16_overflow"][0]], row[at["infinite"][0]]) == numpy_counts(values)
    assert numpy_counts(values)[0] > 0
    # a store from before the two counts: its rows have 3 + 2F columns, its layout says so
    old = {"count": [0, 1], "sum_norm": [1, 2], "max_abs": [2, 3], "sum": [3, 8], "sumsq": [8, 13]}
    finite = chunk_row(values[:3])
    keep = [0, 1, 2, *range(5, 15)]
    merged, now = merge(finite[keep][None], old, (5,)), merge(finite[None], columns(5), (5,))
    assert merged["float16_overflow"] is None and merged["infinite"] is None
    assert now["float16_overflow"] == numpy_counts(values[:3])[0] and now["infinite"] == 0
    np.testing.assert_array_equal(merged["mean"], now["mean"])
    assert math.isclose(merged["mean_norm"], now["mean_norm"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    documents = list(real_documents(10))
    write_jsonl(root / "docs.jsonl", documents)
    return root, documents, save_text_model("gpt2", root / "gpt2")


TEXT_LAYERS = {"transformer.h.0": 1, "hidden_states.2": 2}  # stored layer -> index into hidden_states


def test_a_token_store_in_bfloat16_equals_each_document_run_alone_bit_for_bit(corpus, tmp_path, cli):
    import transformers as tf

    root, documents, model_dir = corpus
    out = tmp_path / "tokens.zarr"
    # one document a batch: the shapes of the document run alone, so the same float32 values to round
    code, _, err = cli("--model", f"hf:{model_dir}", "--layers", *TEXT_LAYERS, "--data", f"text:{root / 'docs.jsonl'}",
                       "--dtype", "bfloat16", "--context-length", "64", "--chunk-size", "64",
                       "--tokens-per-batch", "1", "--out", out)  # fmt: skip
    assert code == 0, err
    f = open_features(out)
    tokenizer, model = tf.AutoTokenizer.from_pretrained(model_dir), tf.AutoModelForCausalLM.from_pretrained(model_dir)
    alone = {layer: [] for layer in TEXT_LAYERS}
    for i, document in enumerate(documents):
        ids = torch.tensor([tokenizer(document, truncation=True, max_length=64)["input_ids"]])
        with torch.inference_mode():
            hidden = model.eval()(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        hidden = hidden.hidden_states
        for layer, number in TEXT_LAYERS.items():
            stored = f.text.document(i, layer, dtype=None, as_torch=True)
            assert torch.equal(stored.view(torch.int16), bits(hidden[number][0])), (i, layer)
            alone[layer].append(hidden[number][0].to(torch.bfloat16))
    every = {layer: torch.cat(rows) for layer, rows in alone.items()}
    for layer in TEXT_LAYERS:
        assert np.array_equal(f.load(layer), every[layer].float().numpy())
        got = f.stats(layer)
        assert (got["float16_overflow"], got["infinite"]) == numpy_counts(f.load(layer))
    # TokenStream: bfloat16 rows bit for bit (read straight into the window), or float32 of them
    for dtype in ("bfloat16", "float32"):
        stream = TokenStream(out, list(TEXT_LAYERS), batch_size=37, dtype=dtype, return_index=True, window=2)
        seen = []
        for batch, rows in stream:
            for layer in TEXT_LAYERS:
                assert batch[layer].dtype == getattr(torch, dtype)
                assert torch.equal(batch[layer], every[layer][rows].to(batch[layer].dtype))
            seen.append(rows)
        assert sorted(torch.cat(seen).tolist()) == list(range(f.num_samples))
    high = TokenStream(out, "transformer.h.0", batch_size=64, dtype="bfloat16", exclude="high_norm:1.5")
    norms = every["transformer.h.0"].float().norm(dim=1)
    assert sum(len(b) for b in high) == int((norms <= 1.5 * float(np.median(norms.numpy()))).sum())
    assert json.loads((out / "zarr.json").read_text())["attributes"]["dtype"] == "bfloat16"
