"""``python -m extract.verify STORE [--repair]``: check a store's chunks (``extract.store.verifying``).

One summary line; exit status 0 when clean, 1 when damaged, 2 for bad input. A store that a live job
holds is refused, naming its holder (its objects being written would read as damage); ``--repair``
takes the store's lock for the same reason. STORE is a path or a URL on object storage
(``s3://bucket/prefix/name.zarr``), whose lock is the object beside it (``object_lock.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..store.verifying import VerifyConfig, verify_store  # zarr and the lock: imported to verify
from .base import Argument, arguments, command, make_parser, values

PROG = "python -m extract.verify"
DESCRIPTION = "Check a store's chunks: ``python -m extract.verify STORE [--repair]``."


def declared() -> list[Argument]:
    return arguments(VerifyConfig)


def build_parser() -> argparse.ArgumentParser:
    # plain argparse, unlike the other commands: its usage errors have always printed the usage line
    return make_parser(PROG, DESCRIPTION, declared(), parser=argparse.ArgumentParser)


@command("extract.verify")
def main(argv: Sequence[str] | None = None) -> int:
    config = values(build_parser().parse_args(argv), VerifyConfig)
    verification = verify_store(config)
    print(verification.line)
    return 0 if verification.clean else 1
