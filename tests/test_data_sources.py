"""Data sources end to end: tar shards, Parquet, Hugging Face datasets, ImageFolder and file lists,
each compared with an independent read of the data; keys and classes in the store and the reader;
bad data; the listing's corner cases."""

import io
import os
import shutil
import sys
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr
from helpers.cli import SMALL, one_line_error
from helpers.data_files import decode_all, encoded_image, make_png_tree, read_shards_with_tarfile, write_shards
from helpers.reference import load_images, preset, reference, resnet18
from zarr.errors import ZarrUserWarning

from extract import open_features
from extract.data import build_dataset
from extract.data.shards import expand_braces
from extract.errors import ExtractError
from extract.store.store import FeatureStore
from extract.store.verify import verify


def expected_features(images: list[bytes]) -> np.ndarray:
    return reference(resnet18(), decode_all(images), {"layer3": ("layer3", None)}, pool="avg")["layer3"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return root, write_shards(root, [5, 2, 6])  # uneven; chunk 4 divides none of them


def test_brace_patterns():
    assert expand_braces("a-{008..011}.tar") == ["a-008.tar", "a-009.tar", "a-010.tar", "a-011.tar"]
    assert expand_braces("{x,y}-{1..2}") == ["x-1", "x-2", "y-1", "y-2"]


@pytest.mark.parametrize("form", ["pattern", "directory"])
def test_shards_equal_an_independent_read(cli, tmp_path, shards, form):
    root, paths = shards
    data = f"{root}/train-{{000..002}}.tar" if form == "pattern" else str(root)
    out = tmp_path / "wds.zarr"
    code, _, err = cli(*SMALL, "--data", f"wds:{data}", "--out", out, "--chunk-size", "4", "--batch-size", "3")
    assert code == 0, err
    truth = read_shards_with_tarfile(paths)
    features = open_features(out)
    assert features.keys.tolist() == [key for key, _, _ in truth]
    assert features.keys[5] == "train-001.tar/sample00005"  # numbering continues across shards
    assert features.labels.tolist() == [label for _, _, label in truth]
    assert features.classes is None
    stored = features.load("layer3")
    assert np.abs(stored - expected_features([image for _, image, _ in truth])).max() <= 1e-5
    assert (out / "index" / "wds" / "zarr.json").is_file()  # the shard index, kept as a zarr array
    assert not (out / "wds-index.json.gz").exists()


def test_a_resume_reads_the_kept_index_instead_of_rescanning(shards, tmp_path, monkeypatch):
    from extract.data import shards as module

    root, _ = shards
    transform = resnet18  # unused by the listing
    first = build_dataset(f"wds:{root}", transform, 32)
    blob = first.saved_index()

    def no_rescan(path):
        raise AssertionError("rescanned")

    monkeypatch.setattr(module, "index_shard", no_rescan)
    again = build_dataset(f"wds:{root}", transform, 32, saved_index=blob)
    assert again.keys() == first.keys() and again.listing_sha256() == first.listing_sha256()


def test_a_shard_store_is_all_zarr(cli, tmp_path, shards, recwarn):
    """The kept shard index is a zarr array, not a stranger in the hierarchy: no ZarrUserWarning from
    creating, resuming, verifying or reading the store."""
    root, _ = shards
    out = tmp_path / "wds.zarr"
    args = [*SMALL, "--data", f"wds:{root}", "--out", out, "--chunk-size", "4"]
    assert cli(*args)[0] == 0
    FeatureStore.open(out).integrity.clear_done([1])
    code, _, err = cli(*args)
    assert code == 0 and "no rescan" in err, err
    assert verify(FeatureStore.open(out, mode="r")).damaged == {}
    open_features(out).load("layer3")
    assert [str(w.message) for w in recwarn if issubclass(w.category, ZarrUserWarning)] == []


OLD_LAYOUT_WARNS = pytest.mark.filterwarnings("ignore:Object at wds-index.json.gz:zarr.errors.ZarrUserWarning")


@pytest.mark.parametrize(
    "layout", ["index array", pytest.param("index file inside the store (older stores)", marks=OLD_LAYOUT_WARNS)]
)
def test_a_resume_uses_the_kept_shard_index_without_rescanning(cli, tmp_path, shards, monkeypatch, layout):
    from extract.data import shards as module

    root, _ = shards
    out = tmp_path / "wds.zarr"
    args = [*SMALL, "--data", f"wds:{root}", "--out", out, "--chunk-size", "4"]
    assert cli(*args)[0] == 0
    complete = open_features(out).load("layer3")
    if layout != "index array":  # as stores were written before the index array: a gzip file at the root
        blob = zarr.open_group(out, mode="r")["index/wds"][:].tobytes()
        shutil.rmtree(out / "index")
        (out / "wds-index.json.gz").write_bytes(blob)
    FeatureStore.open(out).integrity.clear_done([0, 2])

    def no_rescan(path):
        raise AssertionError(f"rescanned {path}")

    monkeypatch.setattr(module, "index_shard", no_rescan)
    code, _, err = cli(*args)
    assert code == 0, err
    assert "using the shard index kept in" in err and "resuming" in err and "2 of 4 chunks already done" in err
    np.testing.assert_array_equal(open_features(out).load("layer3"), complete)


def test_image_and_label_keys(cli, tmp_path):
    root = tmp_path / "s"
    root.mkdir()
    with tarfile.open(root / "a.tar", "w") as tar:
        for i in range(3):
            tar.addfile(_info(f"{i}.main.png", png := encoded_image(i, "PNG")), io.BytesIO(png))
            tar.addfile(_info(f"{i}.thumb.jpg", jpg := encoded_image(9, "JPEG")), io.BytesIO(jpg))
            tar.addfile(_info(f"{i}.y", str(7 - i).encode()), io.BytesIO(str(7 - i).encode()))
    out = tmp_path / "k.zarr"
    code, _, err = cli(*SMALL, "--data", f"wds:{root}", "--image-key", "main.png", "--label-key", "y", "--out", out)
    assert code == 0, err
    features = open_features(out)
    assert features.labels.tolist() == [7, 6, 5]
    expected = expected_features([encoded_image(i, "PNG") for i in range(3)])
    assert np.abs(features.load("layer3") - expected).max() <= 1e-5
    code, _, err = cli(*SMALL, "--data", f"wds:{root}", "--image-key", "webp", "--out", tmp_path / "x.zarr")
    assert code == 2 and "--image-key" in one_line_error(err) and "a.tar" in err


def _info(name: str, data: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info


@pytest.mark.parametrize("damage", ["truncated", "not-a-tar"])
def test_a_broken_shard_is_one_line_naming_it_before_anything_is_created(cli, tmp_path, shards, damage):
    _, paths = shards
    root = tmp_path / "broken"
    root.mkdir()
    for path in paths:
        (root / path.name).write_bytes(path.read_bytes())
    victim = root / paths[1].name
    with tarfile.open(victim) as tar:
        last_image = tar.getmembers()[-2]
    whole = victim.read_bytes()
    cut = last_image.offset_data + last_image.size // 2  # in the middle of the last image
    victim.write_bytes(whole[:cut] if damage == "truncated" else b"hello, not a tar" * 64)
    out = tmp_path / "never.zarr"
    code, _, err = cli(*SMALL, "--data", f"wds:{root}", "--out", out)
    line = one_line_error(err)
    assert code == 2 and str(victim) in line and "truncated or not a tar" in line
    assert not out.exists()


def test_a_bad_sample_in_a_shard_names_its_key_or_is_skipped(cli, tmp_path):
    root = tmp_path / "s"
    root.mkdir()
    with tarfile.open(root / "b.tar", "w") as tar:
        for i, image in enumerate([encoded_image(0), encoded_image(1)[:40], encoded_image(2)]):
            tar.addfile(_info(f"k{i}.jpg", image), io.BytesIO(image))
    code, _, err = cli(*SMALL, "--data", f"wds:{root}", "--out", tmp_path / "a.zarr", "--chunk-size", "1",
                       "--batch-size", "1")  # fmt: skip
    line = one_line_error(err)
    assert code == 2 and "b.tar/k1" in line and "--skip-bad-images" in line
    out = tmp_path / "b.zarr"
    code, _, err = cli(*SMALL, "--data", f"wds:{root}", "--out", out, "--skip-bad-images")
    assert code == 0, err
    features = open_features(out)
    assert features.valid.tolist() == [True, False, True]
    assert np.isnan(features.load("layer3")[1]).all()


def write_parquet(path, layout: str, images: list[bytes], labels: list[int]) -> None:
    if layout == "bytes":
        table = pa.table({"jpeg": pa.array(images, pa.binary()), "label": labels, "note": ["x"] * len(images)})
        pq.write_table(table, path, row_group_size=3)
    else:  # what datasets' to_parquet writes: a {bytes, path} struct and ClassLabel names in the metadata
        import datasets

        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
        rows = {"image": [{"bytes": b, "path": f"img{i}.jpg"} for i, b in enumerate(images)], "label": labels}
        datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path), batch_size=3)


@pytest.mark.parametrize("layout", ["bytes", "hf-struct"])
def test_parquet_both_image_layouts(cli, tmp_path, layout):
    images = [encoded_image(20 + i, "PNG" if i == 3 else "JPEG") for i in range(8)]
    labels = [i % 3 for i in range(8)]
    (tmp_path / "p").mkdir()
    write_parquet(tmp_path / "p" / "part-0.parquet", layout, images[:5], labels[:5])
    write_parquet(tmp_path / "p" / "part-1.parquet", layout, images[5:], labels[5:])
    out = tmp_path / "pq.zarr"
    code, _, err = cli(*SMALL, "--data", f"parquet:{tmp_path}/p/*.parquet", "--out", out, "--chunk-size", "3",
                       "--batch-size", "2")  # fmt: skip
    assert code == 0, err
    features = open_features(out)
    assert features.keys.tolist() == [f"part-0.parquet/{i}" for i in range(5)] + [
        f"part-1.parquet/{i}" for i in range(3)
    ]
    assert features.labels.tolist() == labels
    assert features.classes == (["a", "b", "c"] if layout == "hf-struct" else None)
    assert np.abs(features.load("layer3") - expected_features(images)).max() <= 1e-5


def path_only_parquet(path, paths: list[str]) -> None:
    """Image cells holding only a path, as datasets writes images that it has not embedded."""
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cells = pa.array([{"bytes": None, "path": p} for p in paths], struct)
    pq.write_table(pa.table({"image": cells, "label": list(range(len(paths)))}), path)


def test_parquet_path_cells_are_found_from_any_directory(cli, tmp_path, monkeypatch):
    """Relative paths open as datasets opens them, from the working directory, else beside the file."""
    images = [encoded_image(40 + i) for i in range(3)]
    data = tmp_path / "data"
    (data / "imgs").mkdir(parents=True)
    for i, image in enumerate(images):
        (data / "imgs" / f"{i}.jpg").write_bytes(image)
    path_only_parquet(data / "beside.parquet", [f"imgs/{i}.jpg" for i in range(3)])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, _, err = cli(*SMALL, "--data", "parquet:../data/beside.parquet", "--out", "beside.zarr")
    assert code == 0, err
    assert np.abs(open_features("beside.zarr").load("layer3") - expected_features(images)).max() <= 1e-5

    monkeypatch.chdir(data)  # paths relative to the working directory, the Parquet file elsewhere
    path_only_parquet(tmp_path / "elsewhere" / "cwd.parquet", [f"imgs/{i}.jpg" for i in range(3)])
    code, _, err = cli(*SMALL, "--data", f"parquet:{tmp_path}/elsewhere/cwd.parquet", "--out", tmp_path / "cwd.zarr")
    assert code == 0, err
    assert np.abs(open_features(tmp_path / "cwd.zarr").load("layer3") - expected_features(images)).max() <= 1e-5


def test_a_parquet_path_cell_to_no_file_names_file_and_row_in_one_line(cli, tmp_path, monkeypatch):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "0.jpg").write_bytes(encoded_image(0))
    path_only_parquet(tmp_path / "d.parquet", ["imgs/0.jpg", "imgs/gone.jpg"])
    monkeypatch.chdir(tmp_path / "imgs")
    code, _, err = cli(*SMALL, "--data", f"parquet:{tmp_path}/d.parquet", "--out", tmp_path / "o.zarr")
    line = one_line_error(err)
    assert code == 2 and f"{tmp_path}/d.parquet row 1" in line
    assert f"the image's path 'imgs/gone.jpg' is in neither the working directory nor {tmp_path}" in line


def test_parquet_without_the_named_columns(cli, tmp_path):
    path = tmp_path / "one.parquet"
    write_parquet(path, "bytes", [encoded_image(0)], [1])
    for flag, column in (("--image-key", "img"), ("--label-key", "target")):
        code, _, err = cli(*SMALL, "--data", f"parquet:{path}", flag, column, "--out", tmp_path / "x.zarr")
        line = one_line_error(err)
        assert code == 2 and str(path) in line and f"'{column}'" in line and "jpeg" in line
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "text.parquet")
    code, _, err = cli(*SMALL, "--data", f"parquet:{tmp_path / 'text.parquet'}", "--out", tmp_path / "y.zarr")
    assert code == 2 and "no image column" in one_line_error(err)
    assert not (tmp_path / "x.zarr").exists() and not (tmp_path / "y.zarr").exists()


def test_hf_dataset_saved_to_disk(cli, tmp_path):
    import datasets

    images = [encoded_image(40 + i) for i in range(5)]
    features = datasets.Features({"img": datasets.Image(), "fine": datasets.ClassLabel(names=["x", "y"])})
    rows = {"img": [{"bytes": b, "path": None} for b in images], "fine": [1, 0, 1, 1, 0]}
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows, features=features)}).save_to_disk(tmp_path / "ds")
    out = tmp_path / "hf.zarr"
    code, _, err = cli(*SMALL, "--data", f"hf:{tmp_path / 'ds'}:test", "--label-key", "fine", "--out", out)
    assert code == 0, err
    features = open_features(out)
    assert features.keys.tolist() == [f"test/{i}" for i in range(5)]
    assert features.labels.tolist() == [1, 0, 1, 1, 0] and features.classes == ["x", "y"]
    assert np.abs(features.load("layer3") - expected_features(images)).max() <= 1e-5


def test_imagefolder_and_filelist_keys_and_classes(cli, tmp_path, png_tree):
    root, files = png_tree
    out = tmp_path / "if.zarr"
    assert cli(*SMALL, "--data", f"imagefolder:{root}", "--out", out)[0] == 0
    features = open_features(out)
    assert features.keys.tolist() == [str(f.relative_to(root)) for f, _ in files]
    assert features.classes == ["cat", "dog"]
    assert features.attrs["image_root"] == str(root.resolve())  # where the keys are, for the report
    listing = tmp_path / "list.txt"
    listing.write_text(
        "".join(f"{f}\t{label}\n" for f, label in files[:3]) + f"{os.path.relpath(files[3][0], tmp_path)}\n"
    )
    out = tmp_path / "fl.zarr"
    assert cli(*SMALL, "--data", f"filelist:{listing}", "--out", out)[0] == 0
    features = open_features(out)
    assert features.keys.tolist() == [str(f) for f, _ in files[:3]] + [os.path.relpath(files[3][0], tmp_path)]
    assert features.labels.tolist() == [0, 0, 0, -1] and features.classes is None
    assert features.attrs["image_root"] == str(tmp_path.resolve())
    xr = pytest.importorskip("xarray")
    assert xr.open_zarr(out, consolidated=False)["keys"].values.tolist() == features.keys.tolist()


def test_synthetic_and_torchvision_keys(cli, tmp_path):
    out = tmp_path / "syn.zarr"
    assert cli(*SMALL, "--data", "synthetic:3", "--out", out)[0] == 0
    assert open_features(out).keys.tolist() == ["synthetic/0", "synthetic/1", "synthetic/2"]
    assert "image_root" not in open_features(out).attrs  # its keys are no files
    transform = lambda image: image  # noqa: E731 - the listing is what is tested
    assert build_dataset("synthetic:3", transform, 32).keys() == ["synthetic/0", "synthetic/1", "synthetic/2"]
    fake = build_dataset("torchvision:FakeData:/tmp", transform, 32)  # used to be a traceback
    assert len(fake) == 1000 and fake.keys()[:2] == ["FakeData/0", "FakeData/1"]
    image, label, index, error = fake[0]
    assert error == "" and 0 <= label < 10 and index == 0


def test_a_source_says_where_its_images_live_and_what_to_note(tmp_path, monkeypatch):
    make_png_tree(tmp_path / "tree", {"cat": 1})
    (tmp_path / "tree" / "cat" / "list.txt").write_text("000.png\n")
    monkeypatch.chdir(tmp_path)  # relative specs: the root is recorded absolute
    transform = lambda image: image  # noqa: E731 - the listing is what is tested
    assert build_dataset("imagefolder:tree", transform, 32).image_root == tmp_path.resolve() / "tree"
    assert build_dataset("filelist:tree/cat/list.txt", transform, 32).image_root == tmp_path.resolve() / "tree/cat"
    synthetic = build_dataset("synthetic:2", transform, 32)
    assert synthetic.image_root is None and synthetic.notice == "SYNTHETIC images, not a real dataset"
    assert build_dataset("imagefolder:tree", transform, 32).notice is None


def test_unknown_data_lists_every_declared_kind():
    with pytest.raises(ExtractError) as error:
        build_dataset("nowhere:1", lambda image: image, 32)
    assert str(error.value) == (
        "unknown --data 'nowhere:1'; use one of synthetic:N, imagefolder:PATH, filelist:FILE, "
        "torchvision:NAME:ROOT[:split], wds:PATTERN_OR_DIR, parquet:GLOB, hf:PATH[:split], text:GLOB"
    )


@pytest.mark.parametrize(("spec", "library", "extra"), [("parquet:x/*.parquet", "pyarrow", "parquet"),
                                                        ("hf:x", "datasets", "datasets")])  # fmt: skip
def test_a_missing_library_of_a_data_source_names_its_extra(monkeypatch, spec, library, extra):
    monkeypatch.setitem(sys.modules, library, None)  # import now raises ImportError
    with pytest.raises(ExtractError) as error:
        build_dataset(spec, lambda image: image, 32)
    assert str(error.value) == (
        f"--data {spec} needs the '{library}' package; install it with pip install 'extract[{extra}]'"
    )


def test_a_symlink_loop_is_walked_once(cli, tmp_path):
    root = tmp_path / "loop"
    files = make_png_tree(root, {"a": 2, "b": 1})
    (root / "a" / "again").symlink_to(root / "a")  # a/again/again/... forever
    (root / "b" / "up").symlink_to(root)
    (root / "b" / "sub").mkdir()
    (root / "b" / "sub" / "x.png").write_bytes(files[0][0].read_bytes())
    source = build_dataset(f"imagefolder:{root}", lambda image: image, 32)
    assert source.keys() == ["a/000.png", "a/001.png", "b/000.png", "b/sub/x.png", "b/up/a/000.png", "b/up/a/001.png"]
    assert source.classes == ["a", "b"]


def test_missing_files_of_a_list_are_reported_together_before_creating(cli, tmp_path, png_tree):
    _, files = png_tree
    listing = tmp_path / "list.txt"
    names = [str(files[0][0])] + [f"gone/{i}.png" for i in range(5)] + [str(files[1][0])]
    listing.write_text("\n".join(names) + "\n")
    code, _, err = cli(*SMALL, "--data", f"filelist:{listing}", "--out", tmp_path / "x.zarr")
    line = one_line_error(err)
    assert code == 2 and "5 of 7 listed files do not exist" in line
    assert "gone/0.png, gone/1.png, gone/2.png and 2 more" in line
    assert not (tmp_path / "x.zarr").exists()


def test_listing_hash_tracks_the_files(tmp_path):
    root = tmp_path / "h"
    make_png_tree(root, {"a": 2})
    first = build_dataset(f"imagefolder:{root}", lambda image: image, 32).listing_sha256()
    (root / "a" / "001.png").rename(root / "a" / "002.png")
    assert build_dataset(f"imagefolder:{root}", lambda image: image, 32).listing_sha256() != first


def test_images_agree_with_reference_loader(png_tree):
    root, files = png_tree
    source = build_dataset(f"imagefolder:{root}", preset(32), 32)
    stacked = np.stack([source[i][0].numpy() for i in range(len(source))])
    assert np.array_equal(stacked, load_images([f for f, _ in files], 32).numpy())


def test_a_bad_parquet_cell_names_file_and_row_or_is_skipped(cli, tmp_path):
    path = tmp_path / "bad.parquet"
    write_parquet(path, "bytes", [encoded_image(0), b"\xff\xd8\xff garbage", encoded_image(2)], [0, 1, 2])
    code, _, err = cli(*SMALL, "--data", f"parquet:{path}", "--out", tmp_path / "a.zarr")
    assert code == 2 and f"{path} row 1" in one_line_error(err)
    out = tmp_path / "b.zarr"
    assert cli(*SMALL, "--data", f"parquet:{path}", "--out", out, "--skip-bad-images")[0] == 0
    assert open_features(out).valid.tolist() == [True, False, True]


def test_imagefolder_takes_torchvisions_image_extensions():
    """``imagefolder:`` lists what ``torchvision.datasets.ImageFolder`` does; its extensions are written out
    (importing torchvision's costs seconds), so they must stay torchvision's own."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    from extract.data.folder import IMG_EXTENSIONS as OURS

    assert OURS == IMG_EXTENSIONS
