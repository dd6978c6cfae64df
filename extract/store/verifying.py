"""Verify a store as a command does: ``verify_store(VerifyConfig(store, repair=...))`` refuses a store that
a live job holds (its objects being written would read as damage), takes the store's lock to repair it
(for the same reason), and checks it (``extract.store.verify``). ``python -m extract.verify`` is a thin
``main()`` over it; a library caller gets the same answer as a ``Verification``.

The config is declared with ``option(...)`` so that the command's flags and docs/cli.md are built from it;
this module imports zarr and the lock only when a store is verified, so that ``--help`` loads neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StoreDamagedError
from ..names.options import option
from .location import parse

if TYPE_CHECKING:
    from .verify import Report


@dataclass(frozen=True)
class VerifyConfig:
    """Which store to verify, and whether to repair it (the arguments of ``python -m extract.verify``)."""

    store: str = field(
        metadata=option(
            positional=True, help="a store: a path, or a URL on object storage (s3://bucket/prefix/name.zarr)"
        )
    )
    repair: bool = field(default=False, metadata=option(help="clear done for damaged chunks so a rerun redoes them"))


@dataclass(frozen=True)
class Verification:
    """What verifying found: the summary line, whether the store is clean, and the report behind it
    (None when the store's metadata is too damaged to open)."""

    line: str
    clean: bool
    report: Report | None = None


def verify_store(config: VerifyConfig) -> Verification:
    """Check (and with ``config.repair``, repair) the store ``config.store`` names. Raises ``ExtractError``
    for bad input (a malformed URL, no store there, a store a live job holds); damage is a finding,
    returned as ``Verification(clean=False)``."""
    from .locking import check_unlocked, lock_for  # zarr and the lock: not for --help
    from .paths import real_path
    from .store import FeatureStore
    from .verify import repair, verify

    location = parse(config.store)  # a malformed URL is one line (exit 2)
    target: Path | str
    if location.remote:  # its lock is an object beside it, made of conditional writes
        assert location.url is not None
        target = location.url
    else:  # through a link too: the lock is named for the real path
        assert location.path is not None
        target = real_path(location.path)
    check_unlocked(target)
    try:
        if config.repair:
            with lock_for(target):
                store = FeatureStore.open(target, mode="r+")
                found = verify(store)
                report = repair(store, found)
        else:
            report = found = verify(FeatureStore.open(target, mode="r"))
    except StoreDamagedError as e:  # damage found on opening (metadata): a finding, not bad input
        return Verification(f"extract.verify: {e}", clean=False)
    return Verification(report.line(config.repair), clean=found.clean, report=report)
