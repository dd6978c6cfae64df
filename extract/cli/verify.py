"""``python -m extract.verify STORE [--repair]``: check a store's chunks (``extract.store.verify``).

One summary line; exit status 0 when clean, 1 when damaged, 2 for bad input. A store that a live job
holds is refused, naming its holder (its objects being written would read as damage); ``--repair``
takes the store's lock for the same reason.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ..errors import StoreDamagedError
from ..store.lock import StoreLock, check_unlocked
from ..store.store import FeatureStore, real_path
from ..store.verify import repair, verify
from .base import command


def build_parser() -> argparse.ArgumentParser:
    # plain argparse, unlike the other commands: its usage errors have always printed the usage line
    parser = argparse.ArgumentParser(
        prog="python -m extract.verify",
        description="Check a store's chunks: ``python -m extract.verify STORE [--repair]``.",
    )
    parser.add_argument("store", type=Path)
    parser.add_argument("--repair", action="store_true", help="clear done for damaged chunks so a rerun redoes them")
    return parser


@command("extract.verify")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.store = real_path(args.store)  # through a link too: the lock is named for the real path
    check_unlocked(args.store)
    try:
        if args.repair:
            with StoreLock(args.store):
                store = FeatureStore.open(args.store, mode="r+")
                found = verify(store)
                report = repair(store, found)
        else:
            report = found = verify(FeatureStore.open(args.store, mode="r"))
    except StoreDamagedError as e:  # damage found on opening (metadata): a finding, not bad input
        print(f"extract.verify: {e}")
        return 1
    print(report.line(args.repair))
    return 0 if found.clean else 1
