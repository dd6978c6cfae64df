"""What recording each chunk's statistics costs the writer (issue 19, ``stats/<layer>``).

``FeatureStore.write_chunk`` computes one statistics row per 1-D layer from the chunk as stored (count,
sum of norms, max |x|, sum and sum of squares, in float64) and writes it before ``done[k]``. Timed
interleaved in one process (the order rotates every repeat), median of the repeats, a (4096, 768)
float16 chunk (a GPT-2-small layer, 4096 tokens a chunk, 6 MB), zstd-1, into a fresh store on local disk:

    rows        ``stats.chunk_row`` alone: the CPU time of the computation (this thread's)
    stats       write_chunk as the job calls it (wall and CPU time of the process)
    none        the same store with the statistics switched off

    python benchmarks/stats_cost.py --json stats.json
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

from extract.store import stats  # noqa: E402
from extract.store.store import FeatureStore  # noqa: E402

ROWS, FEATURES = 4096, 768


def _values() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((ROWS, FEATURES)).astype(np.float16)


def _rows(values: np.ndarray, chunks: int) -> dict[str, float]:
    start = time.thread_time()
    for _ in range(chunks):
        stats.chunk_row(values)
    return {"cpu": (time.thread_time() - start) / chunks}


def _writes(values: np.ndarray, variant: str, chunks: int) -> dict[str, float]:
    """Wall and CPU seconds per ``write_chunk`` of ``chunks`` chunks into a fresh store."""
    with tempfile.TemporaryDirectory() as tmp:
        store = FeatureStore.create(
            Path(tmp) / "s.zarr", shapes={"h": (FEATURES,)}, num_samples=ROWS * chunks, chunk_size=ROWS,
            dtype="float16", compressor="zstd", attrs={"status": "running"},
        )  # fmt: skip
        store.integrity.digests_array(), store.stats_layers()  # the existence checks, outside the timing
        if variant == "none":
            store._stats_layers = []
        labels, valid = np.zeros(ROWS, dtype=np.int64), np.ones(ROWS, dtype=bool)
        wall, cpu = time.perf_counter(), time.process_time()
        for k in range(chunks):
            store.write_chunk(k, k * ROWS, (k + 1) * ROWS, {"h": values}, labels, valid)
        return {"wall": (time.perf_counter() - wall) / chunks, "cpu": (time.process_time() - cpu) / chunks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--chunks", type=int, default=8, help="chunks written (or rows computed) per timing")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    values = _values()
    variants = ["rows", "stats", "none"]
    raw: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for variant in variants[repeat % 3 :] + variants[: repeat % 3]:
            timing = _rows(values, args.chunks) if variant == "rows" else _writes(values, variant, args.chunks)
            raw[variant].append(timing)
    med = {v: {k: statistics.median(t[k] for t in raw[v]) * 1e3 for k in raw[v][0]} for v in variants}
    print(f"chunk_row alone ({ROWS}, {FEATURES}) float16: {med['rows']['cpu']:.2f} ms CPU a chunk")
    for clock in ("wall", "cpu"):
        with_, without = med["stats"][clock], med["none"][clock]
        print(f"write_chunk {clock:4s}: {with_:7.2f} ms with statistics, {without:7.2f} ms without: "
              f"+{with_ - without:.2f} ms a chunk ({100 * (with_ / without - 1):+.1f}%)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.platform(), "median_ms": med, "raw": raw}, indent=1))


if __name__ == "__main__":
    main()
