"""Check a store's chunks: ``python -m extract.verify STORE [--repair]``.

Every chunk marked done must have, in every per-sample array (features, labels, valid), an object that
is present, decodes, and matches its crc32c checksum. ``--repair`` clears ``done`` for the damaged
chunks (and the store's "complete" status), so that rerunning the job's command recomputes exactly
those. One summary line; exit status 0 when clean, 1 when damaged, 2 for bad input.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zarr

from .chunks import Plan
from .store import FeatureStore


@dataclass
class Report:
    path: Path
    checked: int  # done chunks examined
    damaged: dict[int, list[str]] = field(default_factory=dict)  # chunk -> "array: problem"

    def line(self, repaired: bool) -> str:
        if not self.damaged:
            return f"extract.verify: {self.path}: all {self.checked} done chunks are present and match their checksums"
        shown = "; ".join(f"chunk {k}: {', '.join(problems)}" for k, problems in sorted(self.damaged.items())[:3])
        more = f"; and {len(self.damaged) - 3} more" if len(self.damaged) > 3 else ""
        then = (
            "cleared their done flags: rerun the job's command to recompute them"
            if repaired
            else "run with --repair, then rerun the job's command"
        )
        return f"extract.verify: {self.path}: {len(self.damaged)} of {self.checked} done chunks damaged ({shown}{more}); {then}"


def _problem(array: zarr.Array, plan: Plan, chunk: int, stored: set[int]) -> str | None:
    if chunk not in stored:
        return "missing"
    try:
        array[slice(*plan.bounds(chunk))]
    except Exception as e:  # noqa: BLE001 - any codec error means the object is damaged
        return f"does not decode ({type(e).__name__})"
    return None


def verify(store: FeatureStore) -> Report:
    """Examine every done chunk of every per-sample array; a ``done`` object that itself fails its
    checksum counts as damaged too (its chunk will be recomputed)."""
    plan = store.plan
    done = store.done_flags()
    stored_done = store.stored_chunks("done", range(plan.num_chunks))
    report = Report(store.path, len(stored_done))
    for k in sorted(stored_done - set(np.flatnonzero(done).tolist())):
        report.damaged.setdefault(k, []).append("done: does not decode")
    chunks = np.flatnonzero(done).tolist()
    arrays = list(store.sample_arrays())
    stored = {name: store.stored_chunks(name, chunks) for name, _ in arrays}  # one listing per array
    work = [(name, array, k) for name, array in arrays for k in chunks]
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="extract-verify") as pool:
        problems = pool.map(lambda item: _problem(item[1], plan, item[2], stored[item[0]]), work)
        for (name, _, k), problem in zip(work, problems, strict=True):
            if problem is not None:
                report.damaged.setdefault(k, []).append(f"{name} {problem}")
    return report


def repair(store: FeatureStore, report: Report) -> None:
    store.clear_done(sorted(report.damaged))
