"""What checking each chunk object's place costs a read (issue 45): every read compares the crc32c that ends
each chunk object (its last 4 bytes) with the digest the store recorded for that chunk (``read/placed.py``).

A token store of one layer (``--megabytes`` of float16 rows of ``--dim``, chunks of what a job would choose),
written through ``FeatureStore`` twice: with ``--compressor none`` (the direct read, ``read/direct.py``) and
with zstd-1 (zarr's read, the check in a wrapper of the store: the bytes fetched once). Variants, timed
interleaved in one process (the order rotates every repeat), median of ``--repeats``, warm page cache:

    load_{none,zstd}         ``open_features(store).load(layer, dtype=None)``: the whole layer
    stream_{none,zstd}       one epoch of ``TokenStream(store, layer, 4096, dtype="float16")``, 2 threads

each ``checked`` (as shipped) and ``unchecked`` (the same reader with the place check switched off:
``CheckedReads.recorded`` None, as for a store from before digests), each store opened once; GB/s and
CPU-s/GB of stored bytes. ``open_and_read_digests``: opening a store and reading its digests (once per
open store, at its first read: one small object a chunk).

    python benchmarks/place_check.py [--megabytes 80.25] [--repeats 7] [--json place.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import zarr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from token_stream import CONTEXT, LAYER, timed, token_store  # noqa: E402

from extract.job.plan import MAX_TOKEN_CHUNK_SIZE, default_chunk_size  # noqa: E402
from extract.read.checked import CheckedReads  # noqa: E402
from extract.read.features import open_features  # noqa: E402
from extract.read.tokens import TokenStream  # noqa: E402
from extract.store.chunks import Plan  # noqa: E402


class _Unchecked:
    """While entered, reads take no digests: the place check is off, as for a store from before them."""

    def __enter__(self) -> None:
        self.recorded = CheckedReads.__dict__["recorded"]
        CheckedReads.recorded = property(lambda reads: None)  # type: ignore[assignment,method-assign]

    def __exit__(self, *_: object) -> None:
        CheckedReads.recorded = self.recorded  # type: ignore[method-assign]


def variants(folder: Path, args: argparse.Namespace, epochs: Iterator[int]) -> tuple[dict[str, Callable[[], Any]], int]:
    row_bytes = args.dim * 2
    num_tokens = max(CONTEXT, int(args.megabytes * 1e6) // row_bytes // CONTEXT * CONTEXT)
    plan = Plan(num_tokens, default_chunk_size(num_tokens, row_bytes, largest=MAX_TOKEN_CHUNK_SIZE))
    token_ids = np.random.default_rng(0).integers(1, 50000, num_tokens, dtype=np.int32)
    special = np.zeros(num_tokens, dtype=bool)
    made: dict[str, Callable[[], Any]] = {}
    for compressor in ("none", "zstd"):
        path = folder / f"{compressor}.zarr"
        token_store(path, plan, args.dim, token_ids, special, [LAYER], 0, "float16", compressor=compressor)

        # opened once, as a trainer opens them: the digests are read at the first read (``digests_open``)
        features, tokens = open_features(path), TokenStream(path, LAYER, 4096, dtype="float16")

        def load(features: Any = features) -> None:
            assert len(features.load(LAYER, dtype=None)) == num_tokens

        def stream(tokens: TokenStream = tokens) -> None:
            tokens.set_epoch(next(epochs))
            assert sum(len(b) for b in tokens) == num_tokens

        def digests_open(path: Path = path) -> None:
            # what opening adds: the digests read once (one object a chunk), done read as before
            assert open_features(path)._reads.recorded is not None

        for name, run in (("load", load), ("stream", stream)):
            made[f"{name}_{compressor}_checked"] = run

            def unchecked(run: Callable[[], None] = run) -> None:
                with _Unchecked():
                    run()

            made[f"{name}_{compressor}_unchecked"] = unchecked
        made[f"open_and_read_digests_{compressor}_checked"] = digests_open
    return made, num_tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=80.25, help="raw float16 size of the layer (default 80.25)")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dir", type=Path, help="where to write the stores (default: a temporary folder)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    load_before = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        made, num_tokens = variants(Path(tmp), args, iter(range(10**6)))
        seconds, cpu = timed(made, args.repeats)
    nbytes = num_tokens * args.dim * 2
    print(f"{num_tokens} tokens x {args.dim} float16 ({nbytes / 1e6:.0f} MB), median of {args.repeats}")
    print(f"{'variant':<24} {'GB/s':>6} {'CPU-s/GB':>9} {'CPU ÷ unchecked':>16}")
    result: dict[str, Any] = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs", "zarr": zarr.__version__}
    for name in seconds:
        rate, per_gb = nbytes / seconds[name] / 1e9, cpu[name] / (nbytes / 1e9)
        if name.startswith("open_"):
            print(f"{name:<24} {seconds[name] * 1e3:.1f} ms, {cpu[name] * 1e3:.1f} CPU-ms")
            result[name] = {"seconds": round(seconds[name], 4), "cpu_seconds": round(cpu[name], 4)}
            continue
        base = cpu[name.replace("_checked", "_unchecked")] / (nbytes / 1e9)
        print(f"{name:<24} {rate:>6.2f} {per_gb:>9.3f} {per_gb / base:>16.3f}")
        result[name] = {"gb_per_s": round(rate, 3), "cpu_seconds_per_gb": round(per_gb, 4)}
    result["load_average_1min"] = {"before": load_before, "after": round(os.getloadavg()[0], 2)}
    print(f"1-min load average {load_before} -> {result['load_average_1min']['after']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
