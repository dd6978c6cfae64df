"""One folder given as a relative or an absolute path is one job: the identity records the data with
its path resolved, and a store made before, which recorded the path as given, still resumes when
that path resolves to the same place."""

import numpy as np
import pytest
import zarr
from helpers import cli as cli_args
from helpers.data_files import make_png_tree, write_shards

from extract.data import DataOptions, job_data
from extract.data.registry import open_source
from extract.data.source import DataRequest
from extract.store.schema import checked, codecs, fingerprint
from extract.store.store import FeatureStore

SMALL = [*cli_args.SMALL, "--chunk-size", "4", "--batch-size", "4"]


@pytest.fixture
def data(tmp_path, monkeypatch):
    """An image folder and shards under tmp_path/data, and the working directory tmp_path."""
    make_png_tree(tmp_path / "data" / "images", {"cat": 5, "dog": 4})
    write_shards(tmp_path / "data" / "shards", [5, 4])
    monkeypatch.chdir(tmp_path)
    return {"imagefolder": "data/images", "wds": "data/shards"}


def test_the_spec_records_the_path_resolved(data, tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "data")
    resolved = f"imagefolder:{(tmp_path / 'data' / 'images').resolve()}"
    for spec in ("imagefolder:data/images", "imagefolder:./data/../data/images", "imagefolder:link/images"):
        assert job_data(spec) == resolved
    assert job_data("wds:data/shards/s-{0..1}.tar") == f"wds:{(tmp_path / 'data' / 'shards').resolve()}/s-{{0..1}}.tar"
    assert job_data("hf:data/saved:test") == f"hf:{(tmp_path / 'data' / 'saved').resolve()}:test"
    assert job_data("torchvision:CIFAR10:data:test") == f"torchvision:CIFAR10:{(tmp_path / 'data').resolve()}:test"
    assert job_data("synthetic:8") == "synthetic:8"
    assert job_data("imagefolder:data/images", recorded="imagefolder:./data/images") == "imagefolder:./data/images"
    assert job_data("imagefolder:data/images", recorded="imagefolder:elsewhere") == resolved


@pytest.mark.parametrize("kind", ["imagefolder", "wds"])
def test_relative_then_absolute_is_the_same_job(cli, data, tmp_path, kind):
    relative, absolute = f"{kind}:{data[kind]}", f"{kind}:{tmp_path / data[kind]}"
    code, _, err = cli(*SMALL, "--data", relative, "--out", "a.zarr")
    assert code == 0, err
    identity = zarr.open_group("a.zarr", mode="r").attrs["identity"]
    assert identity["data"] == job_data(absolute) == f"{kind}:{(tmp_path / data[kind]).resolve()}"
    FeatureStore.open(tmp_path / "a.zarr").integrity.clear_done([1])
    code, _, err = cli(*SMALL, "--data", absolute, "--out", "a.zarr")
    assert code == 0 and "resuming" in err and "different job" not in err, err
    code, _, err = cli(*SMALL, "--data", f"{kind}:./{data[kind]}/", "--out", "a.zarr")
    assert code == 0 and "already complete" in err, err


def as_made_before(out: str, spec: str, options: DataOptions) -> None:
    """Rewrite a store's identity as a version that recorded ``--data`` as given wrote it: the path
    unresolved, and the listing hashed as the source lists it at that path."""
    group = zarr.open_group(out, mode="r+")
    identity = dict(group.attrs["identity"])
    source = open_source(DataRequest(spec, options))
    identity.update(data=spec, data_listing_sha256=source.listing_sha256())
    group.attrs.update({"identity": identity, "fingerprint": fingerprint(identity)})
    if "index/wds" in group:  # the shard index it kept lists the shards at that path too
        blob = np.frombuffer(source.saved_index(), dtype=np.uint8)
        group["index"].create_array("wds", shape=blob.shape, dtype="uint8", compressors=checked(codecs("zstd")),
                                    overwrite=True)[:] = blob  # fmt: skip


@pytest.mark.parametrize("kind", ["imagefolder", "wds"])
def test_a_store_that_recorded_a_relative_path_still_resumes(cli, data, tmp_path, kind):
    relative = f"{kind}:{data[kind]}"
    code, _, err = cli(*SMALL, "--data", relative, "--out", "old.zarr")
    assert code == 0, err
    as_made_before("old.zarr", relative, DataOptions())
    before = zarr.open_group("old.zarr", mode="r").attrs["fingerprint"]
    for spec in (relative, f"{kind}:{tmp_path / data[kind]}"):
        FeatureStore.open(tmp_path / "old.zarr").integrity.clear_done([0])
        code, _, err = cli(*SMALL, "--data", spec, "--out", "old.zarr")
        assert code == 0 and "resuming" in err, err
        assert ("the shard index kept in old.zarr" in err) == (kind == "wds")
    attrs = zarr.open_group("old.zarr", mode="r").attrs
    assert attrs["fingerprint"] == before and attrs["identity"]["data"] == relative and attrs["status"] == "complete"


def test_a_relative_path_to_other_data_is_still_another_job(cli, data, tmp_path):
    code, _, err = cli(*SMALL, "--data", "imagefolder:data/images", "--out", "a.zarr")
    assert code == 0, err
    make_png_tree(tmp_path / "other" / "data" / "images", {"cat": 5, "dog": 4}, seed=1)
    code, _, err = cli(*SMALL, "--data", f"imagefolder:{tmp_path / 'other' / 'data' / 'images'}", "--out", "a.zarr")
    assert code == 2 and "holds a different job (differs in: data)" in err
