"""Malformed inputs that used to end in a traceback or pass silently: each is one line and exit 2, or,
for string labels, mapped to classes as ``datasets`` maps them."""

import os
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr
from helpers.cli import SMALL, one_line_error
from helpers.data_files import add_member, encoded_image

NOT_UTF8 = b"\xff\xfe.png"
TOO_BIG = "9" * 23  # beyond int64


def refused(cli, tmp_path: Path, *args: object) -> str:
    """The one error line of a run that must be refused with exit 2, creating nothing."""
    out = tmp_path / "out.zarr"
    code, _, err = cli(*SMALL, "--out", out, *args)
    assert code == 2, err
    return one_line_error(err)


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            add_member(tar, name, data)
    return path


@pytest.fixture(scope="module")
def png() -> bytes:
    return encoded_image(0, "PNG", (16, 16))


def test_an_image_folder_name_that_is_not_utf8(cli, tmp_path, png):
    root = tmp_path / "images"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "ok.png").write_bytes(png)
    (root / "cat" / os.fsdecode(NOT_UTF8)).write_bytes(png)
    line = refused(cli, tmp_path, "--data", f"imagefolder:{root}")
    assert r"cat/\xff\xfe.png is not UTF-8" in line


def test_a_shard_member_or_shard_name_that_is_not_utf8(cli, tmp_path, png):
    shard = write_tar(tmp_path / "a.tar", [(os.fsdecode(NOT_UTF8), png)])
    assert r"holds the name \xff\xfe.png, which is not UTF-8" in refused(cli, tmp_path, "--data", f"wds:{shard}")
    folder = tmp_path / "shards"
    folder.mkdir()
    write_tar(folder / os.fsdecode(b"\xff.tar"), [("k.png", png)])
    assert r"the name \xff.tar, which is not UTF-8" in refused(cli, tmp_path, "--data", f"wds:{folder}")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("ok.png\t1\n# caf\xe9\n".encode("latin-1"), "line 2 is not UTF-8 text"),
        ("ok.png\t\u00b2\n".encode(), "line 1: label '\u00b2' is not an integer"),
        (f"ok.png\t{TOO_BIG}\n".encode(), "line 1: label 99999999999999999999... does not fit in int64"),
    ],
)
def test_a_file_list_not_utf8_or_with_a_bad_label(cli, tmp_path, png, content, message):
    (tmp_path / "ok.png").write_bytes(png)
    listing = tmp_path / "list.txt"
    listing.write_bytes(content)
    assert message in refused(cli, tmp_path, "--data", f"filelist:{listing}")


def test_a_shard_label_beyond_int64_names_the_sample(cli, tmp_path, png):
    shard = write_tar(
        tmp_path / "a.tar", [("k0.png", png), ("k0.cls", b"1"), ("k1.png", png), ("k1.cls", TOO_BIG.encode())]
    )
    line = refused(cli, tmp_path, "--data", f"wds:{shard}")
    assert "a.tar/k1" in line and "does not fit in int64" in line


def test_duplicate_keys_in_a_shard_are_refused(cli, tmp_path, png):
    shard = write_tar(tmp_path / "a.tar", [("k0.png", png), ("k1.png", png), ("k0.png", png)])
    line = refused(cli, tmp_path, "--data", f"wds:{shard}")
    assert "holds 'k0.png' twice" in line and "keys in a shard must be unique" in line


def parquet(path: Path, image: list, label: list | None = None) -> Path:
    columns = {"image": image, **({"label": label} if label is not None else {})}
    pq.write_table(pa.table(columns), path)
    return path


@pytest.mark.parametrize("cells", [[1, 2], ["a.png", "b.png"]])
def test_a_parquet_image_column_of_integers_or_strings_is_refused_before_the_loop(cli, tmp_path, cells):
    path = parquet(tmp_path / "d.parquet", cells)
    line = refused(cli, tmp_path, "--data", f"parquet:{path}", "--image-key", "image")
    assert "column 'image' (--image-key) holds" in line and "not images" in line
    assert not (tmp_path / "out.zarr").exists()


@pytest.mark.parametrize("labels", [[0.5, 1.0], [True, False]])
def test_a_parquet_label_column_of_floats_or_booleans_is_refused(cli, tmp_path, png, labels):
    path = parquet(tmp_path / "d.parquet", [png, png], labels)
    assert "label column 'label' holds" in refused(cli, tmp_path, "--data", f"parquet:{path}")


def test_parquet_string_labels_become_sorted_classes_as_datasets_maps_them(cli, tmp_path, png):
    datasets = pytest.importorskip("datasets")
    names = ["dog", "cat", None, "dog", "bird"]
    parquet(tmp_path / "a.parquet", [png] * 3, names[:3])
    parquet(tmp_path / "b.parquet", [png] * 2, names[3:])
    out = tmp_path / "out.zarr"
    code, _, err = cli(*SMALL, "--out", out, "--data", f"parquet:{tmp_path}/*.parquet")
    assert code == 0, err
    assert "label column 'label' holds class names: mapped to class ids 0..2 in sorted order" in err
    group = zarr.open_group(out, mode="r")
    encoded = datasets.Dataset.from_dict({"label": names}).class_encode_column("label")
    assert group.attrs["classes"] == encoded.features["label"].names == ["bird", "cat", "dog"]
    assert group["labels"][:].tolist() == [2, 1, -1, 2, 0]
    assert [v if v is not None else -1 for v in encoded["label"]] == [2, 1, -1, 2, 0]


def test_mixed_integer_and_string_labels_across_files_are_refused(cli, tmp_path, png):
    parquet(tmp_path / "a.parquet", [png], [0])
    parquet(tmp_path / "b.parquet", [png], ["cat"])
    assert "has string labels, other files not" in refused(cli, tmp_path, "--data", f"parquet:{tmp_path}/*.parquet")


def test_a_uint64_label_beyond_int64_names_the_row(cli, tmp_path, png):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"image": [png], "label": pa.array([2**63], pa.uint64())}), path)
    line = refused(cli, tmp_path, "--data", f"parquet:{path}")
    assert "d.parquet row 0" in line and "does not fit in int64" in line


@pytest.mark.parametrize("kind", ["not utf-8", "directory"])
def test_a_config_that_is_not_utf8_or_is_a_directory(cli, tmp_path, kind):
    job = tmp_path / "job.toml"
    if kind == "directory":
        job.mkdir()
    else:
        job.write_bytes(b'model = "r\xe9snet18"\n')
    code, _, err = cli("--config", job)
    message = "is a directory; name a TOML file" if kind == "directory" else "is not UTF-8 text (byte 10)"
    assert code == 2 and err.count("\n") == 1 and message in err and "chunks" not in err, err
