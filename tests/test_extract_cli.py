"""End-to-end single-process runs of the CLI, compared with an independent forward pass."""

import argparse
import json
import re

import numpy as np
import pytest
import torch
import zarr
from helpers import TINY
from helpers.cli import SMALL
from helpers.launches import Sequence
from helpers.reference import load_images, reference, resnet18, synthetic_images


def read(store, layer):
    return zarr.open_group(store, mode="r")[f"features/{layer}"][:]


@pytest.fixture
def filelist(png_tree, tmp_path):
    root, files = png_tree
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{path}\t{label}\n" for path, label in files))
    return listing, files


def test_imagefolder_features_equal_reference(cli, png_tree, tmp_path):
    root, files = png_tree
    out = tmp_path / "f.zarr"
    layers = ["layer2", "layer3", "layer4.0.conv1", "avgpool"]
    code, _, err = cli(
        "--model", "resnet18", "--weights", "none", "--layers", *layers, "--data", f"imagefolder:{root}",
        "--out", out, "--image-size", "32", "--batch-size", "5", "--chunk-size", "4", "--dtype", "float32",
        "--num-workers", "0",
    )  # fmt: skip
    assert code == 0, err
    assert "13 samples" in err
    expected = reference(resnet18(), load_images([f for f, _ in files], 32), {name: (name, None) for name in layers})
    group = zarr.open_group(out, mode="r")
    for name in layers:
        stored = group[f"features/{name}"][:]
        assert stored.shape == expected[name].shape
        assert np.abs(stored - expected[name]).max() <= 1e-5, name
    assert group["labels"][:].tolist() == [label for _, label in files]
    assert group["done"][:].all()
    attrs = group.attrs.asdict()
    assert attrs["status"] == "complete"
    assert attrs["num_samples"] == 13 and attrs["chunk_size"] == 4
    assert attrs["feature_shapes"]["layer3"] == [256, 2, 2]
    recorded = attrs["preprocessing"]
    assert recorded["crop"] == [32, 32] and recorded["resize"] == 37 and recorded["interpolation"] == "bilinear"
    assert recorded["mean"] == [0.485, 0.456, 0.406] and "crop_size=[32]" in recorded["repr"]
    assert attrs["source"] == "torchvision" and attrs["pools"] == dict.fromkeys(layers, "none")
    assert set(attrs["versions"]) >= {"torch", "torchvision", "zarr", "extract"}
    assert group["features/layer3"].metadata.dimension_names == (
        "sample", "layer3.channel", "layer3.height", "layer3.width",
    )  # fmt: skip


def test_filelist_with_labels_and_pooling(cli, filelist, tmp_path):
    listing, files = filelist
    images = load_images([f for f, _ in files], 32)
    for pool in ("avg", "max", "avg:2"):
        out = tmp_path / f"{pool}.zarr"
        code, _, err = cli(
            "--model", "resnet18", "--weights", "none", "--layers", "layer*", "--data", f"filelist:{listing}",
            "--out", out, "--image-size", "32", "--pool", pool, "--dtype", "float32", "--num-workers", "0",
            "--batch-size", "4",
        )  # fmt: skip
        assert code == 0, err
        names = [f"layer{i}" for i in range(1, 5)]
        expected = reference(resnet18(), images, {n: (n, None) for n in names}, pool=pool)
        group = zarr.open_group(out, mode="r")
        assert sorted(group["features"].array_keys()) == names
        for name in names:
            assert np.abs(group[f"features/{name}"][:] - expected[name]).max() <= 1e-5, (pool, name)
        assert group["labels"][:].tolist() == [label for _, label in files]


def test_tuple_output_selector_and_token_pools(cli, tmp_path):
    from helpers.tiny_models import tiny_vit

    images = synthetic_images(6)
    attention = "encoder.layers.encoder_layer_1.self_attention"
    for pool in ("cls", "mean"):
        out = tmp_path / f"{pool}.zarr"
        code, _, err = cli(
            "--model", f"{TINY}:tiny_vit", "--layers", "encoder.layers.*", f"{attention}:0", "--data", "synthetic:6",
            "--out", out, "--image-size", "32", "--pool", pool, "--dtype", "float32", "--num-workers", "0",
        )  # fmt: skip
        assert code == 0, err
        layers = {
            "encoder.layers.encoder_layer_0": ("encoder.layers.encoder_layer_0", None),
            "encoder.layers.encoder_layer_1": ("encoder.layers.encoder_layer_1", None),
            f"{attention}:0": (attention, 0),
        }
        expected = reference(tiny_vit().eval(), images, layers, pool=pool)
        for name in layers:
            stored = read(out, name)
            assert stored.shape == (6, 32)
            assert np.abs(stored - expected[name]).max() <= 1e-5, (pool, name)


def test_dict_output_key_selector(cli, tmp_path):
    from helpers.tiny_models import dict_net

    images = synthetic_images(5)
    out = tmp_path / "d.zarr"
    code, _, err = cli(
        "--model", f"{TINY}:dict_net", "--layers", "heads:map", "heads:pooled", "--data", "synthetic:5",
        "--out", out, "--image-size", "32", "--dtype", "float32", "--num-workers", "0",
    )  # fmt: skip
    assert code == 0, err
    expected = reference(
        dict_net().eval(), images, {"heads:map": ("heads", "map"), "heads:pooled": ("heads", "pooled")}
    )
    for name, value in expected.items():
        assert np.abs(read(out, name) - value).max() <= 1e-5


def test_truncated_equals_untruncated(cli, tmp_path):
    stores = {}
    for flag in ([], ["--no-truncate"]):
        out = tmp_path / f"t{len(flag)}.zarr"
        code, _, err = cli(
            "--model", "resnet18", "--weights", "none", "--layers", "layer2", "layer3.1.bn2", "--data",
            "synthetic:10", "--out", out, "--image-size", "32", "--batch-size", "4", "--num-workers", "0",
            *flag,
        )  # fmt: skip
        assert code == 0, err
        stores[len(flag)] = out
    for layer in ("layer2", "layer3.1.bn2"):
        np.testing.assert_array_equal(read(stores[0], layer), read(stores[1], layer))


def test_inplace_op_after_hooked_layer_does_not_corrupt_capture(cli, png_tree, tmp_path):
    # resnet's bn1 is followed by ReLU(inplace=True), which overwrites bn1's output tensor.
    root, files = png_tree
    out = tmp_path / "bn1.zarr"
    code, _, err = cli(
        "--model", "resnet18", "--weights", "none", "--layers", "bn1", "layer1.0.bn2", "--data",
        f"imagefolder:{root}", "--out", out, "--image-size", "32", "--dtype", "float32", "--num-workers", "0",
        "--no-truncate",
    )  # fmt: skip
    assert code == 0, err
    expected = reference(resnet18(), load_images([f for f, _ in files], 32), {"bn1": ("bn1", None)})
    stored = read(out, "bn1")
    assert (stored < 0).any(), "the ReLU's in-place write reached the store"
    assert np.abs(stored - expected["bn1"]).max() <= 1e-5


def test_checkpoint_is_loaded(cli, tmp_path):
    model = resnet18(seed=123)
    checkpoint = tmp_path / "model.pt"
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    out = tmp_path / "ck.zarr"
    code, _, err = cli(
        "--model", "resnet18", "--checkpoint", checkpoint, "--layers", "layer4", "--pool", "avg", "--data",
        "synthetic:4", "--out", out, "--image-size", "32", "--dtype", "float32", "--num-workers", "0",
    )  # fmt: skip
    assert code == 0, err
    images = synthetic_images(4)
    expected = reference(model, images, {"layer4": ("layer4", None)}, pool="avg")["layer4"]
    assert np.abs(read(out, "layer4") - expected).max() <= 1e-5
    assert zarr.open_group(out, mode="r").attrs["weights"] == f"checkpoint {checkpoint}"


def test_checkpoint_errors(cli, tmp_path):
    wrong = tmp_path / "wrong.pt"
    torch.save({"fc.weight": torch.zeros(3, 3)}, wrong)
    code, _, err = cli(
        "--model",
        "resnet18",
        "--checkpoint",
        wrong,
        "--layers",
        "layer4",
        "--data",
        "synthetic:2",
        "--out",
        tmp_path / "w.zarr",
        "--image-size",
        "32",
    )
    assert code == 2 and "does not fit this model" in err
    assert not (tmp_path / "w.zarr").exists()

    pickled = tmp_path / "pickled.pt"
    torch.save({"obj": argparse.Namespace(a=1)}, pickled)
    code, _, err = cli(
        "--model",
        "resnet18",
        "--checkpoint",
        pickled,
        "--layers",
        "layer4",
        "--data",
        "synthetic:2",
        "--out",
        tmp_path / "p.zarr",
        "--image-size",
        "32",
    )
    assert code == 2 and "unpickling" in err
    assert len(err.strip().splitlines()) == 1


def test_list_layers(cli):
    code, out, err = cli("--model", "resnet18", "--weights", "none", "--list-layers", "--image-size", "32")
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["layer3"].split()[1:] == ["Sequential", "(B,", "256,", "2,", "2)", "NCHW"]
    assert lines["avgpool"].split()[1:] == ["AdaptiveAvgPool2d", "(B,", "512,", "1,", "1)", "NCHW"]
    assert lines["fc"].split()[1:] == ["Linear", "(B,", "1000)"]
    assert "runs 2x" in lines["layer1.0.relu"]
    assert "fc" in lines


@pytest.fixture(scope="module")
def as_a_user_runs_it(tmp_path_factory):
    """One process of its own (tests/helpers/job_sequence.py) runs these commands in turn, behind a proxy that
    goes nowhere: an unknown layer; a download of weights that fails; weights found in the torch hub
    cache (each its own TORCH_HOME, which torch reads at run time)."""
    folder = tmp_path_factory.mktemp("cli")
    from torchvision.models import ResNet18_Weights

    cache = folder / "hub" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(resnet18(seed=7).state_dict(), cache / ResNet18_Weights.DEFAULT.url.rsplit("/", 1)[1])
    jobs = {
        "unknown-layer": ["--model", "resnet18", "--weights", "none", "--layers", "layer5", "--data", "synthetic:4",
                          "--out", folder / "never.zarr", "--image-size", "32"],
        "download": ["--model", "resnet18", "--layers", "layer4", "--data", "synthetic:2", "--out", folder / "dl.zarr",
                     "--image-size", "32"],
        "cached": ["--model", "resnet18", "--layers", "layer4", "--pool", "avg", "--data", "synthetic:3",
                   "--out", folder / "cached.zarr", "--image-size", "32", "--dtype", "float32", "--num-workers", "0"],
    }  # fmt: skip
    job_env = {"download": {"TORCH_HOME": str(folder / "empty")}, "cached": {"TORCH_HOME": str(folder / "hub")}}
    proxy = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}
    sequence = Sequence(None, jobs, folder, env=proxy, job_env=job_env)
    launch = sequence.run(timeout=300)
    assert launch.returncode == 0, launch.stderr[-3000:]
    return sequence


@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_unknown_layer_exits_2_with_suggestions_and_creates_nothing(as_a_user_runs_it):
    result = as_a_user_runs_it.result("unknown-layer")
    assert result.codes == [2]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "'layer5'" in lines[0] and "layer4" in lines[0] and "--list-layers" in lines[0]
    assert not (as_a_user_runs_it.folder / "never.zarr").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layers", "layer1.0.relu"], "ran 2 times"),
        (["--layers", "layer4", "--pool", "cls"], "does not fit layer 'layer4'"),
        (["--layers", "layer4", "--pool", "median"], "unknown --pool 'median'"),
        (["--layers", "layer4", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["--layers", "layer4", "--chunk-size", "-3"], "--chunk-size must be a positive integer"),
        (["--layers", "layer4", "--dtype", "int8"], "unknown --dtype"),
        (["--layers", "layer4", "--precision", "fp8"], "unknown --precision"),
        (["--layers", "layer4", "--model", "resnet17"], "closest: resnet"),
        (["--layers", "layer4", "--weights", "IMAGENET9K"], "IMAGENET1K_V1"),
        (["--layers", "layer4", "--data", "nowhere:1"], "unknown --data"),
        (["--layers", "layer4", "--data", "imagefolder:/does/not/exist"], "not a directory"),
        (["--layers", "fc:0"], "drop ':0'"),
        (["--model", f"{TINY}:dict_net", "--layers", "heads:nokey"], "has no element 'nokey'"),
        ([], "--layers is required"),
    ],
)
def test_bad_input_is_one_line_exit_2(cli, tmp_path, args, message):
    out = tmp_path / "bad.zarr"
    base = ["--model", "resnet18", "--weights", "none", "--data", "synthetic:3", "--out", out, "--image-size", "32"]
    code, _, err = cli(*base, *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert message in err
    assert not out.exists()


@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_weights_download_fails_with_clear_message(as_a_user_runs_it):
    result = as_a_user_runs_it.result("download")
    assert result.codes == [2], result.stderr
    assert "Traceback" not in result.stderr
    assert "--weights none" in result.stderr and "--checkpoint" in result.stderr
    assert not (as_a_user_runs_it.folder / "dl.zarr").exists()


def test_the_summary_claims_no_compression_without_a_compressor(cli, tmp_path):
    """It said "compression 0.75x" for a store with no compressor: the padded last chunk and the metadata
    over the features' size, read as a compression that made the store bigger."""
    code, _, err = cli(*SMALL, "--data", "synthetic:9", "--chunk-size", "4", "--compressor", "none",
                       "--out", tmp_path / "s.zarr")  # fmt: skip
    assert code == 0, err
    summary = [line for line in err.splitlines() if "samples in" in line][-1]
    assert summary.endswith("MiB stored, uncompressed") and "compression" not in summary, summary
    attrs = json.loads((tmp_path / "s.zarr" / "zarr.json").read_text())["attributes"]
    assert attrs["summary"]["compressor"] == "none"


def test_summary_and_attributes(cli, tmp_path):
    out = tmp_path / "s.zarr"
    code, _, err = cli(
        "--model", "resnet18", "--weights", "none", "--layers", "layer3", "--data", "synthetic:9", "--out",
        out, "--image-size", "32", "--num-workers", "0", "--chunk-size", "4",
    )  # fmt: skip
    assert code == 0, err
    assert "extract: NOTE --data synthetic:9: SYNTHETIC images, not a real dataset\n" in err
    summary = [line for line in err.splitlines() if "samples in" in line][-1]
    assert "9 samples" in summary and "img/s" in summary, summary
    assert re.search(r"MiB stored with zstd, \d+\.\d\dx less than the features' size in memory$", summary), summary
    attrs = json.loads((out / "zarr.json").read_text())["attributes"]
    assert attrs["summary"]["samples"] == 9 and attrs["summary"]["bytes_stored"] > 0
    assert attrs["summary"]["unit"] == "samples" and attrs["summary"]["rows_per_second"] > 0
    start = next(line for line in err.splitlines() if " as float16; " in line)
    assert "; 9 samples in 3 chunks of 4; 1 process; " in start, start
    assert attrs["job"]["layers"] == ["layer3"] and attrs["dtype"] == "float16"
    assert zarr.open_group(out, mode="r")["features/layer3"].dtype == np.float16


@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_cached_torchvision_weights_are_used_offline(as_a_user_runs_it):
    """--weights DEFAULT loads from the torch hub cache when the file is there (no network needed)."""
    result = as_a_user_runs_it.result("cached")
    assert result.codes == [0], result.stderr
    out = as_a_user_runs_it.folder / "cached.zarr"
    model = resnet18(seed=7)
    images = synthetic_images(3)
    expected = reference(model, images, {"layer4": ("layer4", None)}, pool="avg")["layer4"]
    assert np.abs(read(out, "layer4") - expected).max() <= 1e-5
    assert zarr.open_group(out, mode="r").attrs["weights"] == "ResNet18_Weights.IMAGENET1K_V1"


def test_pool_help_names_the_text_pools():
    """--help lists every --pool a store can be made with: the text pools (first and last) too."""
    from extract.cli.extract import build_parser
    from extract.names.pooling import TEXT_POOLS

    words = next(action.help for action in build_parser()._actions if "--pool" in action.option_strings)
    assert all(pool in words for pool in TEXT_POOLS) and "a row per document" in words, words
