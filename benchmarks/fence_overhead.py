"""The store's fence (store/fence.py): write_chunk with and without it, on a 16 MiB float16 chunk (ResNet-50
layer3 maps, 42 samples) and on a tiny one. Run: PYTHONPATH=. python benchmarks/fence_overhead.py"""

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from extract.store.store import FeatureStore


def bench(shape, rows, reps):
    root = Path(tempfile.mkdtemp(dir="/tmp"))
    out = root / "b.zarr"
    FeatureStore.create(
        out,
        shapes={"x": shape},
        num_samples=rows * reps,
        chunk_size=rows,
        dtype="float16",
        compressor="zstd",
        attrs={"writer": "w"},
    )
    rng = np.random.default_rng(0)
    values = rng.standard_normal((rows, *shape)).astype(np.float16)
    labels, valid = np.zeros(rows, dtype=np.int64), np.ones(rows, dtype=bool)
    result = {}
    for _trial in range(3):
        for name, writer in (("plain", None), ("fenced", "w")):
            s = FeatureStore.open(out, writer=writer)
            times = []
            for k in range(reps):
                t = time.perf_counter()
                s.write_chunk(k, k * rows, (k + 1) * rows, {"x": values}, labels, valid)
                times.append(time.perf_counter() - t)
            result.setdefault(name, []).append(statistics.median(times) * 1e3)
    shutil.rmtree(root)
    return {k: min(v) for k, v in result.items()}


print("16 MiB chunk", bench((1024, 14, 14), 42, 8))
print("tiny chunk", bench((4, 15, 15), 4, 50))
