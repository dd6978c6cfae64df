"""The main process's progress bar over the whole job, fed by the store rather than by the loop.

Ranks mark chunks done in the store; counting those markers on a thread shows every rank's
progress on rank 0 without a collective (which would make the ranks wait for each other).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from tqdm import tqdm

from .plan import Plan


def done_chunks(store_path: Path) -> list[int]:
    """Chunks whose ``done`` marker exists: zarr v3 stores ``done[k]`` as the object ``done/c/k``."""
    try:
        return [int(entry.name) for entry in os.scandir(store_path / "done" / "c") if entry.name.isdigit()]
    except FileNotFoundError:
        return []


class JobProgress:
    def __init__(self, store_path: Path, plan: Plan, pending: list[int], enabled: bool, interval: float = 0.5) -> None:
        self.store_path, self.plan, self.interval = store_path, plan, interval
        self.pending = set(pending)
        self.bar = tqdm(total=plan.samples_in(pending), unit="img", desc="extract", disable=not enabled, smoothing=0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="extract-progress", daemon=True)
        if enabled:
            self._thread.start()

    def refresh(self) -> None:
        finished = self.pending.intersection(done_chunks(self.store_path))
        self.bar.update(self.plan.samples_in(sorted(finished)) - self.bar.n)

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            self.refresh()
        self.bar.close()
