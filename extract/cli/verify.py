"""``python -m extract.verify STORE [--repair]``: check a store's chunks (``extract.store.verify``).

One summary line; exit status 0 when clean, 1 when damaged, 2 for bad input. A store that a live job
holds is refused, naming its holder (its objects being written would read as damage); ``--repair``
takes the store's lock for the same reason. STORE is a path or a URL on object storage
(``s3://bucket/prefix/name.zarr``), whose lock is the object beside it (``object_lock.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ..errors import StoreDamagedError
from ..store.location import parse
from .base import command


def build_parser() -> argparse.ArgumentParser:
    # plain argparse, unlike the other commands: its usage errors have always printed the usage line
    parser = argparse.ArgumentParser(
        prog="python -m extract.verify",
        description="Check a store's chunks: ``python -m extract.verify STORE [--repair]``.",
    )
    parser.add_argument("store", help="a store: a path, or a URL on object storage (s3://bucket/prefix/name.zarr)")
    parser.add_argument("--repair", action="store_true", help="clear done for damaged chunks so a rerun redoes them")
    return parser


@command("extract.verify")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..store.locking import check_unlocked, lock_for  # zarr and torch: not for --help
    from ..store.paths import real_path
    from ..store.store import FeatureStore
    from ..store.verify import repair, verify

    location = parse(args.store)  # a malformed URL is one line (exit 2)
    target: Path | str
    if location.remote:  # its lock is an object beside it, made of conditional writes
        assert location.url is not None
        target = location.url
    else:  # through a link too: the lock is named for the real path
        assert location.path is not None
        target = real_path(location.path)
    check_unlocked(target)
    try:
        if args.repair:
            with lock_for(target):
                store = FeatureStore.open(target, mode="r+")
                found = verify(store)
                report = repair(store, found)
        else:
            report = found = verify(FeatureStore.open(target, mode="r"))
    except StoreDamagedError as e:  # damage found on opening (metadata): a finding, not bad input
        print(f"extract.verify: {e}")
        return 1
    print(report.line(args.repair))
    return 0 if found.clean else 1
