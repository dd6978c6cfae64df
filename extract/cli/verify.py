"""``python -m extract.verify STORE [--repair]``: check a store's chunks (``extract.store.verifying``).

One summary line; exit status 0 when clean, 1 when damaged, 2 for bad input. A store that a live job
holds is refused, naming its holder (its objects being written would read as damage); ``--repair``
takes the store's lock for the same reason. STORE is a path or a URL on object storage
(``s3://bucket/prefix/name.zarr``), whose lock is the object beside it (``object_lock.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..store.verifying import VerifyConfig, verify_store  # zarr and the lock: only when it verifies
from .base import CommandLine, command, values

LINE = CommandLine(
    "python -m extract.verify",
    "Check a store's chunks: ``python -m extract.verify STORE [--repair]``.",
    (VerifyConfig,),
    parser=argparse.ArgumentParser,  # not Parser: its usage errors have always printed the usage line
)


@command("extract.verify")
def main(argv: Sequence[str] | None = None) -> int:
    config = values(LINE.parse_args(argv), VerifyConfig)
    verification = verify_store(config)
    print(verification.line)
    return 0 if verification.clean else 1
