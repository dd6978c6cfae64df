"""Job files: ``--config FILE.toml`` drives a run, flags override it, bad files fail in one line."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
import zarr
from helpers import ROOT

from extract.capture.layers import resolve_layers
from extract.cli.extract import parse_spec
from extract.data import DATA_KINDS
from extract.models import build_model
from extract.names.pooling import make_pool, per_layer
from extract.store.schema import codecs

JOBS = sorted((ROOT / "jobs").glob("*.toml"))

TINY_JOB = """
model = "resnet18"
weights = "none"
layers = ["layer4"]
data = "synthetic:12"
image-size = 32
chunk_size = 8
num_workers = 0
pool = "avg"
dtype = "float32"
out = "{out}"
"""


def write_job(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_job_file_drives_a_run(cli, tmp_path):
    out = tmp_path / "job.zarr"
    job = write_job(tmp_path / "job.toml", TINY_JOB.format(out=out))
    code, _, err = cli("--config", job)
    assert code == 0, err
    group = zarr.open_group(out, mode="r")
    attrs = group.attrs.asdict()
    assert attrs["status"] == "complete" and attrs["num_samples"] == 12 and attrs["chunk_size"] == 8
    assert attrs["layers"] == ["layer4"] and attrs["pool"] == "avg" and attrs["job"]["image_size"] == 32
    assert group["features/layer4"].shape == (12, 512) and group["features/layer4"].dtype == np.float32
    assert not np.isnan(group["features/layer4"][:]).any()
    assert group["labels"][:].tolist() == [i % 10 for i in range(12)]


def test_flags_override_the_file(cli, tmp_path):
    job = write_job(tmp_path / "job.toml", TINY_JOB.format(out=tmp_path / "from_file.zarr"))
    out = tmp_path / "from_flag.zarr"
    code, _, err = cli("--config", job, "--out", out, "--pool", "max", "--layers", "layer3", "layer4")
    assert code == 0, err
    assert not (tmp_path / "from_file.zarr").exists()
    attrs = zarr.open_group(out, mode="r").attrs.asdict()
    assert attrs["pool"] == "max" and attrs["layers"] == ["layer3", "layer4"]
    assert attrs["chunk_size"] == 8 and attrs["dtype"] == "float32"  # the rest still from the file


def test_unknown_key_fails_in_one_line_naming_it(cli, tmp_path):
    job = write_job(tmp_path / "job.toml", TINY_JOB.format(out=tmp_path / "x.zarr") + "batchsize = 4\n")
    code, out, err = cli("--config", job)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("extract: error: ")
    assert "unknown key 'batchsize'" in err and "batch_size" in err
    assert not (tmp_path / "x.zarr").exists()


@pytest.mark.parametrize(
    "text, message",
    [
        ('model = "resnet18"\nlayers = [layer4]\n', "is not valid TOML"),
        ('model = "resnet18\n', "is not valid TOML"),
    ],
)
def test_invalid_toml_fails_in_one_line(cli, tmp_path, text, message):
    job = write_job(tmp_path / "bad.toml", text)
    code, _, err = cli("--config", job)
    assert code == 2 and err.count("\n") == 1 and message in err and str(job) in err


def test_missing_job_file(cli, tmp_path):
    code, _, err = cli("--config", tmp_path / "nope.toml")
    assert code == 2 and "does not exist" in err


def test_smoke_job_runs_with_out_overridden(cli, tmp_path):
    out = tmp_path / "smoke.zarr"
    code, _, err = cli("--config", ROOT / "jobs" / "smoke_synthetic.toml", "--out", out)
    assert code == 0, err
    group = zarr.open_group(out, mode="r")
    assert group.attrs["status"] == "complete" and group.attrs["model"] == "resnet18"
    assert group["done"][:].all() and not np.isnan(group["features/layer4"][:]).any()


def test_shipped_jobs_exist():
    names = {job.name for job in JOBS}
    assert {"resnet50_imagenet_val.toml", "vit_b_16_cls.toml", "smoke_synthetic.toml"} <= names


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_shipped_job_is_a_valid_spec(job):
    spec, only_list = parse_spec(["--config", str(job)])
    assert not only_list and spec.layers
    spec.validate()
    codecs(spec.compressor or "none")
    assert any(spec.data.startswith(kind.split(":")[0] + ":") for kind in DATA_KINDS)
    if spec.weights.lower() not in ("none", "default"):
        assert spec.weights in torchvision.models.get_model_weights(spec.model).__members__
    if ":" in spec.model:  # another source: its architecture only, nothing downloaded
        loaded = build_model(spec.model, spec.weights, None, 0, spec.image_size, load_weights=False)
        model, aliases = loaded.model, loaded.aliases
    else:
        with torch.device("meta"):  # the real architecture, without allocating or downloading weights
            model, aliases = torchvision.models.get_model(spec.model, weights=None), {}
    refs = resolve_layers(model, spec.layers, aliases)
    assert refs
    pools = per_layer(spec.pool, refs, "pool", "none")
    for pool in pools.values():
        make_pool(pool)
