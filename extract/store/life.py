"""The store's life cycle, owned in one place (DESIGN.md, "The store's life cycle belongs to the store"):

    claim --out (atomic lock, before anything is prepared or wiped)
      → create atomically, or reopen and decide: resume | complete | refuse
      → record the lock's token as the store's writer
      → write chunks (the runner's loop) → verify cheaply → mark complete → release

Rank 0 holds the lock and takes every decision about the store; the other ranks are told the outcome
(an action, or the error to stop with), so all ranks act alike although only one looked. The run's
record in the store's ``runs`` is closed here too, whatever ends the run, except when the lock was
lost: then the store is another job's, and nothing of it is touched.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import (
    ExtractError,
    Interrupted,
    LockLostError,
    LockUnavailable,
    StoreBusyError,
    StoreDamagedError,
    StoreMismatchError,
    rebuilt,
)
from ..names import Action
from . import latents
from .fence import lost_lock
from .location import Location, from_object_storage, locate, storage_error
from .locking import Lock, lock_for, lock_name
from .paths import DAMAGED, check_out_path, check_out_url, check_writable, real_path, sweep_scratch
from .schema import fingerprint as digest_of
from .store import FeatureStore

if TYPE_CHECKING:
    from ..processes import Processes

Log = Callable[[str], None]
T = TypeVar("T")


# Identity fields that say how the same job is computed, not what it is (flag, default, why the bits differ): a
# store mixing two values of one would hold rows that differ in their last bits from an uninterrupted run.
COMPUTATION = {
    "tensor_parallel": ("--tensor-parallel", 1, "a sum split over another number of ranks rounds differently"),
    "batch_size": ("--batch-size", None, "a forward over another batch rounds differently"),
    "tokens_per_batch": ("--tokens-per-batch", None, "a forward over another batch rounds differently"),
    "channels_last": ("--channels-last", False, "another memory layout runs other kernels, which round differently"),
}


def _as_flags(values: Mapping[str, Any], keys: list[str], on: str, off: str, named: bool = True) -> str:
    """The options ``keys`` as flags: ``{on}--batch-size 4`` (or ``4`` when not ``named``), ``{on}--channels-last``
    or ``{off}--channels-last``, joined by "and"."""
    said = []
    for key in keys:
        flag, default, _ = COMPUTATION[key]
        value = values.get(key, default)
        if isinstance(value, bool):
            said.append(f"{on if value else off}{flag}")
        else:
            said.append(f"{on}{flag} {value}" if named else f"{value}")
    return " and ".join(said)


def _computed_otherwise(out: Path | str, differs: list[str], made: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """The one line refusing to resume a store with another batching (or mesh): what it was made with, the fix."""
    why = "; ".join(dict.fromkeys(COMPUTATION[key][2] for key in differs))
    return (
        f"--out {out} was made with {_as_flags(made, differs, '', 'no ')}, this run has "
        f"{_as_flags(now, differs, '', 'no ', named=False)}: {why}, so the two would mix in one store; resume "
        f"{_as_flags(made, differs, 'with ', 'without ')}, or pass --overwrite to start afresh"
    )


class StoreLife:
    """Use as ``with StoreLife(out, processes, log) as life:``; the lock is held for the whole block.
    ``life.location`` is the store's real place (``out`` with its links resolved): create and open it
    there; ``life.out`` names it in messages. ``out`` may be a URL on object storage (``s3://...``):
    then the lock is an object beside the store (``store/object_lock.py``) and creation writes the
    root metadata last (``store/remote.py``)."""

    def __init__(self, out: str | os.PathLike[str] | Location, processes: Processes, log: Log) -> None:
        given = locate(out)
        self.remote = given.remote
        self.given: Path | str = given.place
        self.processes, self.log = processes, log
        self.location = given if given.path is None else Location(path=real_path(given.path))
        self.out: Path | str = self.location.place
        self.main = processes.is_main_process
        self.lock: Lock | None = None
        self.read_only = False  # the lock could not be created: only "already complete" is possible
        self.existing: dict[str, Any] | None = None
        self.store: FeatureStore | None = None
        self._run_started: float | None = None
        self._done_before = 0

    def _on_main(self, step: Callable[[], T]) -> T:
        """Run ``step`` on rank 0 and give its result, or its ``ExtractError``, to every rank."""
        outcome: tuple[T | None, tuple[type[ExtractError], str] | None] = (None, None)
        failure: ExtractError | None = None
        if self.main:
            try:
                outcome = (step(), None)
            except ExtractError as e:
                failure = self._named(e)
                outcome = (None, (type(failure), str(failure)))
            except Exception as e:
                if not from_object_storage(e):
                    raise
                failure = storage_error(f"--out {self.out}", e)
                outcome = (None, (type(failure), str(failure)))
        outcome = self.processes.broadcast(outcome)  # the type travels too: every rank raises what rank 0 raised
        value, error = outcome
        if error is not None:
            raise failure or rebuilt(*error)
        return value  # type: ignore[return-value]

    def _named(self, error: ExtractError) -> ExtractError:
        """``error`` in the user's words where ``--out`` is a link: the path given, and the real one."""
        if self.given == self.out or self.remote:
            return error
        assert isinstance(self.out, Path)
        locked = f"; the lock is {lock_name(self.out)}" if isinstance(error, StoreBusyError) else ""
        told = str(error).replace(f"--out {self.out}", f"--out {self.given} (resolves to {self.out}{locked})", 1)
        return rebuilt(type(error), told)

    # claim -----------------------------------------------------------------------------------------

    def __enter__(self) -> StoreLife:
        try:
            self.existing = self._on_main(self._claim)
        except BaseException:
            self._release()
            raise
        return self

    def _claim(self) -> dict[str, Any] | None:
        if self.location.url is not None:  # object storage: a conditional create makes the lock
            check_out_url(self.location.url)  # a prefix of foreign objects: refused before the lock is made
            self.lock = lock_for(self.location).__enter__()
            return check_out_url(self.location.url)  # read again, now that nobody else can change it
        assert isinstance(self.out, Path)
        check_out_path(self.out)  # a regular file, a foreign directory, an unwritable parent: refused now
        lock = lock_for(self.out)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.lock = lock.__enter__()
        except StoreBusyError:  # a BlockingIOError, but another job's lock, not an unwritable place
            raise
        except (LockUnavailable, OSError) as e:
            if not self.out.is_dir():
                raise e if isinstance(e, ExtractError) else ExtractError(f"--out {self.out}: {e}") from None
            self.read_only = True
        if self.lock is not None:  # what a killed claim, creation or overwrite left beside the store
            self.lock.sweep()
            sweep_scratch(self.out)
        return check_out_path(self.out)  # read again, now that nobody else can change it

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.__exit__(None, None, None)
            self.lock = None

    # decide ----------------------------------------------------------------------------------------

    def decide(
        self, identity: dict[str, Any], fingerprint: str, overwrite: bool, predates: Mapping[str, Any] | None = None
    ) -> Action:
        """``create`` (also whenever ``overwrite``), ``resume`` or ``complete``; refuses another job's store,
        and a store whose done chunks lost objects is resumed to recompute exactly those. ``predates``: the
        values of identity fields that a store made before they were recorded keeps in its ``job`` record
        instead (its batching), so that such a store resumes with the values it was made with, and only those."""
        return self._on_main(lambda: self._decide(identity, fingerprint, overwrite, predates or {}))

    def _decide(
        self, identity: dict[str, Any], fingerprint: str, overwrite: bool, predates: Mapping[str, Any]
    ) -> Action:
        existing = self.existing
        if existing is not None and DAMAGED in existing and not overwrite:
            raise StoreDamagedError(
                f"--out {self.out}: the store's root metadata {self.out}/zarr.json are damaged "
                f"({existing[DAMAGED]}); pass --overwrite to replace the store, or choose another --out"
            )
        before = {**predates, **(existing or {}).get("identity", {})}
        if existing is None or overwrite:
            action = Action.CREATE
        elif existing.get("fingerprint") == fingerprint or (predates and digest_of(before) == fingerprint):
            action = Action.COMPLETE if existing.get("status") == "complete" else Action.RESUME
        else:
            keys = [*identity, *(key for key in before if key not in identity)]
            differs = [key for key in keys if before.get(key) != identity.get(key)] or ["fingerprint"]
            if set(differs) <= set(COMPUTATION):  # the same job computed otherwise: its last bits differ
                raise StoreMismatchError(_computed_otherwise(self.out, differs, before, identity))
            raise StoreMismatchError(
                f"--out {self.out} holds a different job (differs in: {', '.join(differs)}); "
                "pass --overwrite to replace it, or choose another --out"
            )
        if action is not Action.CREATE:
            action = self._recheck(action)
        if action is not Action.COMPLETE:
            if self.read_only:
                raise ExtractError(
                    f"--out {self.out} is not writable (read-only or no permission); choose another --out"
                )
            if isinstance(self.out, Path):  # on object storage, a write that is refused says so itself
                target = self.out if self.out.is_dir() else self.out.parent
                check_writable(target, f"--out {self.out} is not writable")
        return action

    def _recheck(self, action: Action) -> Action:
        """``resume`` when done chunks lost objects (their done is cleared) or a "complete" store has
        chunks not done (its status goes back to running): the rerun computes exactly those."""
        store = FeatureStore.open(self.location, mode="r")  # validates the metadata
        if edited := latents.edited(store):  # rerun as it is, it would say complete, or add codes of another SAE
            more = f" and {len(edited) - 1} more" if len(edited) > 1 else ""
            raise StoreDamagedError(
                f"--out {self.out}: its SAE metadata were edited ({edited[0]}{more}); run `extract verify "
                f"{self.out} --repair` to restore them, or pass --overwrite to start afresh"
            )
        missing = store.integrity.missing_objects()
        pending = store.pending_chunks() if action is Action.COMPLETE else []
        documents = store.creation.damage() if action is Action.COMPLETE else []
        if documents and not self.read_only:  # the text stage surveyed the data again to rewrite them
            FeatureStore.open(self.location).update_attrs(status="running")
            if not missing and not pending:
                return Action.RESUME
        if not missing and not pending:
            return action
        first = ", ".join(f"chunk {k}: {', '.join(names)}" for k, names in list(missing.items())[:3])
        if self.read_only:
            what = f"lost objects ({first})" if missing else f"is marked complete but chunks {pending[:5]} are not done"
            raise StoreDamagedError(f"--out {self.out} {what} and is not writable; copy it elsewhere")
        writable = FeatureStore.open(self.location)
        if missing:
            writable.integrity.clear_done(sorted(missing))
            self.log(f"extract: {len(missing)} done chunks of {self.out} lost objects ({first}); recomputing them")
        if pending:
            writable.update_attrs(status="running")
            self.log(
                f"extract: {self.out} is marked complete but {len(pending)} chunks are not done "
                f"(chunk {', '.join(map(str, pending[:5]))}); computing them"
            )
        return Action.RESUME

    # create or reopen, and record the run --------------------------------------------------------

    def open(self, action: Action, create: Callable[[str], FeatureStore]) -> FeatureStore:
        """Rank 0 creates the store (atomically) when ``action`` is ``create``, with the lock's token as its
        ``writer`` (``create(token)``), or makes the token the writer of the store it resumes; then every
        rank opens the store fenced by that token, so that none writes once another job has it."""

        def prepare() -> str:
            assert self.lock is not None  # only "complete" needs no lock, and it opens nothing
            self.check_lock(afresh=True)  # a claimer paused since the claim must not take the store back
            if action is Action.CREATE:
                create(self.lock.token)
            else:
                FeatureStore.open(self.location).claim(self.lock.token)
            return self.lock.token

        token = self._on_main(prepare)
        self.store = FeatureStore.open(self.location, writer=token)
        self._done_before = int(self.store.done_flags().sum())
        return self.store

    def begin_run(
        self,
        chunks_per_rank: list[int],
        hostnames: list[str],
        mesh: Mapping[str, int] | None = None,
        parameter_bytes: list[int] | None = None,
    ) -> None:
        """Append this run's record; a record still "running" belongs to a run that was killed (the lock
        proves it is not running now). ``chunks_per_rank`` is per data rank (a tensor-parallel group),
        ``hostnames`` and ``parameter_bytes`` (the model's bytes each holds) per process, ``mesh`` the data ×
        tensor parallel sizes."""
        self._run_started = time.time()
        if not self.main:
            return
        assert self.store is not None
        runs = [
            {**run, "status": "killed"} if run.get("status") == "running" else run
            for run in self.store.attrs.get("runs", [])
        ]
        record = {
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "world_size": self.processes.num_processes,
            "chunks_per_rank": chunks_per_rank,
            "hostnames": hostnames,
            **({"mesh": dict(mesh)} if mesh is not None else {}),
            **({"parameter_bytes": parameter_bytes} if parameter_bytes is not None else {}),
            "seconds": None,
            "status": "running",
        }
        self.store.update_attrs(runs=[*runs, record])

    def _end_run(self, **fields: Any) -> None:
        assert self.store is not None and self._run_started is not None
        runs = self.store.attrs.get("runs", [])
        if runs:
            runs[-1].update(seconds=round(time.time() - self._run_started, 3), **fields)
            self.store.update_attrs(runs=runs)

    def check_lock(self, afresh: bool = False) -> None:
        """Raise ``LockLostError`` on rank 0 once its heartbeat found the lock another's (cheap: a flag;
        ``afresh`` reads the lock file too). The other ranks rely on the store's fence."""
        if self.lock is not None and (self.lock.lost.is_set() or (afresh and not self.lock.held())):
            raise lost_lock(self.location)

    # verify cheaply, mark complete, release --------------------------------------------------------

    def finish(self, summary: dict[str, Any]) -> None:
        """Rank 0, after the last barrier: every chunk done and every object present, then complete; on
        every rank, first, the store must still be ours."""
        assert self.store is not None
        self.check_lock(afresh=True)
        self.store.check_writer()
        if not self.main:
            return
        if left := self.store.pending_chunks():
            raise ExtractError(f"chunks {left[:5]} of {self.out} were not written; rerun the same command")
        if missing := self.store.integrity.missing_objects():
            self.store.integrity.clear_done(sorted(missing))
            raise StoreDamagedError(
                f"{len(missing)} chunks of {self.out} lost objects right after being written (chunk "
                f"{next(iter(missing))}); check the filesystem, then rerun the same command"
            )
        self._end_run(status="complete")
        self.store.update_attrs(status="complete", summary=summary)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _: object) -> None:
        try:
            if self._failed_for_a_lost_lock(error):  # said as the disk case says it; the store is not ours
                raise lost_lock(self.location) from None
            if error is not None and self._run_started is not None:
                self._record_failure(error)
        finally:
            self._release()

    def _failed_for_a_lost_lock(self, error: BaseException | None) -> bool:
        """Whether ``error``, a failure other than the lost lock itself, came while the job had lost the
        store: read afresh, the lock (rank 0) or the store's ``writer`` (every rank) is another job's.

        A job paused past the stale age with a request in flight (on object storage, the fence's read of
        the root metadata, a chunk's PUT) comes back to find that request past its timeout: its error
        reaches the writer before the heartbeat or the fence can see the new holder (a beat and a read
        later). On disk no request times out, and the fence says it. A check that fails itself (still
        an outage) leaves the error as it was."""
        if not isinstance(error, Exception) or isinstance(error, LockLostError | Interrupted):
            return False
        try:
            if self.lock is not None and (self.lock.lost.is_set() or not self.lock.held()):
                return True
            if self.store is not None and self.store.writer is not None:
                self.store.check_writer()
        except LockLostError:
            return True
        except Exception:  # noqa: BLE001 - cannot tell: the run's own error is the one to report
            return False
        return False

    def _record_failure(self, error: BaseException) -> None:
        """Close the run's record, and give an interrupt one message with the whole job's count."""
        store = self.store
        if store is None or isinstance(error, LockLostError):  # the store is another job's now
            return
        if isinstance(error, Interrupted):
            if not self.main:
                error.quiet = True  # rank 0 speaks for the job
                return
            done = store.done_flags()
            error.chunks_written, error.num_chunks = int(done.sum()), len(done)  # the job's, as docs/faults.md says
            error.this_run = max(0, error.chunks_written - self._done_before)
        if not self.main:
            return
        if isinstance(error, Interrupted | KeyboardInterrupt):
            fields: dict[str, Any] = {"status": "interrupted"}
        else:
            fields = {"status": "failed", "error": (str(error).strip().splitlines() or [type(error).__name__])[0]}
        try:
            self._end_run(**fields)
        except Exception:  # noqa: BLE001 - a read-only remount: the run's own error is the one to report
            pass
