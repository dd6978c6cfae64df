"""Preemption: SIGTERM/SIGINT end the run cleanly at any moment (a launcher's death is one: ``launcher``).

Handlers are installed before the slow start-up (model, data, store): a signal then stops the job at
once. Inside the loop a signal only asks it to stop after the current batch, so that what is computed
is written. DataLoader workers ignore both signals while the loop runs (they share the rank's process
group, which launchers and SLURM signal as a whole): their parent stops them, instead of their deaths
tripping torch's SIGCHLD handler into a traceback inside the forward. After the loop, their parent's
SIGTERM ends them, so that a worker that does not exit when asked cannot hang the rank's exit.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import threading
import time
from types import FrameType

from ..errors import Interrupted, PeerStopped  # noqa: F401 - PeerStopped: its old import path
from .launcher import tell_launcher

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """While active, SIGTERM/SIGINT raise ``Interrupted`` at once until ``defer()``; after it the first
    only sets ``signum`` (the loop stops at the next batch) and a second interrupts at once, except
    a SIGTERM within ``ECHO_SECONDS`` of the first request: SLURM signals every process of a step and
    the launcher forwards the signal to its ranks (and closes them with SIGTERM after any signal), so
    one preemption arrives more than once. Once ``Interrupted`` is raised, later signals are ignored:
    they would cut short the closing of the run's record and replace the job's count with none.
    The first request also goes to the launcher (``tell_launcher``), so that a signal to one rank
    stops the whole job, unless the launcher passes a signal on first: a Ctrl-C or ``kill`` of the
    process group reaches the launcher too, and a second signal arriving at torch elastic's agent
    while it handles the first makes it print a traceback. Handlers are restored on exit; inactive
    off the main thread."""

    ECHO_SECONDS = 2.0
    TELL_AFTER = 0.5  # seconds the launcher has to pass a group's signal on before a rank tells it

    def __init__(self) -> None:
        self.signum: int | None = None
        self._deferring = False
        self._first_at: float | None = None
        self._stopping = False
        self._previous: dict[int, object] = {}
        self._tell: threading.Timer | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._stopping:
            return
        if self._first_at is None:
            self._first_at = time.monotonic()
            self._tell = threading.Timer(self.TELL_AFTER, tell_launcher, args=(signum,))
            self._tell.daemon = True
            self._tell.start()
        elif self._tell is not None:  # the launcher passed it on (or another came): it knows
            self._tell.cancel()
        if self._deferring and self.signum is None:
            self.signum = signum
            return
        echo = signum == signal.SIGTERM and time.monotonic() - self._first_at < self.ECHO_SECONDS
        if self._deferring and echo:
            return
        self._stopping = True
        raise Interrupted(self.signum or signum, 0)

    def defer(self) -> None:
        """From now on a first signal only sets ``signum``: the loop checks it between batches, and the
        writing and marking that follow are not cut short."""
        self._deferring = True

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in HANDLED}
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _: object) -> None:
        # After an interrupt the process is on its way out: launchers signal again (torch elastic's agent
        # closes its workers twice), and the default action would kill it before its one-line message
        # and exit status. So further signals are ignored; otherwise the previous handlers come back.
        stopping = self.signum is not None or isinstance(error, Interrupted | KeyboardInterrupt)
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if stopping else handler)  # type: ignore[arg-type]


class LoaderWorkerSignals:
    """A DataLoader ``worker_init_fn`` and the switch that lets its workers go.

    While the rank's loop runs, its workers ignore SIGTERM/SIGINT and leave them to their parent. Once
    the loop is over (``release()``, on every way out of it), a SIGTERM ends a worker at once, with exit
    status 0 so that torch's SIGCHLD check sees no failure: torch's shutdown and ``multiprocessing``'s
    exit both stop a worker that does not answer with ``terminate()``, and one that ignored it would be
    joined forever. The flag is shared memory that the handler reads without taking a lock."""

    def __init__(self) -> None:
        self._released = multiprocessing.RawValue(ctypes.c_bool, False)

    def __call__(self, _worker_id: int = 0) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._released.value:
            os._exit(0)

    def release(self) -> None:
        """The loop is over: from now on a SIGTERM ends the workers."""
        self._released.value = True
