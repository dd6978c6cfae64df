"""``--sae LAYER=PATH`` (issue 32): a job stores a layer's SAE codes sparse (``latents/<layer>``), and
they must be sae_lens's own: the top-k of ``sae.encode(x)`` on the layer's rows as the same store keeps
them (``--dtype float32``), chosen by numpy (value descending, lower latent first), values as float16;
the per-chunk statistics numpy's over the dense codes of each chunk's rows. 1 and 2 processes and a
killed then rerun job give the same bytes; bad input is one line, exit 2, with nothing written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr
from helpers import ROOT, patience
from helpers.launches import Sequence, environment
from helpers.saes import top_k_codes
from helpers.text_models import real_documents, save_text_model, write_jsonl

pytest.importorskip("sae_lens")

HOOK, WIDTH, D_SAE = "blocks.1.hook_resid_post", 32, 64
RAGGED = ["--context-length", "80", "--chunk-size", "48", "--tokens-per-batch", "96", "--dtype", "float32"]
PACKED = ["--pack", "40", "--chunk-size", "56", "--tokens-per-batch", "120", "--dtype", "float32"]


def _save_sae(path, architecture: str, d_in: int = WIDTH, hook: str = HOOK, seed: int = 1):
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata

    kinds = {
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig, {"k": 8}),
        "relu": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig, {}),
    }
    sae_class, cfg_class, extra = kinds[architecture]
    sae = sae_class(cfg_class(d_in=d_in, d_sae=D_SAE, metadata=SAEMetadata(hook_name=hook), **extra))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # not the initialisation's zeros: every term of the encoder counts
        for parameter in sae.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    sae.save_model(path)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("sae-store")
    write_jsonl(root / "docs.jsonl", [*real_documents(24, seed=5), ""])
    model = save_text_model("gpt2", root / "gpt2")
    saes = {name: _save_sae(root / name, name) for name in ("topk", "relu")}
    return root, model, saes


def _job(corpus, out, sae: str, *options, layer: str = HOOK):
    root, model, saes = corpus
    return [
        "--model", f"hf:{model}", "--layers", layer, "transformer.h.0", "--data", f"text:{root / 'docs.jsonl'}",
        "--sae", f"{HOOK}={saes[sae]}", *options, "--out", str(out),
    ]  # fmt: skip


def _jobs(corpus, folder):
    return {
        "topk": _job(corpus, folder / "topk.zarr", "topk", *RAGGED),
        # the layer given by its module, the SAE by its TransformerLens hook: the same tensor
        "relu_packed": _job(corpus, folder / "relu.zarr", "relu", *PACKED, "--sae-k", "16", layer="transformer.h.1"),
        "only": _job(corpus, folder / "only.zarr", "topk", *RAGGED, "--sae-only"),
    }


@pytest.fixture(scope="module")
def one(corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("one")
    sequence = Sequence(None, _jobs(corpus, folder), folder)
    finished = sequence.run(timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    for name in _jobs(corpus, folder):
        assert sequence.result(name).codes == [0], sequence.result(name).stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def two(corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("two")
    jobs = {k: v for k, v in _jobs(corpus, folder).items() if k != "only"}
    sequence = Sequence(2, jobs, folder)
    finished = sequence.run(timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    for name in jobs:
        assert sequence.result(name).codes == [0, 0], sequence.result(name).stderr[-3000:]
    return folder


def _dense(sae_path, rows: np.ndarray) -> np.ndarray:
    from sae_lens import SAE

    with torch.no_grad():
        return SAE.load_from_disk(sae_path).encode(torch.from_numpy(rows)).numpy()


def _check_codes(store, layer: str, sae_path, k: int, rows: np.ndarray | None = None) -> None:
    group = zarr.open_group(store, mode="r")
    rows = group[f"features/{layer}"][:] if rows is None else rows
    dense = _dense(sae_path, rows)
    indices, values = group[f"latents/{layer}/indices"][:], group[f"latents/{layer}/values"][:]
    want_indices, want_values = top_k_codes(dense, k)
    assert indices.dtype == np.int32 and values.dtype == np.float16 and indices.shape == (len(rows), k)
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_array_equal(values, want_values.astype(np.float16))
    statistics = group[f"stats/latents/{layer}"]
    columns, chunk = statistics.attrs["columns"], group.attrs["chunk_size"]
    assert statistics.shape[0] == -(-len(rows) // chunk)
    for c, row in enumerate(statistics[:]):
        codes = dense[c * chunk : (c + 1) * chunk].astype(np.float64)
        part = {name: row[start:stop] for name, (start, stop) in columns.items()}
        active = codes != 0
        np.testing.assert_array_equal(part["count"], active.sum(0))
        np.testing.assert_allclose(part["sum"], codes.sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(part["max"], codes.max(0), rtol=1e-6)
        assert part["rows"][0] == len(codes) and part["rows_over_k"][0] == (active.sum(1) > k).sum()
        kept = np.sort(np.where(active, codes, -np.inf), axis=1)[:, ::-1][:, :k]
        dropped = codes.sum() - kept[np.isfinite(kept)].sum()
        np.testing.assert_allclose(part["dropped_mass"][0], dropped, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, sae, k", [("topk", "topk", 8), ("relu_packed", "relu", 16)])
def test_stored_codes_are_sae_lens_encode_of_the_stored_rows(corpus, one, name, sae, k):
    store = one / {"topk": "topk.zarr", "relu_packed": "relu.zarr"}[name]
    layer = HOOK if name == "topk" else "transformer.h.1"
    _check_codes(store, layer, corpus[2][sae], k)
    attrs = zarr.open_group(store, mode="r")[f"latents/{layer}"].attrs
    assert (attrs["d_sae"], attrs["k"], attrs["hook_name"]) == (D_SAE, k, HOOK)
    assert attrs["architecture"] == {"topk": "topk", "relu": "standard"}[sae]


def test_sae_only_stores_the_codes_alone(corpus, one):
    group = zarr.open_group(one / "only.zarr", mode="r")
    assert f"features/{HOOK}" not in group and "features/transformer.h.0" in group
    reference = zarr.open_group(one / "topk.zarr", mode="r")
    _check_codes(one / "only.zarr", HOOK, corpus[2]["topk"], 8, rows=reference[f"features/{HOOK}"][:])


def _arrays(location) -> dict[str, np.ndarray]:
    group = zarr.open_group(location, mode="r")
    return {name: member[:] for name, member in group.members(max_depth=None) if isinstance(member, zarr.Array)}


def _assert_same_bytes(location, reference) -> None:
    ours, theirs = _arrays(location), _arrays(reference)
    assert sorted(ours) == sorted(theirs)
    for name, values in theirs.items():
        assert ours[name].dtype == values.dtype, name
        if values.dtype.kind in "fiub":
            assert np.array_equal(ours[name].view(np.uint8), values.view(np.uint8)), name
        else:
            assert (ours[name] == values).all(), name


@pytest.mark.parametrize("store", ["topk.zarr", "relu.zarr"])
def test_two_processes_give_the_bytes_of_one(one, two, store):
    _assert_same_bytes(two / store, one / store)


def test_a_killed_run_rerun_gives_the_bytes_of_one(corpus, one, tmp_path):
    out = tmp_path / "killed.zarr"
    args = [*_job(corpus, out, "topk", *RAGGED[:-4], "--tokens-per-batch", "16", "--dtype", "float32")]
    command = [sys.executable, "-m", "extract", *args]
    job = subprocess.Popen(command, cwd=ROOT, env=environment(), stderr=subprocess.DEVNULL)
    patience.until(
        lambda: (out / "done" / "c").is_dir() and len(os.listdir(out / "done" / "c")) >= 2, "2 chunks", [job.pid],
        quiet=120, pause=0.05,
    )  # fmt: skip
    job.send_signal(signal.SIGKILL)
    job.wait()
    done = len(os.listdir(out / "done" / "c"))
    assert 0 < done < zarr.open_group(out, mode="r")["done"].shape[0], "the run was not killed mid-way"
    rerun = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming" in rerun.stderr
    reference = tmp_path / "reference.zarr"
    again = subprocess.run([*command[:-1], str(reference)], cwd=ROOT, env=environment(), capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    _assert_same_bytes(out, reference)
    verified = subprocess.run(
        [sys.executable, "-m", "extract", "verify", str(out)],
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_resume_with_another_sae_is_refused(corpus, one, tmp_path):
    from extract.errors import ExtractError  # noqa: F401 - the exit status says it

    out = tmp_path / "store.zarr"
    args = _job(corpus, out, "topk", *RAGGED)
    first = subprocess.run(
        [sys.executable, "-m", "extract", *args], cwd=ROOT, env=environment(), capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr[-2000:]
    other = [*args]
    other[other.index("--sae") + 1] = f"{HOOK}={corpus[2]['relu']}"
    refused = subprocess.run(
        [sys.executable, "-m", "extract", *other], cwd=ROOT, env=environment(), capture_output=True, text=True
    )
    assert refused.returncode != 0 and "sae" in refused.stderr


def _bad(corpus, tmp_path, capsys, sae_path, layer_options=()):
    from extract.cli.extract import main

    root, model, _ = corpus
    out = tmp_path / "bad.zarr"
    args = [
        "--model", f"hf:{model}", "--layers", HOOK, *layer_options, "--data", f"text:{root / 'docs.jsonl'}",
        "--sae", f"{HOOK}={sae_path}", *RAGGED, "--out", str(out),
    ]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("extract")]  # not transformers' progress bars
    assert len(said) == 1 and said[0].startswith("extract: error: "), err
    message = said[0]
    assert not out.exists()
    return message


def test_an_sae_of_another_width_is_one_line(corpus, tmp_path, capsys):
    sae = _save_sae(tmp_path / "narrow", "relu", d_in=16)
    message = _bad(corpus, tmp_path, capsys, sae)
    assert "d_in=16" in message and "32 wide" in message


def test_an_sae_of_another_hook_is_one_line(corpus, tmp_path, capsys):
    sae = _save_sae(tmp_path / "other", "relu", hook="blocks.2.hook_resid_post")
    message = _bad(corpus, tmp_path, capsys, sae)
    assert "blocks.2.hook_resid_post" in message and HOOK in message and "transformer.h.2" in message


def test_a_directory_that_is_no_sae_is_one_line(corpus, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    message = _bad(corpus, tmp_path, capsys, tmp_path / "empty")
    assert "cfg.json" in message and str(tmp_path / "empty") in message


def test_missing_sae_lens_is_one_line(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sae_lens", None)  # import sae_lens raises ImportError
    message = _bad(corpus, tmp_path, capsys, corpus[2]["topk"])
    assert "pip install 'extract[sae]'" in message


def test_a_pooled_store_is_refused_in_one_line(corpus, tmp_path, capsys):
    message = _bad(corpus, tmp_path, capsys, corpus[2]["topk"], layer_options=("--pool", "mean"))
    assert "--sae" in message and "per document" in message


def test_codes_a_job_stored_read_back_and_rank_as_numpy_says(one, tmp_path):
    """The read side over a store the job wrote: ``latents`` and ``latent`` are the stored codes,
    ``TokenStream`` yields each token's codes once an epoch, and ``extract top`` ranks every latent's
    tokens as a brute-force numpy ranking of the same codes does (value descending, lower row first)."""
    import pyarrow.parquet as pq

    from extract import TokenStream, open_features
    from extract.cli.top import main as top_main

    store = one / "topk.zarr"
    group = zarr.open_group(store, mode="r")
    indices, values = group[f"latents/{HOOK}/indices"][:], group[f"latents/{HOOK}/values"][:]
    dense = np.zeros((len(indices), D_SAE), dtype=np.float32)
    rows = np.repeat(np.arange(len(indices)), indices.shape[1])
    kept = indices.ravel() >= 0
    dense[rows[kept], indices.ravel()[kept]] = values.ravel()[kept].astype(np.float32)

    features = open_features(store)
    np.testing.assert_array_equal(features.latents(HOOK).toarray(), dense)
    np.testing.assert_array_equal(features.latents(HOOK, rows=slice(5, 40), as_torch=True).to_dense().numpy(), dense[5:40])
    np.testing.assert_array_equal(features.latent(HOOK, 3), dense[:, 3])

    stream = TokenStream(store, f"latents/{HOOK}", batch_size=32, return_index=True, threads=0)
    seen = np.zeros(len(dense), dtype=int)
    for batch, index in stream:
        np.testing.assert_array_equal(batch.to_dense().numpy(), dense[index.numpy()])
        np.add.at(seen, index.numpy(), 1)
    assert (seen == 1).all()

    k = 3
    assert top_main([str(store), "--layer", HOOK, "-k", str(k), "--context", "4", "--out", str(tmp_path / "top")]) == 0
    table = pq.read_table(tmp_path / "top" / "top.parquet").to_pandas()
    for latent in range(D_SAE):
        column = dense[:, latent]
        order = np.lexsort((np.arange(len(column)), -column))
        want = [int(r) for r in order[:k] if column[r] > 0]
        got = table[table.latent == latent].sort_values("rank")
        assert got.row.tolist() == want, latent
        np.testing.assert_array_equal(got.activation.to_numpy(), column[want])


def test_a_damaged_codes_chunk_is_found_repaired_and_recomputed(corpus, one, tmp_path, capsys):
    """A flipped byte in a chunk of the codes: ``verify`` names it, ``--repair`` clears that chunk's
    ``done``, and the rerun of the same job writes the bytes of the undamaged store again."""
    import shutil

    from extract.cli.extract import main as extract_main
    from extract.cli.verify import main as verify_main

    out = tmp_path / "damaged.zarr"
    shutil.copytree(one / "topk.zarr", out)
    chunk = out / "latents" / HOOK / "values" / "c" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert verify_main([str(out)]) != 0
    found = capsys.readouterr()
    assert f"latents/{HOOK}/values" in found.out + found.err
    assert verify_main([str(out), "--repair"]) == 1  # damage was found (and its done cleared)
    assert not zarr.open_group(out, mode="r")["done"][1]
    capsys.readouterr()
    assert extract_main(_job(corpus, out, "topk", *RAGGED)) == 0
    _assert_same_bytes(out, one / "topk.zarr")
    assert verify_main([str(out)]) == 0


def test_codes_on_s3_are_the_bytes_of_the_codes_on_disk(corpus, one, s3):
    """The same job with ``--out`` on S3 (moto's server): every array, the codes and their statistics
    among them, equals the store on disk, and ``features.latents`` reads them back from there."""
    from extract import open_features
    from extract.cli.extract import main as extract_main
    from extract.store.location import open_store

    url = s3.url("codes.zarr")
    assert extract_main(_job(corpus, url, "topk", *RAGGED)) == 0
    _assert_same_bytes(open_store(url, read_only=True), one / "topk.zarr")
    local = open_features(one / "topk.zarr").latents(HOOK).toarray()
    np.testing.assert_array_equal(open_features(url).latents(HOOK).toarray(), local)


def _edited_sae(corpus, tmp_path, name: str, cfg=None, weights=None):
    """A copy of the corpus's top-k SAE, its ``cfg.json`` edited by ``cfg`` (a dict -> dict, or the text to
    write) and its weights' bytes by ``weights`` (bytes -> bytes)."""
    import json
    import shutil

    sae = shutil.copytree(corpus[2]["topk"], tmp_path / name)
    if cfg is not None:
        text = cfg if isinstance(cfg, str) else json.dumps(cfg(json.loads((sae / "cfg.json").read_text())))
        (sae / "cfg.json").write_text(text)
    if weights is not None:
        (sae / "sae_weights.safetensors").write_bytes(weights((sae / "sae_weights.safetensors").read_bytes()))
    return sae


@pytest.mark.parametrize(
    "name, cfg, weights, says",
    [
        ("k-over-d-sae", lambda c: {**c, "k": 100}, None, ["k=100", "d_sae=64", "1 to d_sae"]),
        ("k-zero", lambda c: {**c, "k": 0}, None, ["k=0", "1 to d_sae"]),
        ("not-json", '{"d_in": 32, "d_sae": ', None, ["cfg.json is not JSON", "save the SAE again"]),
        ("torn-weights", None, lambda b: b[: len(b) // 2], ["sae_weights.safetensors is torn", "bytes"]),
        ("empty-weights", None, lambda b: b"", ["sae_weights.safetensors is not safetensors"]),
        ("other-shape", lambda c: {**c, "d_sae": 48, "k": 8}, None, ["W_enc of shape (32, 64)", "d_sae=48", "different SAEs"]),
    ],
)
def test_a_bad_sae_is_one_line_before_the_model_loads_and_nothing_is_created(
    corpus, tmp_path, capsys, name, cfg, weights, says
):
    """Issue 47, item 3: each is one line naming the file, exit 2, no traceback; refused when the job's
    options are checked, before the model loads (a model that does not exist is not reached), so that no
    store, no lock and no scratch directory is left."""
    from extract.cli.extract import main
    from extract.errors import SaeInvalidError
    from extract.job.spec import JobSpec

    sae = _edited_sae(corpus, tmp_path, name, cfg, weights)
    out = tmp_path / "job" / "bad.zarr"
    for model in (f"hf:{corpus[1]}", f"hf:{tmp_path / 'no-such-model'}"):
        args = [*_job(corpus, out, "topk", *RAGGED)]
        args[args.index("--sae") + 1] = f"{HOOK}={sae}"
        args[args.index("--model") + 1] = model
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("extract: error: ") == 1, err
        line = next(line for line in err.splitlines() if line.startswith("extract: error: "))
        assert str(sae) in line and all(part in line for part in says), line
        assert not (tmp_path / "job").exists(), "nothing is created for a refused SAE: no store, lock or scratch"
    with pytest.raises(SaeInvalidError):  # a Python caller catches it by type
        JobSpec(layers=[HOOK], sae=[f"{HOOK}={sae}"], out=str(out)).validate()


def _edit_json(path, edit) -> None:
    import json

    meta = json.loads(path.read_text())
    edit(meta["attributes"])
    path.write_text(json.dumps(meta))


def _zero_sha256(attributes) -> None:
    attributes["latents"][HOOK]["sae_sha256"] = "0" * 64


def _forget_the_digest(attributes) -> None:  # a store made before the SAE records were digested
    _zero_sha256(attributes)
    del attributes["identity_sha256"]["latents"]


@pytest.mark.parametrize(
    "edit, names, repairs",
    [
        ("zarr.json", _zero_sha256, True),
        (f"latents/{HOOK}/zarr.json", lambda attributes: attributes.update(k=4), True),
        ("zarr.json", _forget_the_digest, False),
    ],
    ids=["root-sae-sha256", "group-k", "root-sae-sha256-no-digest"],
)
def test_edited_sae_metadata_are_named_by_verify_and_refused_by_a_rerun(corpus, one, tmp_path, capsys, edit, names, repairs):
    """Issue 47, item 2: ``latents[L].sae_sha256`` zeroed in the root attributes, or ``k`` changed on the
    ``latents/L`` group. ``verify`` names it (exit 1); a rerun of the job's command is refused in one line
    (exit 2) instead of saying "already complete"; ``--repair`` puts back what the digest recorded at
    creation proves, after which the rerun finds the store complete; without that digest (a store from
    before) the identity still names the edit, and ``--overwrite`` is the way out."""
    import shutil

    from extract.cli.extract import main
    from extract.cli.verify import main as verify_main

    out = tmp_path / "edited.zarr"
    shutil.copytree(one / "topk.zarr", out)
    args = _job(corpus, out, "topk", *RAGGED)
    assert main(args) == 0 and "already complete" in capsys.readouterr().err
    _edit_json(out / edit, names)
    before = {p: p.read_bytes() for p in out.rglob("zarr.json")}
    assert verify_main([str(out)]) == 1
    said = capsys.readouterr()
    report = said.out + said.err
    assert "metadata damaged" in report and ("sae_sha256 is '000000000000...'" in report or ".attrs.k is 4" in report), report
    assert main(args) == 2
    err = capsys.readouterr().err
    line = [line for line in err.splitlines() if line.startswith("extract: error: ")]
    assert len(line) == 1 and "Traceback" not in err and "SAE metadata were edited" in line[0], err
    assert "--repair" in line[0] and "--overwrite" in line[0]
    assert {p: p.read_bytes() for p in out.rglob("zarr.json")} == before, "a refused rerun must not touch the store"
    verify_main([str(out), "--repair"])
    capsys.readouterr()
    if repairs:
        assert verify_main([str(out)]) == 0, capsys.readouterr()
        assert main(args) == 0 and "already complete" in capsys.readouterr().err
        _assert_same_bytes(out, one / "topk.zarr")
    else:
        assert main(args) == 2 and "SAE metadata were edited" in capsys.readouterr().err
        assert main([*args, "--overwrite"]) == 0, capsys.readouterr().err
        assert verify_main([str(out)]) == 0
