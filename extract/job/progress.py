"""The main process's progress bar over the whole job, fed by the store rather than by the loop.

Ranks mark chunks done in the store; counting those markers on a thread shows every rank's
progress on rank 0 without a collective (which would make the ranks wait for each other).
"""

from __future__ import annotations

import threading
import time

from tqdm import tqdm

from ..store.chunks import Plan
from ..store.store import FeatureStore


class JobProgress:
    def __init__(
        self, store: FeatureStore, plan: Plan, pending: list[int], enabled: bool, interval: float = 0.5
    ) -> None:
        self.store, self.plan, self.interval = store, plan, interval
        self.pending = set(pending)
        self.bar = tqdm(total=plan.samples_in(pending), unit="img", desc="extract", disable=not enabled, smoothing=0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="extract-progress", daemon=True)
        if enabled:
            self._thread.start()

    def refresh(self) -> None:
        """Count the pending chunks whose ``done`` object exists: one listing of the store's ``done`` keys
        (reading the flags would decode every one, and fail on a torn one)."""
        finished = self.store.stored_chunks("done", self.pending)
        self.bar.update(self.plan.samples_in(sorted(finished)) - self.bar.n)

    def _poll(self) -> None:
        """Refresh every ``interval`` seconds, or less often where one listing takes longer than a tenth of
        that (thousands of chunks on disk, or object storage): the bar never costs more than a tenth of a core."""
        wait = self.interval
        while not self._stop.wait(wait):
            started = time.perf_counter()
            self.refresh()
            wait = max(self.interval, 10 * (time.perf_counter() - started))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            self.refresh()
        self.bar.close()
