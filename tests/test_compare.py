"""Linear CKA (minibatch, unbiased) against direct numpy computations, its invariances, two stores matched by keys."""

import itertools
import json

import numpy as np
import pytest
import zarr
from helpers.stores import add_keys, array_store
from PIL import Image

from extract import ExtractError, Features, open_features
from extract.analysis.cka import Side, compare, minibatch_cka, parse_target
from extract.cli.compare import main


def hsic_u_statistic(x, y):
    """Unbiased HSIC with linear kernels as the U-statistic it is (Song et al. 2012): the mean over
    ordered 4-tuples of distinct samples of k_ij l_ij + k_ij l_qr - 2 k_ij l_iq."""
    k, m = x @ x.T, y @ y.T
    tuples = np.array(list(itertools.permutations(range(len(x)), 4)))
    i, j, q, r = tuples.T
    return np.mean(k[i, j] * m[i, j] + k[i, j] * m[q, r] - 2 * k[i, j] * m[i, q])


def cka_u_statistic(x, y):
    return hsic_u_statistic(x, y) / np.sqrt(hsic_u_statistic(x, x) * hsic_u_statistic(y, y))


def hsic_closed_form(x, y):
    """Song et al. 2012, eq. 5, on whole numpy Gram matrices."""
    n = len(x)
    k, m = x @ x.T, y @ y.T
    k, m = k - np.diag(np.diag(k)), m - np.diag(np.diag(m))
    ones = np.ones(n)
    return (np.sum(k * m) + k.sum() * m.sum() / ((n - 1) * (n - 2)) - 2 / (n - 2) * (k @ ones) @ (m @ ones)) / (
        n * (n - 3)
    )


def cka_closed_form(x, y):
    return hsic_closed_form(x, y) / np.sqrt(hsic_closed_form(x, x) * hsic_closed_form(y, y))


def biased_linear_cka(x, y):
    """The usual (biased) linear CKA of Kornblith et al. 2019 on centered features."""
    x, y = x - x.mean(0), y - y.mean(0)
    return np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y))


def layers(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)) + 2.0  # not centered: the estimator must not care
    y = np.c_[x[:, :2] @ rng.normal(size=(2, 3)), rng.normal(size=(n, 4))]
    q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    rotated = x @ q * 3.7  # an orthogonal transform and an isotropic scaling of x
    return {name: v.astype(np.float32) for name, v in {"x": x, "y": y, "rotated": rotated}.items()}


def one_side(path, names=None):
    features = open_features(path)
    names = names or features.layers
    return Side(features, names, dict.fromkeys(names), np.flatnonzero(features.valid))


def test_closed_form_equals_the_u_statistic():
    values = layers(8, seed=4)
    x, y = values["x"].astype(float), values["y"].astype(float)
    assert hsic_closed_form(x, y) == pytest.approx(hsic_u_statistic(x, y), rel=1e-9)


def test_equals_the_u_statistic_for_small_n(tmp_path):
    values = layers(9)
    store = array_store(tmp_path / "a.zarr", values, np.zeros(9, int), chunk_size=4)
    cka = minibatch_cka(one_side(store), batch_size=64)  # one minibatch holds all 9 samples
    expected = np.array([[cka_u_statistic(values[a].astype(float), values[b].astype(float)) for b in cka.cols]
                         for a in cka.rows])  # fmt: skip
    np.testing.assert_allclose(cka.matrix, expected, rtol=1e-9, atol=1e-9)
    assert cka.num_samples == 9 and cka.rows == cka.cols == ["x", "y", "rotated"]


def test_identity_orthogonal_and_scale_invariance(tmp_path, monkeypatch):
    values = layers(300, seed=1)
    store = array_store(tmp_path / "a.zarr", values, np.zeros(300, int), chunk_size=32)
    reads = []
    original = Features.load
    monkeypatch.setattr(
        Features,
        "load",
        lambda self, layer, index, **kw: reads.append(len(index)) or original(self, layer, index, **kw),
    )
    cka = minibatch_cka(one_side(store), batch_size=64, window=2)
    assert sum(reads) == 3 * 300  # every sample of every layer read once: windows, not minibatches, are read
    monkeypatch.undo()
    at = {name: i for i, name in enumerate(cka.rows)}
    np.testing.assert_allclose(np.diag(cka.matrix), 1.0, rtol=1e-12)  # identical layers
    assert cka.matrix[at["x"], at["rotated"]] == pytest.approx(1.0, abs=1e-6)  # x against x Q s
    assert cka.matrix[at["y"], at["rotated"]] == pytest.approx(cka.matrix[at["y"], at["x"]], abs=1e-6)
    np.testing.assert_allclose(cka.matrix, cka.matrix.T, rtol=1e-12)
    # many minibatches estimate the same quantity as one big batch and as the biased CKA at this N
    whole = minibatch_cka(one_side(store), batch_size=1000).matrix[at["x"], at["y"]]
    assert cka.matrix[at["x"], at["y"]] == pytest.approx(whole, abs=0.05)
    assert whole == pytest.approx(biased_linear_cka(values["x"], values["y"]), abs=0.05)


def test_two_stores_matched_by_keys(tmp_path, capsys):
    values = layers(60, seed=2)
    a = array_store(tmp_path / "a.zarr", {"x": values["x"], "y": values["y"]}, np.zeros(60, int), chunk_size=8)
    add_keys(a, [f"img/{i:03d}.png" for i in range(60)])
    # B holds 40 of A's samples, in another order, plus 5 of its own, with a different model's layer
    rng = np.random.default_rng(0)
    shared = rng.permutation(60)[:40]
    extra = rng.normal(size=(5, 6)).astype(np.float32)
    b_values = np.concatenate([values["rotated"][shared], extra])
    b = array_store(tmp_path / "b.zarr", {"rot": b_values}, np.zeros(45, int), chunk_size=8)
    add_keys(b, [f"img/{i:03d}.png" for i in shared] + [f"other/{i}.png" for i in range(5)])

    cka = compare(f"{a}:x,y", str(b), batch_size=1000)
    assert cka.rows == ["x", "y"] and cka.cols == ["rot"] and cka.num_samples == 40
    assert "40 samples matched by key" in cka.matched
    assert cka.matrix[0, 0] == pytest.approx(1.0, abs=1e-6)  # the same samples, rotated and scaled
    rows = np.sort(shared)  # the pairs in A's order
    expected = cka_closed_form(values["y"][rows].astype(float), values["rotated"][rows].astype(float))
    assert cka.matrix[1, 0] == pytest.approx(expected, abs=1e-6)
    drawn = compare(f"{a}:y", f"{b}:rot", batch_size=1000, max_samples=12, seed=5)
    assert drawn.num_samples == 12 and "12 drawn at random" in drawn.matched

    # the command line: matrix printed, heatmap and JSON written
    png, out = tmp_path / "cka.png", tmp_path / "cka.json"
    assert main([f"{a}:x,y", str(b), "--heatmap", str(png), "--json", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("linear CKA (minibatch, unbiased; 40 samples, 40 samples matched by key")
    assert printed[1] == f"rows: layers of {a}; columns: layers of {b}"  # which store is which
    assert printed[2].split() == ["rot"] and printed[3].split()[0] == "x" and printed[4].split()[0] == "y"
    assert float(printed[3].split()[1]) == pytest.approx(1.0, abs=1e-3)
    written = json.loads(out.read_text())
    assert written["cols"] == ["rot"] and (written["row_store"], written["col_store"]) == (str(a), str(b))
    with Image.open(png) as image:
        assert image.format == "PNG" and min(image.size) > 200


def test_without_keys_rows_match_by_index_or_fail(tmp_path, capsys):
    values = layers(20, seed=3)
    a = array_store(tmp_path / "a.zarr", {"x": values["x"]}, np.zeros(20, int), chunk_size=8)
    b = array_store(tmp_path / "b.zarr", {"x": values["rotated"]}, np.zeros(20, int), chunk_size=8)
    c = array_store(tmp_path / "c.zarr", {"x": values["x"][:10]}, np.zeros(10, int), chunk_size=8)
    cka = compare(str(a), str(b))
    assert "matched by row index" in cka.matched and cka.matrix[0, 0] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ExtractError, match="cannot be matched: a store has no keys"):
        compare(str(a), str(c))
    assert main([str(a), f"{b}:nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("extract.compare: error: layer 'nope' is not in") and err.count("\n") == 1
    assert main([str(tmp_path / "missing.zarr")]) == 2
    assert "no such store" in capsys.readouterr().err


def test_parse_target_allows_colons_in_layer_names(tmp_path):
    (tmp_path / "s.zarr").mkdir()
    assert parse_target(str(tmp_path / "s.zarr")) == (str(tmp_path / "s.zarr"), None)
    assert parse_target(f"{tmp_path}/s.zarr:blocks.0:0,head") == (f"{tmp_path}/s.zarr", ["blocks.0:0", "head"])


def test_cka_of_an_extracted_store(cli, tmp_path, capsys):
    out = tmp_path / "r18.zarr"
    code, _, err = cli("--model", "resnet18", "--weights", "none", "--image-size", "32", "--layers", "layer3", "layer4",
                       "--data", "synthetic:40", "--chunk-size", "8", "--num-workers", "0", "--out", out)  # fmt: skip
    assert code == 0, err
    assert main([f"{out}:layer*", "--batch-size", "64"]) == 0
    printed = capsys.readouterr().out.splitlines()
    got = float(printed[2].split()[2])  # row layer3, column layer4
    group = zarr.open_group(out, mode="r")
    pooled = [group[f"features/{layer}"][:].astype(np.float64).mean(axis=(2, 3)) for layer in ("layer3", "layer4")]
    assert got == pytest.approx(cka_closed_form(*pooled), abs=1e-3)


@pytest.mark.cuda
def test_cka_on_cuda_equals_cpu(tmp_path):
    values = layers(200, seed=6)
    store = array_store(tmp_path / "a.zarr", values, np.zeros(200, int), chunk_size=16)
    cpu = minibatch_cka(one_side(store), batch_size=64, device="cpu").matrix
    gpu = minibatch_cka(one_side(store), batch_size=64, device="cuda").matrix
    np.testing.assert_allclose(gpu, cpu, rtol=1e-9, atol=1e-9)


def test_stores_whose_keys_differ_say_so_and_match_by_rows(tmp_path, capsys):
    """The same images read from a folder and from shards: keys differ, N agrees."""
    values = layers(30, seed=7)
    a = array_store(tmp_path / "wds.zarr", {"x": values["x"]}, np.zeros(30, int), chunk_size=8)
    add_keys(a, [f"shard-000000.tar/{i:06d}" for i in range(30)])
    b = array_store(tmp_path / "pq.zarr", {"x": values["rotated"]}, np.zeros(30, int), chunk_size=8)
    add_keys(b, [f"train.parquet/{i}" for i in range(30)])
    assert main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"extract.compare: error: no keys match between {a} and {b} (e.g. 'shard-000000.tar/000000' and "
        "'train.parquet/0'); if row i is the same image in both (30 samples each), compare with --match rows\n"
    )
    assert main([str(a), str(b), "--match", "rows"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "matched by row index (30 samples; --match rows" in printed[0]
    assert float(printed[3].split()[1]) == pytest.approx(1.0, abs=1e-3)
    c = array_store(tmp_path / "c.zarr", {"x": values["x"][:20]}, np.zeros(20, int), chunk_size=8)
    add_keys(c, [f"other/{i}" for i in range(20)])
    with pytest.raises(ExtractError, match="they hold 30 and 20 samples: not the same images"):
        compare(str(a), str(c))
    with pytest.raises(ExtractError, match="--match rows needs stores of the same size"):
        compare(str(a), str(c), match="rows")


def test_constant_layer_gets_nan_drawn_as_constant(tmp_path, capsys):
    values = layers(40, seed=8)
    values["cls0"] = np.tile(np.float32([0.5, -1.0, 2.0]), (40, 1))  # the same for every input
    store = array_store(tmp_path / "c.zarr", values, np.zeros(40, int), chunk_size=8)
    cka = compare(str(store), batch_size=16)
    at = cka.rows.index("cls0")
    assert np.isnan(cka.matrix[at]).all() and np.isnan(cka.matrix[:, at]).all()  # its own diagonal too
    others = np.delete(np.delete(cka.matrix, at, 0), at, 1)
    assert np.isfinite(others).all() and cka.constant == ("cls0",)
    png, out = tmp_path / "h.png", tmp_path / "c.json"
    assert main([str(store), "--heatmap", str(png), "--json", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("layer 'cls0' is constant (the same features for every sample")
    assert printed[-1].split() == ["cls0", "const", "const", "const", "const"]
    assert json.loads(out.read_text())["cka"][at] == [None] * 4
    with Image.open(png) as image:
        assert image.format == "PNG"


def test_a_layer_that_cannot_be_used_is_left_out_with_a_note(tmp_path, capsys):
    values = layers(40, seed=9)
    maps = np.repeat(values["x"][:, :, None, None], 4, axis=2).reshape(40, 6, 2, 2)
    store = array_store(tmp_path / "m.zarr", {"map": maps, "x": values["x"], "y": values["y"]}, np.zeros(40, int), 8)
    assert main([str(store), "--pool", "avg"]) == 0  # avg fits the map only
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"skipped layer 'x' of {store}: load('x', pool='avg') needs (B, C, H, W)")
    assert printed[1].startswith(f"skipped layer 'y' of {store}: ")
    assert printed[3].split() == ["map"] and float(printed[4].split()[1]) == pytest.approx(1.0)
    assert main([f"{store}:x,y", "--pool", "avg"]) == 2
    assert capsys.readouterr().err.startswith("extract.compare: error: no layer left to compare (x: load('x'")
