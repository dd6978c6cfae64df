"""Issue 46, reading without torch: ``import extract``, ``open_features``, ``load``, ``labels``, ``keys`` and
xarray (``decode_bfloat16``) import no torch in a fresh interpreter, and read what zarr reads; torch comes
with what hands out tensors (``as_torch=True``, ``pool=``, ``FeatureDataset``, ``TokenStream``), which
still works. A token store with SAE codes: ``test_latents_read.py``; a bfloat16 store: ``test_bfloat16.py``.
The numpy conversions are torch's own (float32 to float16, in any order of rows), checked here in-process."""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch
import zarr
from helpers import ROOT
from helpers.no_torch import imported_by
from helpers.stores import add_keys, array_store

from extract import open_features
from extract.read import features as features_module

N, CHUNK = 40, 16


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A complete image store: ``fc`` (8,) and ``conv`` (4, 3, 3) a sample, labels, keys and classes."""
    rng = np.random.default_rng(0)
    layers = {
        "fc": rng.standard_normal((N, 8)).astype(np.float32) * 1e3,  # some beyond float16's precision
        "conv": rng.standard_normal((N, 4, 3, 3)).astype(np.float32),
    }
    path = array_store(tmp_path_factory.mktemp("no_torch") / "images.zarr", layers, np.arange(N) % 3, CHUNK)
    add_keys(path, [f"class{i % 3}/{i}.png" for i in range(N)], ["a", "b", "c"])
    return path


NUMPY_READS = """
import numpy as np, xarray as xr, zarr
import extract
from extract import open_features
from extract.read import decode_bfloat16
f = open_features(path)
raw = zarr.open_group(path, mode="r")
for layer in f.layers:
    stored = raw[f"features/{layer}"][:]
    assert np.array_equal(f.load(layer), stored)
    assert np.array_equal(f.load(layer, [5, 3, 3, 30], dtype="float64"), stored[[5, 3, 3, 30]].astype(np.float64))
    assert np.array_equal(f.load(layer, f.present, dtype="float16"), stored.astype(np.float16))
    assert f.pooled_shape(layer) == stored.shape[1:]
assert np.array_equal(f.labels, raw["labels"][:]) and np.array_equal(f.load_labels([3, 1]), raw["labels"][[3, 1]])
assert f.keys.tolist() == raw["keys"][:].tolist() and f.classes == ["a", "b", "c"]
assert f.valid.all() and f.dtypes["fc"] == np.float32 and "N=40" in repr(f)
ds = decode_bfloat16(xr.open_zarr(path, group="features", consolidated=False))
assert np.array_equal(ds["fc"].values, raw["features/fc"][:])
"""


def test_a_numpy_reader_of_an_image_store_imports_no_torch(images):
    assert imported_by("import extract\nfrom extract import ExtractError, open_features\n") == []
    assert imported_by(NUMPY_READS, path=images) == []


def test_the_torch_reads_import_torch_and_still_work(images):
    script = """
    import extract, torch
    f = extract.open_features(path)
    assert isinstance(f.load("fc", [2, 0], as_torch=True), torch.Tensor)
    assert f.load("conv", pool="avg").shape == (40, 4)
    dataset = extract.FeatureDataset(path, "fc")
    sampler = extract.ChunkShuffleSampler(len(dataset), dataset.chunk_size, batch_size=8)
    assert len(dataset) == 40 and len(list(sampler)) > 0 and dataset[0] is not None
    from extract.read import FeatureDataset, TokenStream
    assert FeatureDataset is extract.FeatureDataset and TokenStream is extract.TokenStream
    """
    assert "torch" in imported_by(script, path=images)


@pytest.mark.parametrize("torch_imported", [False, True])
def test_numpy_converts_as_torch_did(images, monkeypatch, torch_imported):
    """The numpy read's casts (the stored float32 to float16, float64; rows in the caller's order) are
    torch's, which made every read before: the same values, bit for bit; in a process without torch
    (numpy converts) and in one with it (torch converts, cheaper)."""
    monkeypatch.setattr(features_module, "_torch_imported", lambda: torch_imported)
    f = open_features(images)
    stored = zarr.open_group(images, mode="r")["features/fc"][:]
    picked = [7, 1, 1, 39, 0]
    for dtype in (torch.float16, torch.float64, torch.int32):
        name = str(dtype).removeprefix("torch.")
        expected = torch.from_numpy(stored).to(dtype)[torch.tensor(picked)]
        got = f.load("fc", picked, dtype=name)
        assert got.dtype == expected.numpy().dtype and got.tobytes() == expected.numpy().tobytes(), name
        as_torch = f.load("fc", picked, dtype=name, as_torch=True)
        assert as_torch.dtype == dtype and torch.equal(as_torch, expected), name


# the modules that hand out tensors or compute in torch, and so import it at the top: the writer, the pools,
# and the torch readers, which ``extract`` and ``extract.read`` import only when they are first named
TORCH_MODULES = {"store/writer.py", "names/pooling.py", "read/dataset.py", "read/tokens.py"}


def _top_level_torch(path) -> list[int]:
    """The lines of ``path`` that import torch when the module is imported: at the top, or in a block there
    (``try``, ``if``) other than ``if TYPE_CHECKING:``; not in a function or a class's method."""
    lines = []
    pending = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            lines.append(node.lineno)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            pending.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return lines


def test_no_module_of_the_read_path_imports_torch_at_the_top():
    """What the subprocess tests find by running, named: every module of ``read/``, ``store/``, ``names/``,
    ``errors.py`` and ``extract/__init__.py`` but ``TORCH_MODULES`` imports torch inside what needs it."""
    package = ROOT / "extract"
    modules = [package / "__init__.py", package / "errors.py"]
    modules += [path for part in ("read", "store", "names") for path in sorted((package / part).glob("*.py"))]
    found = {
        str(path.relative_to(package)): lines
        for path in modules
        if str(path.relative_to(package)) not in TORCH_MODULES and (lines := _top_level_torch(path))
    }
    assert found == {}, f"torch imported at the top (move it into the function that needs it): {found}"
    assert all((package / name).exists() for name in TORCH_MODULES)
