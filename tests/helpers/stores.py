"""Stores for probe / compare / report tests: from arrays (controlled data), and keys + classes
written into array stores (the CLI writes its own); and the check that a rerun gave the same store."""

from pathlib import Path

import numpy as np
import zarr

from extract.store.store import FeatureStore

TINY_ARRAYS = ("features/heads.conv", "labels", "valid", "keys")  # what ``cli.TINY_JOB`` writes per sample


def array_store(
    path: Path, layers: dict[str, np.ndarray], labels: np.ndarray, chunk_size: int, dataset: str = "synthetic:0"
) -> Path:
    """A complete extract store holding ``layers`` (name -> (N, ...) array) and ``labels``."""
    n = len(labels)
    store = FeatureStore.create(
        path, shapes={k: v.shape[1:] for k, v in layers.items()}, num_samples=n, chunk_size=chunk_size,
        dtype="float32", compressor="none",
        attrs={"layers": list(layers), "num_samples": n, "chunk_size": chunk_size, "status": "running",
               "dataset": dataset},
    )  # fmt: skip
    for chunk, start in enumerate(range(0, n, chunk_size)):
        stop = min(start + chunk_size, n)
        store.write_chunk(
            chunk,
            start,
            stop,
            {k: v[start:stop] for k, v in layers.items()},
            labels[start:stop],
            np.ones(stop - start, bool),
        )
    store.update_attrs(status="complete")
    return path


def add_keys(path: Path, keys: list[str], classes: list[str] | None = None) -> None:
    """Root ``keys`` (N,) strings and the ``classes`` attribute, as stores will have them."""
    group = zarr.open_group(path, mode="r+")
    chunks = (group.attrs["chunk_size"],)  # chunked like the data, as the extraction writes them
    array = group.create_array("keys", shape=(len(keys),), chunks=chunks, dtype=str, dimension_names=("sample",))
    array[:] = np.array(keys, dtype=object)
    if classes is not None:
        group.attrs["classes"] = classes


def assert_same_store(got: str | Path, expected: str | Path, arrays: tuple[str, ...] = TINY_ARRAYS) -> None:
    """``got`` is complete, of the same job as ``expected``, and holds the same ``arrays``."""
    a, b = zarr.open_group(got, mode="r"), zarr.open_group(expected, mode="r")
    assert a.attrs["status"] == "complete" and a["done"][:].all()
    assert a.attrs["fingerprint"] == b.attrs["fingerprint"]
    for name in arrays:
        np.testing.assert_array_equal(a[name][:], b[name][:], err_msg=name)


def assert_same_features(
    got: str | Path, expected: str | Path, layers: tuple[str, ...] = ("layer2", "layer4"), atol: float = 1e-5
) -> None:
    """``got`` is complete, of the same job as ``expected``, with every sample present: its features of
    ``layers`` within ``atol`` (ranks batch differently) and its labels equal."""
    a, b = zarr.open_group(got, mode="r"), zarr.open_group(expected, mode="r")
    assert a.attrs["status"] == "complete"
    assert a.attrs["fingerprint"] == b.attrs["fingerprint"]
    for layer in layers:
        x, y = a[f"features/{layer}"][:], b[f"features/{layer}"][:]
        assert not np.isnan(x).any(), "every sample present"
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)
    np.testing.assert_array_equal(a["labels"][:], b["labels"][:])
    assert a["done"][:].all()


def all_arrays(location) -> dict[str, np.ndarray]:
    group = zarr.open_group(location, mode="r")
    return {name: member[:] for name, member in group.members(max_depth=None) if isinstance(member, zarr.Array)}


def assert_same_bytes(location, reference) -> None:
    """Every array of the two stores holds the same bytes (NaN rows included), and the digests recorded
    at creation agree."""
    ours, theirs = all_arrays(location), all_arrays(reference)
    assert sorted(ours) == sorted(theirs)
    for name, values in theirs.items():
        got = ours[name]
        assert got.dtype == values.dtype and got.shape == values.shape, name
        if values.dtype.kind in "fiub":
            same = np.array_equal(got.view(np.uint8), values.view(np.uint8))
            if not same and values.dtype.kind == "f":
                worst = np.nanmax(np.abs(got.astype(np.float64) - values))
                raise AssertionError(f"{name} differs (by up to {worst:.3g})")
            assert same, name
        else:
            assert (got == values).all(), name
    group, reference_group = zarr.open_group(location, mode="r"), zarr.open_group(reference, mode="r")
    assert group.attrs.get("document_digests") == reference_group.attrs.get("document_digests")
    assert group.attrs["status"] == "complete"
