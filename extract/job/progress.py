"""The main process's progress bar over the whole job: its own batches as they are forwarded, and the
other ranks' chunks as they are marked done.

Rank 0 counts its own samples batch by batch, so the bar moves every batch; the other ranks mark
chunks done in the store, and counting those markers on a thread shows their progress on rank 0
without a collective (which would make the ranks wait for each other).
"""

from __future__ import annotations

import threading
import time

from tqdm import tqdm

from ..store.chunks import Plan
from ..store.store import FeatureStore


class JobProgress:
    """``pending``: the chunks this run writes; ``own``: those this process writes (its batches are
    counted by ``advance``, the others' chunks when their ``done`` marker appears)."""

    def __init__(
        self,
        store: FeatureStore,
        plan: Plan,
        pending: list[int],
        enabled: bool,
        interval: float = 0.5,
        own: list[int] | None = None,
        unit: str = "img",
    ) -> None:
        self.store, self.plan, self.interval = store, plan, interval
        self.pending = set(pending)
        self.others = self.pending - set(own or [])
        self.bar = tqdm(total=plan.samples_in(pending), unit=unit, desc="extract", disable=not enabled, smoothing=0.1)
        self._forwarded = 0  # this process's samples
        self._finished = 0  # the other processes' samples, in chunks marked done
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="extract-progress", daemon=True)
        if enabled:
            self._thread.start()

    def advance(self, samples: int) -> None:
        """This process forwarded ``samples`` more."""
        with self._lock:
            self._forwarded += samples
            self._show()

    def refresh(self) -> None:
        """Count the other processes' chunks whose ``done`` object exists: one listing of the store's
        ``done`` keys (reading the flags would decode every one, and fail on a torn one)."""
        if not self.others:
            return
        finished = self.plan.samples_in(sorted(self.store.integrity.stored_chunks("done", self.others)))
        with self._lock:
            self._finished = finished
            self._show()

    def _show(self) -> None:
        self.bar.update(min(self.bar.total, self._forwarded + self._finished) - self.bar.n)

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
