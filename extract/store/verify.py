"""Check a store: ``python -m extract.verify STORE [--repair]``.

Every chunk marked done must have, in every per-sample array (features, labels, valid, keys) and in
its layers' statistics (``stats/<layer>``, one row per chunk), an object that is present, decodes,
matches its crc32c checksum, and is the object written for that chunk: its checksum equals the one
recorded in ``digests`` when the chunk was marked done, so a swapped, foreign or stale object is named.
The arrays written whole at creation (a token store's offsets, labels, valid, keys; a document store's
offsets) must be the objects written then, by the digests recorded then. A store whose status is "complete" must have every chunk
of its plan done. The identity attributes must match the digests recorded at creation, the
fingerprint its identity and ``layers`` the arrays under ``features/``; every array's codecs must end
with the checksum. ``--repair`` restores what can be proven (the checksum codec; an attribute whose
candidate value reproduces its recorded digest), then clears ``done`` for the damaged chunks (and the
"complete" status), so that rerunning the job's command recomputes exactly those. One summary line;
exit status 0 when clean, 1 when damaged, 2 for bad input.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec

from ..names import Kind
from . import latents
from .arrays import members
from .chunks import Plan
from .schema import ADDED_LATER, fingerprint, identity_digests
from .store import FeatureStore

UNPLACED = "not the object written for this chunk (swapped, copied or stale)"


@dataclass
class Report:
    path: Path | str  # a URL for a store on object storage
    num_chunks: int
    done: int  # chunks marked done
    complete: bool  # the store's status says so
    damaged: dict[int, list[str]] = field(default_factory=dict)  # chunk -> "array: problem"
    problems: list[str] = field(default_factory=list)  # the store's metadata
    placed: bool = True  # False: a store from before digests, whose objects' places cannot be checked
    restored: list[str] = field(default_factory=list)  # what --repair put back
    kept: list[str] = field(default_factory=list)  # problems --repair could not undo
    documents: list[str] = field(default_factory=list)  # arrays written at creation, not as written then

    @property
    def clean(self) -> bool:
        return not self.damaged and not self.problems and not self.documents

    def line(self, repaired: bool) -> str:
        head = f"extract.verify: {self.path}:"
        if self.clean:
            restored = f" restored {', '.join(self.restored)};" if self.restored else ""
            return f"{head}{restored} {self._clean()}"
        chunks = [f"chunk {k}: {', '.join(problems)}" for k, problems in sorted(self.damaged.items())[:3]]
        more = [f"and {len(self.damaged) - 3} more"] if len(self.damaged) > 3 else []
        what = [f"{len(self.damaged)} of {self.num_chunks} chunks damaged"] if self.damaged else []
        what = (["its metadata damaged"] if self.problems else []) + what
        if self.documents:
            what = [f"{', '.join(self.documents)} not as written at creation (edited, torn or lost)", *what]
        details = "; ".join(self.problems + chunks + more)
        return f"{head} {' and '.join(what)}{f' ({details})' if details else ''}; {self._then(repaired)}"

    def _clean(self) -> str:
        checked = "match their checksums" + (
            " and the digests recorded when they were written"
            if self.placed
            else " (format 2 recorded no digests: whether each object is in its place cannot be checked)"
        )
        if self.complete:
            return f"all {self.done} done chunks are present and {checked}"
        return (
            f"{self.done} of {self.num_chunks} chunks are done, present and {checked}; the job is not finished: "
            f"rerun its command to compute the other {self.num_chunks - self.done}"
        )

    def _then(self, repaired: bool) -> str:
        if not repaired:
            return "run with --repair, then rerun the job's command"
        then = [f"restored {', '.join(self.restored)}"] if self.restored else []
        if self.damaged:
            then.append("cleared their done flags: rerun the job's command to recompute them")
        if self.documents:
            then.append(f"rerun the job's command to write {', '.join(self.documents)} again from the data")
        if self.kept:
            then.append(f"cannot repair {', '.join(self.kept)}: rerun the job's command with --overwrite")
        return "; ".join(then) or "nothing left to repair: rerun the job's command"


def verify(store: FeatureStore) -> Report:
    """Examine the store's metadata, every done chunk of every per-sample array, and every chunk of
    the plan against the status. A ``done`` object that itself fails its checksum counts as damage."""
    plan, attrs = store.plan, store.attrs
    done = store.done_flags()
    report = Report(store.path, plan.num_chunks, int(done.sum()), attrs.get("status") == "complete")
    report.problems = _attribute_problems(store, attrs) + _codec_problems(store, attrs)
    report.documents = store.creation.damage()
    report.problems += _count_problems(store, attrs, report.documents) + _status_problems(attrs, done)
    stored_done = store.integrity.stored_chunks("done", range(plan.num_chunks))
    for k in sorted(stored_done - set(np.flatnonzero(done).tolist())):
        report.damaged.setdefault(k, []).append("done does not decode")
    chunks = np.flatnonzero(done).tolist()
    for k, problems in _chunk_problems(store, plan, chunks).items():
        report.damaged.setdefault(k, []).extend(problems)
    rows = store.integrity.digests_array()
    report.placed = rows is not None
    if rows is not None:
        for k, problems in _placement_problems(store, rows, chunks, report.damaged).items():
            report.damaged.setdefault(k, []).extend(problems)
    if report.complete:  # a complete store has every chunk of its plan done
        recorded = store.integrity.stored_chunks(rows.path, range(plan.num_chunks)) if rows is not None else set()
        for k in np.flatnonzero(~done).tolist():
            if k not in stored_done:
                lost = " (its done mark was lost: its digests were recorded)" if k in recorded else ""
                report.damaged.setdefault(k, []).append(f"not done in a complete store{lost}")
    return report


def _problem(array: zarr.Array, rows: slice | int, chunk: int, stored: set[int]) -> str | None:
    if chunk not in stored:
        return "missing"
    try:
        array[rows]
    except Exception as e:  # noqa: BLE001 - any codec error means the object is damaged
        return f"does not decode ({type(e).__name__})"
    return None


def _chunk_problems(store: FeatureStore, plan: Plan, chunks: list[int]) -> dict[int, list[str]]:
    """Per done chunk, each array whose object is absent or fails to decode (checksum included): the
    per-sample arrays' rows of the chunk, and its row of each per-chunk array (``stats/<layer>``)."""
    arrays = [(name, array, False) for name, array in store.sample_arrays()]
    arrays += [(name, array, True) for name, array in store.chunk_arrays()]
    stored = {name: store.integrity.stored_chunks(name, chunks) for name, _, _ in arrays}  # one listing per array
    work = [
        (name, array, k if per_chunk else slice(*plan.bounds(k)), k)
        for name, array, per_chunk in arrays
        for k in chunks
    ]
    found: dict[int, list[str]] = {}
    threads = min(8, os.cpu_count() or 1)  # on disk decoding is the cost; on object storage, latency
    if store.location.remote:
        threads = max(threads, int(zarr.config.get("async.concurrency") or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="extract-verify") as pool:
        problems = pool.map(lambda item: _problem(item[1], item[2], item[3], stored[item[0]]), work)
        for (name, _, _, k), problem in zip(work, problems, strict=True):
            if problem is not None:
                found.setdefault(k, []).append(f"{name} {problem}")
    return found


def _placement_problems(
    store: FeatureStore, rows: zarr.Array, chunks: list[int], damaged: dict[int, list[str]]
) -> dict[int, list[str]]:
    """Per done chunk, each array whose object's checksum is not the one recorded for this chunk.
    Objects already found missing or undecodable are not named twice."""
    present = {*dict(store.sample_arrays()), *dict(store.chunk_arrays())}
    names = [name for name in rows.attrs.get("arrays", []) if name in present]
    columns = [list(rows.attrs["arrays"]).index(name) for name in names]
    actual = store.integrity.object_digests(chunks, names)
    found: dict[int, list[str]] = {}
    for k in chunks:
        try:
            recorded = rows[k]
        except Exception:  # noqa: BLE001 - a digests row failing its own checksum
            found[k] = ["digests does not decode"]
            continue
        if not recorded.any():
            found[k] = ["digests missing (the chunk's objects cannot be checked)"]
            continue
        for name, column, digest in zip(names, columns, actual[k], strict=True):
            if digest is not None and digest != recorded[column] and not _named(damaged.get(k, []), name):
                found.setdefault(k, []).append(f"{name} is {UNPLACED}")
    return found


def _array_names(store: FeatureStore) -> list[str]:
    return [name for name, _ in members(store.group, store.path)]


def _named(problems: list[str], name: str) -> bool:
    return any(problem.startswith(f"{name} ") for problem in problems)


def _attribute_problems(store: FeatureStore, attrs: dict[str, Any]) -> list[str]:
    """The identity attributes against their digests, the fingerprint against the identity, and
    ``layers`` against the arrays under ``features/``; each problem names its attribute."""
    edited: dict[str, str] = {}
    recorded = attrs.get("identity_sha256")
    if recorded is None and attrs.get("format_version", 0) >= 3:
        edited["identity_sha256"] = "is missing (the identity attributes cannot be checked)"
    elif recorded is not None:
        now = identity_digests(attrs, _array_names(store))
        checked = [name for name in now if name in recorded or name not in ADDED_LATER]
        for name in (name for name in checked if now[name] != recorded.get(name)):
            edited[name] = "differs from the digest recorded at the store's creation (it was edited)"
    if "identity" in attrs and attrs.get("fingerprint") != fingerprint(attrs["identity"]):
        edited["fingerprint"] = "does not match the identity (the attribute was edited)"
    layers = sorted(name.removeprefix("features/") for name, _ in store.sample_arrays() if name.startswith("features/"))
    if sorted(attrs.get("layers") or []) != layers:
        edited["layers"] = f"does not list the arrays under features/ ({', '.join(layers)}): the attribute was edited"
    if "arrays" in edited:
        edited["arrays"] = "(the store's list of arrays) differs from the one at its creation"
    return [f"{name} {detail}" for name, detail in edited.items()] + latents.metadata_problems(store, attrs)


def _counts(store: FeatureStore, attrs: dict[str, Any], damaged: list[str]) -> dict[str, int]:
    """A text store's ``num_documents`` and ``num_tokens`` as its ``offsets`` gives them (a packed store's
    documents are its contexts), where the offsets are the ones written at creation; empty otherwise."""
    if not Kind.of(attrs).text or not store.has("offsets") or "offsets" in damaged:
        return {}
    offsets = np.asarray(store.array("offsets")[:])
    return {"num_documents": len(offsets) - 1, "num_tokens": int(offsets[-1]) if len(offsets) else 0}


def _count_problems(store: FeatureStore, attrs: dict[str, Any], damaged: list[str]) -> list[str]:
    """The count attributes of a text store against its offsets: no digest covers them, and the read
    API trusts the offsets, so an edited count would only mislead whoever reads the attributes."""
    return [
        f"{name} is {attrs.get(name)}, but offsets holds {value}: the attribute was edited"
        for name, value in _counts(store, attrs, damaged).items()
        if name in attrs and attrs[name] != value
    ]


def _status_problems(attrs: dict[str, Any], done: np.ndarray) -> list[str]:
    """A status other than complete on a store whose every chunk is done: the attribute disagrees with
    the done flags (edited, or the job stopped between its last chunk and marking the store complete)."""
    status = attrs.get("status")
    if status == "complete" or len(done) == 0 or not done.all():
        return []
    return [
        f"status is '{status}', but every chunk is done: the status attribute disagrees with the done flags "
        "(--repair sets it to complete)"
    ]


def _codec_problems(store: FeatureStore, attrs: dict[str, Any]) -> list[str]:
    """Arrays whose codec chain lost its checksum: their objects would be read, and rewritten, unchecked."""
    if attrs.get("format_version", 0) < 2:  # format 1 wrote no checksums
        return []
    return [f"{name} lacks its crc32c checksum in its metadata" for name in _unchecked(store)]


def _unchecked(store: FeatureStore) -> list[str]:
    arrays = [*dict(store.sample_arrays()), *dict(store.chunk_arrays()), "done"]
    arrays += [] if store.integrity.digests_array() is None else ["digests"]
    return [name for name in arrays if not isinstance((store.array(name).compressors or (None,))[-1], Crc32cCodec)]


def repair(store: FeatureStore, report: Report) -> Report:
    """Restore what can be proven right, check again, and clear ``done`` for the chunks still damaged
    (and a "complete" status); returns the report of that second check, naming what was restored."""
    restored = []
    if any("crc32c" in problem for problem in report.problems):
        for name in _unchecked(store):
            store.integrity.restore_checksum(name)
            restored.append(f"crc32c in {name}'s metadata")
    restored += _restore_attributes(store) + latents.restore(store)
    counts = {
        name: value
        for name, value in _counts(store, store.attrs, report.documents).items()
        if name in store.attrs and store.attrs[name] != value
    }
    if counts:  # the offsets were proven the ones written at creation: they give the counts
        store.update_attrs(**counts)
        restored += [f"the attribute {name}" for name in counts]
    again = verify(FeatureStore.open(store.path, mode="r+")) if restored else report
    if any(problem.startswith("status ") for problem in again.problems) and not again.damaged and not again.documents:
        store.update_attrs(status="complete")  # every chunk is done and checked: the store is complete
        again = verify(FeatureStore.open(store.path, mode="r+"))
        restored.append("the attribute status (complete: every chunk is done)")
    store.integrity.clear_done(sorted(again.damaged))
    if again.documents and store.attrs.get("status") == "complete":  # the rerun writes them again
        store.update_attrs(status="running")
    again.restored, again.kept = restored, [problem.partition(" ")[0] for problem in again.problems]
    return again


def _restore_attributes(store: FeatureStore) -> list[str]:
    """Put back an edited ``fingerprint`` or ``layers`` where a candidate value (the identity's
    fingerprint; the layers in their recorded order) reproduces the digest recorded at creation."""
    attrs, restored = store.attrs, []
    recorded = attrs.get("identity_sha256") or {}
    candidates = {
        "fingerprint": [fingerprint(attrs["identity"])] if "identity" in attrs else [],
        "layers": [list(attrs.get("feature_shapes") or {}), list((attrs.get("identity") or {}).get("layers") or [])],
    }
    arrays = _array_names(store)
    for name, values in candidates.items():
        for value in values:
            if value != attrs.get(name) and identity_digests({**attrs, name: value}, arrays)[name] == recorded.get(
                name
            ):
                store.update_attrs(**{name: value})
                restored.append(f"the attribute {name}")
                break
    return restored
