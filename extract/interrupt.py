"""Preemption: SIGTERM/SIGINT end the run between batches, after what is computed is written."""

from __future__ import annotations

import signal
import threading
from types import FrameType

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Interrupted(Exception):
    """The run stopped on a signal; finished chunks are marked done and a rerun resumes."""

    def __init__(self, signum: int, chunks_written: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(
            f"interrupted by {signal.Signals(signum).name}: {chunks_written} chunks written and marked done; "
            "rerun the same command to resume"
        )


class StopRequests:
    """While active, the first SIGTERM/SIGINT only sets ``signum`` (the loop stops at the next batch);
    a second one interrupts at once. Handlers are restored on exit; inactive off the main thread."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in HANDLED}
        return self

    def __exit__(self, *_: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
