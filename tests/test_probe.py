"""Probes end to end: the linear probe (L-BFGS and mini-batch), k-NN against brute force, train/test stores."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr
from helpers import ROOT, TINY
from helpers.stores import array_store

from extract import ExtractError, open_features
from extract.analysis.knn import knn_predict
from extract.analysis.probe import ProbeOptions, probe, probe_layers, split
from extract.analysis.samples import Samples, labelled_rows
from extract.cli.probe import main


def test_probe_learns_synthetic_classes(cli, capsys, tmp_path):
    out = tmp_path / "probe.zarr"
    code, _, err = cli(
        "--model", "resnet18", "--weights", "none", "--image-size", "32", "--pool", "avg",
        "--layers", "layer2", "layer4", "--data", "synthetic:200", "--num-workers", "0", "--out", out,
    )  # fmt: skip
    assert code == 0, err
    accuracies = probe(out, epochs=50, log=lambda line: None)
    assert set(accuracies) == {"layer2", "layer4"}
    assert max(accuracies.values()) >= 0.6  # chance is 0.1

    assert main([str(out), "--layers", "layer4", "--epochs", "50", "--test-fraction", "0.25"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("layer4: test accuracy ")
    assert "150 train / 50 test, 512 features, pool avg at extraction, 10 classes" in lines[0]  # not "pool none"
    # deterministic for a seed
    assert probe(out, ["layer4"], epochs=50, log=lambda line: None)["layer4"] == accuracies["layer4"]

    assert main([str(out), "--test-fraction", "1.5"]) == 2
    assert "--test-fraction must be between 0 and 1" in capsys.readouterr().err


def test_split_is_seeded_and_disjoint():
    labelled = np.arange(3, 103)
    train, test = split(labelled, 0.2, seed=4)
    assert len(test) == 20 and sorted([*train, *test]) == labelled.tolist()
    assert np.array_equal(split(labelled, 0.2, seed=4)[1], test)
    assert not np.array_equal(split(labelled, 0.2, seed=5)[1], test)
    with pytest.raises(ExtractError, match="too few"):
        split(np.arange(1), 0.5, seed=0)


def test_probe_options_are_checked_when_made():
    assert ProbeOptions().method == "linear" and ProbeOptions(lrs=[0.1, 0.3]).lrs == (0.1, 0.3)  # frozen: a tuple
    for options, message in [
        ({"method": "svm"}, "unknown --method 'svm'; choose one of linear, knn"),
        ({"solver": "adam"}, "unknown --solver 'adam'; choose one of auto, lbfgs, sgd"),
        ({"k": 0}, "--k must be positive and --temperature above 0; got 0 and 0.07"),
        ({"temperature": 0}, "--k must be positive and --temperature above 0; got 20 and 0"),
        ({"epochs": 0}, "--epochs and --batch-size must be positive, --num-workers 0 or more; got 0, 256, 0"),
        ({"num_workers": -1}, "got None, 256, -1"),
    ]:
        with pytest.raises(ExtractError, match=re.escape(message)):
            ProbeOptions(**options)
    # the convenience function takes the same names, and fails on a misspelt one before opening anything
    with pytest.raises(ExtractError, match="unknown --method 'svm'"):
        probe("no-such.zarr", method="svm")
    with pytest.raises(TypeError, match="epoch"):
        probe("no-such.zarr", epoch=5)


# --- k-NN, the mini-batch linear probe, train/test stores, layer globs --------------------------------

QUIET = {"log": lambda line: None}


@pytest.fixture(scope="module")
def r18_store(tmp_path_factory):
    """resnet18 layer3 as full (256, 2, 2) maps and layer4 pooled, 96 synthetic images in 6 chunks."""
    from extract.cli.extract import main as extract_main

    out = tmp_path_factory.mktemp("knn") / "train.zarr"
    assert extract_main([
        "--model", "resnet18", "--weights", "none", "--image-size", "32", "--layers", "layer3", "layer4",
        "--data", "synthetic:96", "--chunk-size", "16", "--num-workers", "0", "--dtype", "float32", "--out", str(out),
    ]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def folder_store(tmp_path_factory, png_tree):
    """The same model over an ImageFolder: another store with the same layers (a 'val' set)."""
    from extract.cli.extract import main as extract_main

    out = tmp_path_factory.mktemp("knn") / "test.zarr"
    assert extract_main([
        "--model", "resnet18", "--weights", "none", "--image-size", "32", "--layers", "layer3", "layer4",
        "--data", f"imagefolder:{png_tree[0]}", "--chunk-size", "4", "--num-workers", "0", "--dtype", "float32",
        "--out", str(out),
    ]) == 0  # fmt: skip
    return out


def brute_force_knn(train_x, train_y, test_x, num_classes, k=20, temperature=0.07):
    """DINO's weighted k-NN on whole matrices in float64, straight from its definition."""
    train_x = train_x / np.linalg.norm(train_x, axis=1, keepdims=True)
    test_x = test_x / np.linalg.norm(test_x, axis=1, keepdims=True)
    similarity = test_x @ train_x.T
    nearest = np.argsort(-similarity, axis=1, kind="stable")[:, :k]
    votes = np.zeros((len(test_x), num_classes))
    for i, row in enumerate(nearest):
        np.add.at(votes[i], train_y[row], np.exp(similarity[i, row] / temperature))
    return votes.argmax(1)


def stored(path, layer):
    """A layer as zarr reads it, average-pooled over H, W by numpy: the reference's own read."""
    group = zarr.open_group(path, mode="r")
    values = group[f"features/{layer}"][:].astype(np.float64)
    return values.mean(axis=(2, 3)) if values.ndim == 4 else values, group["labels"][:]


@pytest.mark.parametrize("layer", ["layer3", "layer4"])
def test_knn_equals_brute_force_on_an_in_store_split(r18_store, layer):
    x, y = stored(r18_store, layer)
    train, test = split(np.arange(len(y)), 0.25, seed=3)
    expected = brute_force_knn(x[train], y[train], x[test], 10)
    features = open_features(r18_store)
    parts = [Samples(features, layer, "avg", rows) for rows in (train, test)]
    # blocks of one chunk (16 rows) on both sides: the running top-k merges 5 training blocks per query block
    got = knn_predict(*parts, 10, train_block_bytes=1, test_block_bytes=1)
    np.testing.assert_array_equal(got, expected)
    assert not np.array_equal(got, np.full_like(got, np.bincount(y[train]).argmax()))  # it is not trivial
    knn = ProbeOptions(method="knn", seed=3)
    record = probe_layers(r18_store, [layer], knn, test_fraction=0.25, **QUIET)[layer]
    assert record["test_accuracy"] == pytest.approx((expected == y[test]).mean())
    assert (record["num_train"], record["num_test"], record["k"], record["temperature"]) == (72, 24, 20, 0.07)


def test_knn_equals_brute_force_across_train_and_test_stores(r18_store, folder_store, capsys, tmp_path):
    x_train, y_train = stored(r18_store, "layer3")
    x_test, y_test = stored(folder_store, "layer3")
    for k, temperature in ((20, 0.07), (5, 0.5)):
        expected = brute_force_knn(x_train, y_train, x_test, 10, k, temperature)
        train, test = open_features(r18_store), open_features(folder_store)
        got = knn_predict(
            Samples(train, "layer3", "avg", labelled_rows(train)), Samples(test, "layer3", "avg", labelled_rows(test)),
            10, k=k, temperature=temperature, train_block_bytes=1, similarity_bytes=24 * 13 * 40,
        )  # fmt: skip
        np.testing.assert_array_equal(got, expected)
    # the command line, with --json
    out = tmp_path / "knn.json"
    code = main(["--train", str(r18_store), "--test", str(folder_store), "--method", "knn", "--k", "5",
                 "--temperature", "0.5", "--layers", "layer*", "--json", str(out)])  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["layer3", "layer4"]
    assert "96 train / 13 test, 256 features, pool avg, 10 classes" in lines[0]
    written = json.loads(out.read_text())
    assert written["train"] == str(r18_store) and [r["layer"] for r in written["layers"]] == ["layer3", "layer4"]
    assert written["layers"][0]["test_accuracy"] == pytest.approx((expected == y_test).mean())


def test_layer_globs_and_unknown_layers(tmp_path, capsys):
    from extract.cli.extract import main as extract_main

    out = tmp_path / "vit.zarr"
    assert extract_main(["--model", f"{TINY}:tiny_vit", "--layers", "encoder.layers.*", "--data", "synthetic:40",
                         "--image-size", "32", "--num-workers", "0", "--out", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    assert main([str(out), "--layers", "encoder.layers.*", "--method", "knn"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": test")[0] for line in lines] == [
        "encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"
    ]  # fmt: skip
    assert all("pool cls" in line for line in lines)
    # '*' stays within one segment, as at extraction: 'encoder.*' names no stored layer
    assert main([str(out), "--layers", "encoder.*"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("extract.probe: error: layer 'encoder.*' is not in")
    assert main([str(out), "--layers", "encoder.layers.encoder_layer_7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "closest: encoder.layers.encoder_layer_" in err and "Traceback" not in err
    assert main(["--train", str(out)]) == 2
    assert "both --train STORE and --test STORE" in capsys.readouterr().err
    assert main([str(out), "--method", "svm"]) == 2
    assert "unknown --method 'svm'" in capsys.readouterr().err
    if not torch.cuda.is_available():  # without a GPU the default is the CPU; asking for one is an error
        assert main([str(out), "--method", "knn", "--device", "cuda"]) == 2
        assert "no CUDA device here; use --device cpu" in capsys.readouterr().err


def gaussian_classes(n, dim=64, classes=10, seed=0):
    """Overlapping Gaussian classes (offset and scaled, so standardization matters): a probe reaches
    about 80%, far from both chance and 100%, where the two solvers can actually differ."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(classes, dim)) * 0.35
    labels = rng.integers(0, classes, n)
    x = (means[labels] + rng.normal(size=(n, dim))) * rng.uniform(0.5, 4, dim) + rng.normal(size=dim) * 3
    return x.astype(np.float32), labels


def test_minibatch_probe_matches_lbfgs_and_is_deterministic(tmp_path):
    x, y = gaussian_classes(3000)
    store = array_store(tmp_path / "gauss.zarr", {"feat": x}, y, chunk_size=128)
    lbfgs = probe_layers(store, options=ProbeOptions(solver="lbfgs"), **QUIET)["feat"]
    sgd = probe_layers(store, options=ProbeOptions(solver="sgd", epochs=5), **QUIET)["feat"]
    assert lbfgs["solver"] == "lbfgs" and sgd["solver"] == "sgd"
    assert 0.6 < lbfgs["test_accuracy"] < 0.95
    assert sgd["test_accuracy"] >= lbfgs["test_accuracy"] - 0.01, (sgd, lbfgs)
    assert set(sgd["lr_sweep"]) == {"0.01", "0.03", "0.1", "0.3"} and str(sgd["lr"]) in sgd["lr_sweep"]
    again = probe_layers(store, options=ProbeOptions(solver="sgd", epochs=5), **QUIET)["feat"]
    assert again == sgd  # deterministic for a seed
    auto = ProbeOptions(solver="auto")
    assert probe_layers(store, options=auto, **QUIET)["feat"]["solver"] == "lbfgs"  # small N: the exact path
    auto = ProbeOptions(solver="auto", max_full_batch_mib=0.5, lrs=[0.1], epochs=1)
    assert probe_layers(store, options=auto, **QUIET)["feat"]["solver"] == "sgd"


def test_streaming_standardizer_equals_full_statistics(tmp_path):
    from extract.analysis.linear import streaming_standardizer

    x, y = gaussian_classes(1000, dim=8)
    store = array_store(tmp_path / "s.zarr", {"feat": x}, y, chunk_size=64)
    rows = np.sort(np.random.default_rng(0).choice(1000, 700, replace=False))
    samples = Samples(open_features(store), "feat", None, rows)
    standardize = streaming_standardizer(samples)
    full = torch.from_numpy(x[rows])
    torch.testing.assert_close(standardize.mean, full.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(standardize.std, full.std(0), rtol=1e-5, atol=1e-5)


# VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across exec, so a child would inherit the
# peak of the pytest process it was forked from.
PEAK_RSS = """
import sys
from extract.cli.probe import main
code = main(sys.argv[1:])
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))  # KiB
sys.exit(code)
"""


def peak_rss_mib(*args):
    # a fixed mmap threshold makes glibc return freed blocks, so RSS tracks what the probe holds
    env = {
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PATH": "/usr/bin:/bin",
        "MALLOC_MMAP_THRESHOLD_": "1048576",
    }
    result = subprocess.run([sys.executable, "-c", PEAK_RSS, *map(str, args)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.splitlines()[-1]) / 1024


def test_minibatch_probe_memory_stays_bounded(tmp_path):
    """Peak RSS of the mini-batch probe on a 156 MiB layer (10 read blocks) against the same probe
    on a 16 MiB one: the difference stays far below the layer's size (the full-batch path would hold
    the 125 MiB training part, and more)."""
    dim, chunk = 1024, 256  # 1 MiB chunks: the sampler window (8 chunks) is small next to the layer
    sizes = {}
    for n in (4_000, 40_000):
        rng = np.random.default_rng(0)
        y = rng.integers(0, 10, n)
        x = (rng.standard_normal((n, dim), dtype=np.float32) + y[:, None] * 0.01).astype(np.float32)
        store = array_store(tmp_path / f"{n}.zarr", {"feat": x}, y, chunk_size=chunk)
        del x
        sizes[n] = peak_rss_mib(store, "--solver", "sgd", "--lrs", "0.1", "--epochs", "1", "--batch-size", "512")
    layer_mib = 40_000 * dim * 4 / 2**20
    growth = sizes[40_000] - sizes[4_000]
    print(f"peak RSS {sizes[4_000]:.0f} MiB (16 MiB layer) vs {sizes[40_000]:.0f} MiB ({layer_mib:.0f} MiB layer)")
    assert growth < 0.25 * layer_mib, sizes


@pytest.mark.cuda
def test_knn_and_minibatch_probe_on_cuda_equal_cpu(r18_store):
    cpu = probe_layers(r18_store, ["layer4"], ProbeOptions(method="knn", device="cpu"), **QUIET)["layer4"]
    gpu = probe_layers(r18_store, ["layer4"], ProbeOptions(method="knn", device="cuda"), **QUIET)["layer4"]
    assert gpu["test_accuracy"] == cpu["test_accuracy"]
    cpu = probe_layers(r18_store, ["layer4"], ProbeOptions(solver="sgd", device="cpu", epochs=3), **QUIET)["layer4"]
    gpu = probe_layers(r18_store, ["layer4"], ProbeOptions(solver="sgd", device="cuda", epochs=3), **QUIET)["layer4"]
    assert abs(gpu["test_accuracy"] - cpu["test_accuracy"]) <= 0.05


def test_probe_compare_and_report_work_on_an_avg_k_store(tmp_path, capsys):
    """``--pool avg:2`` stores (C, 2, 2) maps: the store records them as NCHW, so the analysis
    commands can average them further without a --layout they do not have."""
    from extract.cli.compare import main as compare_main
    from extract.cli.extract import main as extract_main
    from extract.cli.report import main as report_main

    out = tmp_path / "avgk.zarr"
    assert extract_main([
        "--model", "resnet18", "--weights", "none", "--image-size", "32", "--layers", "layer2", "layer3",
        "--pool", "layer2=avg:2", "layer3=avg", "--data", "synthetic:40", "--chunk-size", "8", "--num-workers", "0",
        "--out", str(out),
    ]) == 0  # fmt: skip
    features = open_features(out)
    assert features.attrs["layouts"] == {"layer2": "NCHW", "layer3": None}
    assert features.shapes["layer2"] == (128, 2, 2)
    capsys.readouterr()
    assert main([str(out), "--method", "knn"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["layer2", "layer3"]
    assert "128 features, pool avg:2 at extraction, then avg" in lines[0] and "pool avg at extraction" in lines[1]
    assert compare_main([str(out)]) == 0
    assert "linear CKA" in capsys.readouterr().out
    assert report_main([str(out), "--out", str(tmp_path / "report.html")]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'report.html'}: ")


def test_a_layer_that_cannot_be_used_is_skipped_with_a_note(tmp_path, capsys):
    x, y = gaussian_classes(200, dim=16)
    maps = np.repeat(x[:, :, None, None], 4, axis=2).reshape(200, 16, 2, 2)
    store = array_store(tmp_path / "mixed.zarr", {"map": maps, "vec": x}, y, chunk_size=50)
    # --pool avg fits the map, not the vector: the vector is skipped, the map still probed
    assert main([str(store), "--pool", "avg", "--method", "knn"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("map: test accuracy ")
    assert lines[1].startswith("vec: skipped (load('vec', pool='avg') needs (B, C, H, W) outputs") and len(lines) == 2
    # no layer left: one line, exit 2, each layer's reason
    assert main([str(store), "--layers", "vec", "--pool", "avg"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("extract.probe: error: no layer left to probe (vec: load('vec'")


def test_a_constant_layer_is_reported_as_constant_not_scored(tmp_path, capsys):
    x, y = gaussian_classes(200, dim=16)
    constant = np.tile(np.linspace(-1, 1, 8, dtype=np.float32), (200, 1))  # a class token: the same for every input
    store = array_store(tmp_path / "const.zarr", {"cls0": constant, "vec": x}, y, chunk_size=50)
    records = probe_layers(store, options=ProbeOptions(), **QUIET)
    assert records["cls0"]["constant"] is True and records["cls0"]["test_accuracy"] is None
    assert records["vec"]["test_accuracy"] > 0.2 and "constant" not in records["vec"]  # chance is 0.1
    assert np.isnan(probe(store, ["cls0"], log=lambda line: None)["cls0"])
    out = tmp_path / "p.json"
    assert main([str(store), "--method", "knn", "--json", str(out)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("cls0: constant, not scored (every training sample has the same features")
    assert json.loads(out.read_text())["layers"][0]["test_accuracy"] is None


def test_train_and_test_stores_use_the_layers_both_hold(tmp_path, capsys):
    x, y = gaussian_classes(200, dim=16)
    train = array_store(tmp_path / "a.zarr", {"layer2": x, "layer3": x[:, :8]}, y, chunk_size=50)
    test = array_store(tmp_path / "b.zarr", {"layer2": x[:100], "layer4": x[:100, :4]}, y[:100], chunk_size=50)
    assert main(["--train", str(train), "--test", str(test), "--method", "knn"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"left out, not in both stores: layer3 (only in {train}), layer4 (only in {test})"
    assert lines[1].startswith("layer2: test accuracy ") and len(lines) == 2
    assert main(["--train", str(train), "--test", str(test), "--layers", "layer3"]) == 2
    assert f"hold no layer in common: layer3 (only in {train})" in capsys.readouterr().err
