"""What recording each chunk's digests costs ``FeatureStore.write_chunk`` (format 3, issue 17 item 20).

Before ``done[k]``, ``write_chunk`` reads the last 4 bytes (the crc32c) of chunk k's object in every
per-sample array and writes them as row k of ``digests``. Variants, timed interleaved in one process
(order rotates every repeat), median of the repeats, each into a fresh store on local disk:

    digests   write_chunk as the job calls it
    none      the same store with the digests step switched off (a format-2 write)

Two sizes: ``small`` (one (64,) float32 layer, 4 samples a chunk: the fixed cost dominates) and
``resnet`` (resnet50 layer3 + layer4 float16, zstd-1, 32 samples a chunk, about 19 MB raw).

    python benchmarks/digest_cost.py --json digest.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extract.store.store import FeatureStore  # noqa: E402

SIZES = {
    "small": ({"a": (64,)}, 4, "float32", "zstd"),
    "resnet": ({"layer3": (1024, 14, 14), "layer4": (2048, 7, 7)}, 32, "float16", "zstd"),
}


def _store(path: Path, size: str, chunks: int) -> tuple[FeatureStore, dict[str, np.ndarray]]:
    shapes, chunk_size, dtype, compressor = SIZES[size]
    n = chunks * chunk_size
    store = FeatureStore.create(
        path, shapes=shapes, num_samples=n, chunk_size=chunk_size, dtype=dtype, compressor=compressor,
        attrs={"status": "running"}, keys=[f"k/{i}" for i in range(n)],
    )  # fmt: skip
    rng = np.random.default_rng(0)
    values = {k: np.maximum(rng.standard_normal((chunk_size, *s)), 0).astype(dtype) for k, s in shapes.items()}
    return store, values


def _time(size: str, variant: str, chunks: int) -> float:
    """Seconds per ``write_chunk`` of ``chunks`` chunks into a fresh store."""
    with tempfile.TemporaryDirectory() as tmp:
        store, values = _store(Path(tmp) / "s.zarr", size, chunks)
        store.integrity.digests_array()  # the one existence check, outside the timing
        if variant == "none":
            store.integrity._has_digests = False
        c = SIZES[size][1]
        labels, valid = np.arange(c, dtype=np.int64), np.ones(c, dtype=bool)
        start = time.perf_counter()
        for k in range(chunks):
            store.write_chunk(k, k * c, (k + 1) * c, values, labels, valid)
        return (time.perf_counter() - start) / chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=40, help="chunks written per timing (small: 10x)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    variants = ["digests", "none"]
    results: dict[str, dict[str, list[float]]] = {size: {v: [] for v in variants} for size in SIZES}
    for repeat in range(args.repeats):
        order = variants[repeat % 2 :] + variants[: repeat % 2]
        for size in SIZES:
            for variant in order:
                chunks = args.chunks * (10 if size == "small" else 1)
                results[size][variant].append(_time(size, variant, chunks))
    table = {}
    for size, by_variant in results.items():
        with_, without = (statistics.median(by_variant[v]) * 1e3 for v in variants)
        table[size] = {"digests_ms": with_, "none_ms": without, "cost_ms": with_ - without}
        print(f"{size:7s} write_chunk {with_:8.3f} ms with digests, {without:8.3f} ms without: "
              f"+{with_ - without:.3f} ms a chunk ({100 * (with_ / without - 1):+.1f}%)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.platform(), "results": table, "raw": results}, indent=1))


if __name__ == "__main__":
    main()
