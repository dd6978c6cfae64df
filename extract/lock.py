"""One live job per store: a lock file naming its holder, kept fresh by a heartbeat.

The holder rewrites the file's mtime every ``HEARTBEAT`` seconds. A lock is stale (and taken over)
when its holder is a dead process on this host, or when its heartbeat stopped for ``STALE_AFTER``
seconds (a holder on another host, whose pid cannot be checked from here).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from .errors import ExtractError

LOCK_NAME = "extract.lock"
HEARTBEAT = 10.0
STALE_AFTER = 60.0


def _holder(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text())
        holder["age"] = time.time() - path.stat().st_mtime
        return holder
    except (OSError, ValueError):
        return None


def _alive(holder: dict[str, Any]) -> bool:
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return holder["age"] < STALE_AFTER


def check_unlocked(store: Path) -> None:
    """Refuse to start on a store that a live job holds."""
    holder = _holder(store / LOCK_NAME)
    if holder is not None and holder.get("pid") != os.getpid() and _alive(holder):
        raise ExtractError(
            f"--out {store} is being written by another job (host {holder.get('host')}, pid {holder.get('pid')}, "
            f"since {holder.get('started')}); wait for it to finish or stop it, then rerun"
        )


class StoreLock:
    """Held by rank 0 while a job writes the store; released on exit."""

    def __init__(self, store: Path) -> None:
        self.path = store / LOCK_NAME
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="extract-lock", daemon=True)

    def __enter__(self) -> StoreLock:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                check_unlocked(self.path.parent)
                self.path.unlink(missing_ok=True)  # stale: its holder is gone
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            self._thread.start()
            return self
        check_unlocked(self.path.parent)
        raise ExtractError(f"could not take the lock {self.path}; rerun")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            try:
                os.utime(self.path)
            except OSError:
                return

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        holder = _holder(self.path)
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
