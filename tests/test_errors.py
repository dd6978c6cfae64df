"""Errors have types a Python user can catch: each also derives from the builtin one expects, and the
command line still prints its message on one line."""

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers import TINY

import extract
from extract import ExtractError, resolve_layers
from extract.errors import (
    InvalidRequestError,
    LayerNotFoundError,
    SampleIndexError,
    StoreBeingCreatedError,
    StoreBusyError,
    StoreDamagedError,
    StoreMismatchError,
    StoreNotFoundError,
    rebuilt,
)
from extract.store.lock import StoreLock


@pytest.mark.parametrize(
    ("kind", "builtin"),
    [(LayerNotFoundError, KeyError), (StoreNotFoundError, FileNotFoundError), (SampleIndexError, IndexError)],
)
def test_typed_errors_are_also_the_builtin_and_keep_their_message(kind, builtin):
    error = kind("layer 'x' matches no module; closest: y")
    assert isinstance(error, ExtractError) and isinstance(error, builtin)
    assert str(error) == "layer 'x' matches no module; closest: y"  # KeyError would have quoted it


def test_an_unknown_layer_is_a_key_error():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(KeyError, match="layer 'fc' matches no module; closest: ") as error:
        resolve_layers(model, ["fc"])
    assert isinstance(error.value, LayerNotFoundError)


def test_a_busy_store_and_a_damaged_one_have_their_own_types(tmp_path):
    out = tmp_path / "held.zarr"
    with StoreLock(out), pytest.raises(StoreBusyError, match=f"pid {os.getpid()}") as busy:
        StoreLock(out).__enter__()
    assert socket.gethostname() in str(busy.value) and not isinstance(busy.value, StoreDamagedError)
    out.mkdir()
    (out / "zarr.json").write_text(
        '{"zarr_format": 3, "node_type": "group", "attributes": {"format": "extract-features", "format_version": 7}}'
    )
    from extract import open_features

    with pytest.raises(StoreDamagedError, match="format_version 7"):
        open_features(out)


def test_a_reader_of_a_store_being_created_is_told_so_naming_the_job(tmp_path):
    """A store is built beside its path and renamed into place: while its job holds the lock, a reader
    finds no store (or only the ``.creating-`` scratch), and is told that a job is creating it, not that
    the path is no store. With no live holder it is what it was: no store."""
    from extract import FeatureDataset, open_features
    from extract.store.lock import lock_path

    out = tmp_path / "new.zarr"
    with StoreLock(out):
        for scratch in (False, True):
            if scratch:  # the skeleton being built beside the path
                (tmp_path / f".{out.name}.creating-{os.getpid()}" / "features").mkdir(parents=True)
            with pytest.raises(StoreBeingCreatedError) as error:
                open_features(out)
            message = str(error.value)
            assert f"is being created by a job (host {socket.gethostname()}, pid {os.getpid()}" in message
            assert str(lock_path(out)) in message and "wait for the job" in message and "\n" not in message
            assert isinstance(error.value, StoreNotFoundError) and isinstance(error.value, StoreBusyError)
        with pytest.raises(StoreBeingCreatedError):
            FeatureDataset(out, "layer")
    with pytest.raises(StoreNotFoundError, match="is not an extract store") as error:  # released: no job
        open_features(out)
    assert not isinstance(error.value, StoreBeingCreatedError)
    from extract.store.lock import process_namespace

    dead = {"host": socket.gethostname(), "pid": 999999999, "started": "then", **process_namespace()}
    lock_path(out).write_text(json.dumps(dead))  # provably of this namespace and boot, and its pid is gone
    with pytest.raises(StoreNotFoundError, match="is not an extract store") as error:  # its holder is gone
        open_features(out)
    assert not isinstance(error.value, StoreBeingCreatedError)


def test_the_type_survives_being_told_to_other_ranks():
    assert type(rebuilt(StoreBusyError, "held")) is StoreBusyError and str(rebuilt(StoreBusyError, "held")) == "held"
    assert type(rebuilt(LayerNotFoundError, "nope")) is LayerNotFoundError


def test_a_glob_that_would_match_across_dots_says_how_to_write_it():
    import torchvision

    with pytest.raises(KeyError) as error:
        resolve_layers(torchvision.models.resnet18(), ["layer*.conv1"])
    message = str(error.value)
    assert "'*' stays within one dotted segment" in message and "write layer*.*.conv1" in message
    assert "8 modules match it across segments" in message
    assert [r.name for r in resolve_layers(torchvision.models.resnet18(), ["layer*.*.conv1"])][:2] == [
        "layer1.0.conv1",
        "layer1.1.conv1",
    ]


def test_the_interrupt_line_counts_the_whole_job():
    import signal

    from extract.job.interrupt import Interrupted

    stopped = Interrupted(signal.SIGTERM, 0)
    stopped.chunks_written, stopped.num_chunks, stopped.this_run = 7, 12, 3  # as the store's owner counts them
    assert str(stopped) == (
        "interrupted by SIGTERM: 7 chunks written and marked done, 5 of 12 left (this run wrote 3); "
        "rerun the same command to resume"
    )
    one = Interrupted(signal.SIGINT, 1)
    assert str(one).startswith("interrupted by SIGINT: 1 chunk written and marked done;")


@pytest.mark.parametrize(
    ("module", "name", "builtin"),
    [
        ("extract.store.location", "LocationError", ValueError),
        ("extract.store.location", "ObjectStorageMissing", ImportError),
        ("extract.store.location", "ForkedAfterObjectStorageError", RuntimeError),
        ("extract.store.lock", "LockUnavailable", None),
        ("extract.store.writer", "WriterError", RuntimeError),
        ("extract.read.features", "PoolMismatchError", ValueError),
        ("extract.read.tokens", "ExcludeRuleError", ValueError),
        ("extract.analysis.samples", "UnusableLayerError", None),
        ("extract.analysis.export", "ExportError", ValueError),
        ("extract.capture.tokens", "TextShapeError", ValueError),
        ("extract.capture.sae", "SaeMissingError", ImportError),
        ("extract.capture.sae", "SaeNotFoundError", FileNotFoundError),
        ("extract.capture.sae", "SaeMismatchError", ValueError),
    ],
)
def test_every_error_lives_in_errors_and_keeps_its_old_import_path(module, name, builtin):
    import importlib

    import extract.errors

    kind = getattr(extract.errors, name)
    assert getattr(importlib.import_module(module), name) is kind  # ``except`` clauses of user code keep working
    assert issubclass(kind, ExtractError) and (builtin is None or issubclass(kind, builtin))


def test_pool_shape_error_keeps_its_messages():
    from extract.errors import PoolShapeError
    from extract.names.pooling import make_pool

    pool = make_pool("avg", "NCHW")
    with pytest.raises(PoolShapeError, match=r"--pool avg needs a \(B, C, H, W\) output but got shape \(2, 3\)") as e:
        pool(torch.zeros(2, 3))
    assert isinstance(e.value, ValueError)
    assert str(e.value.for_layer("fc")) == (
        "--pool avg does not fit layer 'fc': it needs a (B, C, H, W) output, the layer gives (B, 3); "
        "use --pool none for this layer"
    )


def test_a_writer_error_is_one_line_exit_status_1_saying_what_a_rerun_does(capsys):
    from extract.cli.base import command
    from extract.cli.extract import EXTRACTION_FAILURES
    from extract.errors import WriterError

    @command("extract", EXTRACTION_FAILURES)
    def main() -> int:
        raise WriterError("writing the store failed: OSError(28, 'No space left on device')")

    assert main() == 1
    assert capsys.readouterr().err == (
        "extract: error: writing the store failed: OSError(28, 'No space left on device'); "
        "chunks not fully written are not marked done, a rerun redoes them\n"
    )


# A library caller tells the four outcomes apart by type, each also the builtin one would catch: the request is
# bad, another job holds the store, the store holds a different job, the store is damaged (or unfinished).

def edit_attrs(out: Path, **values) -> None:
    meta = json.loads((out / "zarr.json").read_text())
    meta["attributes"].update(values)
    (out / "zarr.json").write_text(json.dumps(meta))


def _spec(out: Path, **options) -> "extract.JobSpec":
    options = {"layers": ["heads.conv"], "data": "synthetic:8", **options}
    return extract.JobSpec(model=f"{TINY}:dict_net", image_size=32, num_workers=0, out=str(out), **options)


def _run(spec: "extract.JobSpec") -> "extract.job.runner.Summary":
    return extract.run(spec, log=lambda _: None)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A complete store of a small job, never changed: the tests copy it to damage it."""
    out = tmp_path_factory.mktemp("typed") / "made.zarr"
    _run(_spec(out))
    return out


@pytest.mark.parametrize(
    ("kind", "builtins"),
    [
        (InvalidRequestError, (ValueError,)),
        (LayerNotFoundError, (InvalidRequestError, KeyError, ValueError)),
        (SampleIndexError, (InvalidRequestError, IndexError, ValueError)),
        (StoreBusyError, (BlockingIOError, OSError)),
        (StoreMismatchError, (FileExistsError, OSError)),
        (StoreDamagedError, (ValueError,)),
        (StoreBeingCreatedError, (StoreNotFoundError, StoreBusyError, FileNotFoundError, BlockingIOError)),
    ],
)
def test_each_outcome_a_caller_tells_apart_has_a_type_that_is_also_a_builtin(kind, builtins):
    error = kind("--out x.zarr: said in one line")
    assert isinstance(error, ExtractError) and all(isinstance(error, builtin) for builtin in builtins)
    assert str(error) == "--out x.zarr: said in one line" and error.exit_code == 2  # the command line's, unchanged
    assert type(rebuilt(kind, str(error))) is kind  # told to the other ranks as the same type


def test_the_four_outcomes_are_distinct():
    outcomes = [InvalidRequestError, StoreBusyError, StoreMismatchError, StoreDamagedError]
    for kind in outcomes:
        assert [issubclass(kind, other) for other in outcomes].count(True) == 1, kind


@pytest.mark.parametrize(
    "name", ["PoolShapeError", "PoolMismatchError", "TextShapeError", "ExcludeRuleError", "UnalignedStoresError",
             "SaeMismatchError", "ExportError", "LocationError"],
)  # fmt: skip
def test_the_request_errors_are_invalid_requests(name):
    import extract.errors

    assert issubclass(getattr(extract.errors, name), InvalidRequestError)


def test_a_pool_error_told_to_another_rank_stays_an_invalid_request():
    from extract.errors import PoolShapeError

    told = rebuilt(PoolShapeError, "--pool avg needs a (B, C, H, W) output")  # its constructor takes its parts
    assert type(told) is InvalidRequestError and str(told) == "--pool avg needs a (B, C, H, W) output"
    assert isinstance(PoolShapeError("avg", (2, 3), "(B, C, H, W)", "none").for_layer("fc"), InvalidRequestError)


def test_a_store_another_live_job_holds_is_busy_for_a_run_and_a_reader(made, tmp_path):
    from extract.store.lock import StoreLock

    with StoreLock(made):  # this process, alive: another job for the run below
        with pytest.raises(StoreBusyError, match=f"--out {made} is being written by another job") as error:
            _run(_spec(made))  # complete, but held: busy, not read as a read-only "already complete" store
        assert isinstance(error.value, BlockingIOError)
        unfinished = tmp_path / "unfinished.zarr"
        shutil.copytree(made, unfinished)
        edit_attrs(unfinished, status="running")
        with StoreLock(unfinished), pytest.raises(BlockingIOError, match="is being written by a job") as error:
            extract.open_features(unfinished)
        assert isinstance(error.value, StoreBusyError)


def test_a_store_holding_a_different_job_is_a_mismatch(made):
    with pytest.raises(StoreMismatchError, match=r"holds a different job \(differs in: layers\)") as error:
        _run(_spec(made, layers=["heads.pool"]))
    assert isinstance(error.value, FileExistsError)
    with pytest.raises(FileExistsError, match="was made with --batch-size 64, this run has 2") as error:
        _run(_spec(made, batch_size=2))  # the same job batched otherwise would round otherwise
    assert isinstance(error.value, StoreMismatchError)
    assert _run(_spec(made)).chunks_written == 0  # the same job: complete, nothing refused


def test_a_damaged_store_is_damaged_for_a_reader_and_a_run(made, tmp_path):
    torn = tmp_path / "torn.zarr"
    shutil.copytree(made, torn)
    (torn / "zarr.json").write_text('{"zarr_format": 3, "node_type": "gr')
    with pytest.raises(StoreDamagedError) as error:
        extract.open_features(torn)
    assert isinstance(error.value, ValueError)
    with pytest.raises(ValueError, match=r"the store's root metadata .* are damaged") as error:
        _run(_spec(torn))
    assert isinstance(error.value, StoreDamagedError)
    unfinished = tmp_path / "unfinished.zarr"  # killed, and no job holds it: finished by a rerun
    shutil.copytree(made, unfinished)
    edit_attrs(unfinished, status="running")
    with pytest.raises(StoreDamagedError, match="is not complete .* rerun the same extract command"):
        extract.open_features(unfinished)


def test_a_bad_request_is_an_invalid_request(made, tmp_path):
    with pytest.raises(InvalidRequestError, match="layer 'fc1' matches no module") as error:
        _run(_spec(tmp_path / "new.zarr", layers=["fc1"]))
    assert isinstance(error.value, KeyError) and isinstance(error.value, LayerNotFoundError)
    with pytest.raises(ValueError, match="--batch-size must be at least 1, got 0") as error:
        _run(_spec(tmp_path / "new.zarr", batch_size=0))
    assert isinstance(error.value, InvalidRequestError)
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidRequestError, match="is a regular file, not a store"):
        _run(_spec(tmp_path / "file"))
    features = extract.open_features(made)
    with pytest.raises(InvalidRequestError) as error:
        features.load("fc1")
    assert isinstance(error.value, KeyError)
    with pytest.raises(InvalidRequestError, match="is an image store"):
        features.text  # noqa: B018 - the property refuses
    with pytest.raises(InvalidRequestError, match="numpy has no bfloat16"):
        features.load("heads.conv", dtype="bfloat16")


def test_the_life_cycle_actions_are_the_words_they_were():
    from extract.names import Action

    assert [action.value for action in Action] == ["create", "resume", "complete"]
    assert Action("resume") is Action.RESUME and Action.COMPLETE == "complete" and f"{Action.CREATE}" == "create"
    assert json.dumps({"action": Action.CREATE}) == '{"action": "create"}'


def test_the_stray_types_live_in_errors_and_keep_their_import_paths():
    import extract.errors
    from extract.capture.hooks import StopForward
    from extract.job.interrupt import PeerStopped

    assert extract.StopForward is StopForward is extract.errors.StopForward
    assert not issubclass(StopForward, ExtractError)  # a signal that ends a forward, not a failure
    assert PeerStopped is extract.errors.PeerStopped and issubclass(PeerStopped, extract.errors.Interrupted)
    stopped = PeerStopped(RuntimeError("gloo: connection reset\nmore"))
    assert stopped.exit_code == 1 and str(stopped).startswith("another process of the job stopped (gloo: connection")
