"""Issue 45, every read checks place and content: in a complete store, a chunk object that is not the one
the store's digests record for its chunk (swapped with another chunk's, copied over another, taken from
another store of the same shape) passes its own checksum, so before this issue ``load``, ``TokenStream`` and
``extract top`` read it as the chunk's rows. Now each reader, on disk (the direct read and zarr's) and on
object storage, raises ``StoreDamagedError`` naming the array, the chunk and the fix. The undamaged store
reads the bytes zarr's own read gives, and a store from before digests reads as it did."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import zarr
from helpers.s3 import s3_per_module, upload  # noqa: F401 - s3_per_module: this module's s3
from helpers.text_models import real_documents, save_text_model, write_jsonl

from extract import FeatureDataset, TokenStream, open_features
from extract.cli.extract import main as extract_main
from extract.cli.top import main as top_main
from extract.errors import StoreDamagedError
from extract.read.direct import direct_chunks

pytest.importorskip("sae_lens")

LAYER, HOOK, WIDTH, D_SAE, CHUNK = "transformer.h.0", "blocks.1.hook_resid_post", 32, 64, 48
CODES = "transformer.h.1"  # the layer the SAE reads (its hook, HOOK): its codes are latents/CODES
DAMAGED, OTHER = 2, 1  # the chunk whose object is replaced, and the chunk a swap or copy takes it from
HOWS = ["swapped", "copied", "foreign"]


def _save_sae(path):
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata

    config = sae_lens.TopKSAEConfig(d_in=WIDTH, d_sae=D_SAE, k=8, metadata=SAEMetadata(hook_name=HOOK))
    sae = sae_lens.TopKSAE(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # not the initialisation's zeros: every latent can fire
        for parameter in sae.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    sae.save_model(path)
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Token stores of one layer and one SAE's codes, chunks of 48 tokens, float16: ``none`` (the direct
    read) and ``zstd`` (zarr's read), and ``other`` / ``other-zstd``: those jobs on another model's weights,
    the same shape and chunks but other rows."""
    root = tmp_path_factory.mktemp("place")
    data = write_jsonl(root / "docs.jsonl", real_documents(12, seed=5))
    sae = _save_sae(root / "sae")
    made = {}
    jobs = (("none", 0, "none"), ("zstd", 0, "zstd"), ("other", 7, "none"), ("other-zstd", 7, "zstd"))
    for name, seed, compressor in jobs:
        model = save_text_model("gpt2", root / f"gpt2-{seed}", seed=seed)
        out = root / f"{name}.zarr"
        assert extract_main([
            "--model", f"hf:{model}", "--data", f"text:{data}", "--layers", LAYER, CODES,
            "--sae", f"{HOOK}={sae}", "--context-length", "64", "--chunk-size", str(CHUNK), "--dtype", "float16",
            "--compressor", compressor, "--out", str(out),
        ]) == 0  # fmt: skip
        made[name] = out
    assert open_features(made["none"]).num_chunks > DAMAGED
    return made


def object_of(store, array: str, chunk: int):
    place = store / array / "c" / str(chunk)
    return place if place.is_file() else next(p for p in sorted(place.rglob("*")) if p.is_file())


def misplace(store, array: str, how: str, other_store=None) -> None:
    """Replace chunk ``DAMAGED``'s object of ``array``: with chunk ``OTHER``'s (``copied``), exchanged with it
    (``swapped``), or with the same chunk's object of ``other_store`` (``foreign``)."""
    target, source = object_of(store, array, DAMAGED), object_of(store, array, OTHER)
    if how == "foreign":
        source = object_of(other_store, array, DAMAGED)
    data, replaced = source.read_bytes(), target.read_bytes()
    assert data != replaced, "a misplacement must change the object"
    target.write_bytes(data)
    if how == "swapped":
        source.write_bytes(replaced)


def copy_of(stores, name, tmp_path):
    path = tmp_path / f"{name}.zarr"
    shutil.copytree(stores[name], path)
    return path


def names_the_misplacement(error, path, array: str, how: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    chunks = (DAMAGED, OTHER) if how == "swapped" else (DAMAGED,)  # a swap damages both: either is named
    start = next(k for k in chunks if f"chunk {k} (samples {k * CHUNK}-" in message)
    assert any(f"{array}/c/{start}{rest} ends with crc32c" in message for rest in ("", "/0")), message
    assert "is not the object the store recorded" in message, message
    assert f"python -m extract.verify {path} --repair" in message and "the job's command" in message, message


def epoch(stream) -> tuple[np.ndarray, np.ndarray]:
    """An epoch's rows as float32, in global row order, and how many times each row came."""
    values, rows = [], []
    for batch, index in stream:
        values.append(batch.float().numpy())
        rows.append(index.numpy())
    values, rows = np.concatenate(values), np.concatenate(rows)
    return values[np.argsort(rows, kind="stable")], np.bincount(rows)


@pytest.mark.parametrize("name", ["none", "zstd"])
def test_an_undamaged_store_reads_what_zarr_reads(stores, name):
    """The place check passes every object in its place: each reader gives zarr's own read's bytes."""
    path = stores[name]
    expected = zarr.open_group(path, mode="r")[f"features/{LAYER}"][:]
    f = open_features(path)
    assert (direct_chunks(f.array(LAYER)) is not None) == (name == "none")
    np.testing.assert_array_equal(f.load(LAYER, dtype=None), expected)
    for threads in (0, 2):
        stream = TokenStream(path, LAYER, 40, threads=threads, dtype="float16", return_index=True, window=2)
        values, seen = epoch(stream)
        assert (seen == 1).all() and len(seen) == len(expected)
        np.testing.assert_array_equal(values, expected.astype(np.float32))
    np.testing.assert_array_equal(FeatureDataset(path, LAYER, dtype="float16")[DAMAGED * CHUNK][0].numpy(),
                                  expected[DAMAGED * CHUNK])  # fmt: skip


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("name", ["none", "zstd"])
def test_a_misplaced_feature_object_is_named_by_every_reader(stores, tmp_path, name, how):
    path = copy_of(stores, name, tmp_path)
    array = f"features/{LAYER}"
    misplace(path, array, how, stores["other" if name == "none" else "other-zstd"])
    f = open_features(path)
    row = DAMAGED * CHUNK + 3
    reads = [
        lambda: f.load(LAYER),
        lambda: f.load(LAYER, [row, 0]),
        lambda: f.load(LAYER, slice(row, row + 2), dtype=None),
        lambda: f.text.document(int(f.text.documents_of(np.array([row]))[0]), LAYER),
        lambda: FeatureDataset(path, LAYER)[row],
        lambda: list(TokenStream(path, LAYER, 16, threads=2)),
        lambda: list(TokenStream(path, LAYER, 16, threads=0, dtype="float16")),
        lambda: list(TokenStream(path, [LAYER, CODES], 16, stack=True)),
    ]
    for read in reads:
        with pytest.raises(StoreDamagedError) as error:
            read()
        names_the_misplacement(error, path, array, how)
    # the chunks in their place still read, as stored
    whole = zarr.open_group(stores[name], mode="r")[array][:]
    np.testing.assert_array_equal(f.load(LAYER, slice(0, OTHER * CHUNK), dtype=None), whole[: OTHER * CHUNK])


@pytest.mark.parametrize("how", HOWS)
def test_misplaced_sae_codes_are_named_by_latents_the_stream_and_top(stores, tmp_path, capsys, how):
    path = copy_of(stores, "none", tmp_path)
    array = f"latents/{CODES}/indices"
    misplace(path, array, how, stores["other"])
    f = open_features(path)
    reads = [
        lambda: f.latents(CODES),
        lambda: f.latent(CODES, 3),
        lambda: f.codes(CODES, slice(DAMAGED * CHUNK, DAMAGED * CHUNK + 5)),
        lambda: list(TokenStream(path, f"latents/{CODES}", 16)),
    ]
    for read in reads:
        with pytest.raises(StoreDamagedError) as error:
            read()
        names_the_misplacement(error, path, array, how)
    capsys.readouterr()
    # extract top: its own reads, the same check, said in one line
    assert top_main([str(path), "--layer", CODES, "-k", "3", "--out", str(tmp_path / "top")]) != 0
    said = capsys.readouterr().err.strip().splitlines()[-1]
    names_the_misplacement(pytest.ExceptionInfo.from_exc_info((StoreDamagedError, StoreDamagedError(said), None)),
                           path, array, how)  # fmt: skip


def test_a_misplaced_token_row_object_is_named(stores, tmp_path):
    """The per-token arrays written with each chunk are under the digests too (token ids; ``special`` is read
    through the same check, but its chunks here compress to the same bytes)."""
    path = copy_of(stores, "none", tmp_path)
    misplace(path, "token_ids", "copied")
    f = open_features(path)
    for read, array in (
        (lambda: f.text.token_ids, "token_ids"),
        (lambda: f.text.load_token_ids(slice(DAMAGED * CHUNK, DAMAGED * CHUNK + 4)), "token_ids"),
    ):
        with pytest.raises(StoreDamagedError) as error:
            read()
        names_the_misplacement(error, path, array, "copied")


def test_a_store_without_digests_reads_as_before(stores, tmp_path):
    """A store from before digests (no ``digests`` array) has nothing to compare with: a copied object reads
    as the rows it holds, as every read did before (``verify`` says it cannot check places)."""
    path = copy_of(stores, "none", tmp_path)
    shutil.rmtree(path / "digests")
    misplace(path, f"features/{LAYER}", "copied")
    stored = zarr.open_group(stores["none"], mode="r")[f"features/{LAYER}"][:]
    got = open_features(path).load(LAYER, slice(DAMAGED * CHUNK, (DAMAGED + 1) * CHUNK), dtype=None)
    np.testing.assert_array_equal(got, stored[OTHER * CHUNK : (OTHER + 1) * CHUNK])
    values, seen = epoch(TokenStream(path, LAYER, 32, dtype="float16", return_index=True))
    np.testing.assert_array_equal(values[DAMAGED * CHUNK : (DAMAGED + 1) * CHUNK],
                                  stored[OTHER * CHUNK : (OTHER + 1) * CHUNK].astype(np.float32))  # fmt: skip


def test_a_done_chunk_without_its_digests_row_cannot_be_read(stores, tmp_path):
    path = copy_of(stores, "none", tmp_path)
    (path / "digests" / "c" / str(DAMAGED) / "0").unlink()
    f = open_features(path)
    for read in (lambda: f.load(LAYER), lambda: list(TokenStream(path, LAYER, 16))):
        with pytest.raises(StoreDamagedError) as error:
            read()
        message = str(error.value)
        assert f"chunk {DAMAGED} (samples {DAMAGED * CHUNK}-" in message and f"digests/c/{DAMAGED}/0" in message
        assert "cannot be checked" in message and "--repair" in message, message
    np.testing.assert_array_equal(f.load(LAYER, slice(0, CHUNK), dtype=None),
                                  zarr.open_group(path, mode="r")[f"features/{LAYER}"][:CHUNK])  # fmt: skip



@pytest.mark.parametrize("how", HOWS)
def test_a_misplaced_object_on_object_storage_is_named(stores, tmp_path, s3, how):
    """On S3 the stream's window is prefetched (one GET an object) and decoded by zarr: the same check, on
    the bytes of that one GET."""
    local = copy_of(stores, "none", tmp_path)
    array = f"features/{LAYER}"
    misplace(local, array, how, stores["other"])
    url = upload(s3, local, f"{how}.zarr")
    f = open_features(url)
    reads = [
        lambda: f.load(LAYER),
        lambda: list(TokenStream(url, LAYER, 16, threads=2)),
        lambda: list(TokenStream(url, LAYER, 16, threads=0)),
        lambda: FeatureDataset(url, LAYER)[DAMAGED * CHUNK],
        lambda: f.latents(CODES),  # in its place: reads; the check is per array
    ]
    for read in reads[:-1]:
        with pytest.raises(StoreDamagedError) as error:
            read()
        names_the_misplacement(error, url, array, how)
    indices = zarr.open_group(stores["none"], mode="r")[f"latents/{CODES}/indices"][:]
    assert reads[-1]().shape == (len(indices), D_SAE)
