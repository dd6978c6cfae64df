"""The statistics row of a chunk, spelled out step by step from its contract (docs/store-format.md,
"Statistics"), independently of ``extract.store.stats``: loops over blocks and rows where the store's code
reduces whole slabs. The store's rows must equal these bit for bit; and the precision the contract
promises against float64 sums (``BOUND``) is what tests hold numpy's float64 recomputation to."""

from __future__ import annotations

import math

import numpy as np

BLOCK_ROWS = 16  # the contract's block of rows summed in float32
# a float32 block sum of at most 16 terms is within 15 * 2^-24 of the sum of the terms' magnitudes
BOUND = (BLOCK_ROWS - 1) * 2.0**-24


def chunk_rows(values: np.ndarray, channel_axis: int | None = None) -> np.ndarray:
    """The chunk's rows as float32 (samples, ...) -> (rows, F): each sample's flattened row, or each
    position's channel vector (positions in C order)."""
    if channel_axis is not None:
        values = np.moveaxis(values, channel_axis, -1)
    features = values.shape[-1] if channel_axis is not None else math.prod(values.shape[1:])
    return np.asarray(values, dtype=np.float32).reshape(-1, features)


def reference_row(values: np.ndarray, channel_axis: int | None = None) -> np.ndarray:
    """(5 + 2F,) float64: count, sum_norm, max_abs, float16_overflow, infinite, sum (F,), sumsq (F,)."""
    rows = chunk_rows(values, channel_axis)
    features = rows.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        nan_rows = np.isnan(rows).any(axis=1)
        kept = rows[~nan_rows]
        total, squares = np.zeros(features), np.zeros(features)
        for first in range(0, len(rows), BLOCK_ROWS):
            block_sum, block_squares = np.zeros(features, np.float32), np.zeros(features, np.float32)
            started = False
            for i in range(first, min(first + BLOCK_ROWS, len(rows))):
                x = np.where(nan_rows[i], np.float32(0), rows[i])  # a row with a NaN adds +0.0
                if not started:  # a float32 sum in row order from the block's first row
                    block_sum, block_squares, started = x.copy(), x * x, True
                else:
                    block_sum = block_sum + x
                    block_squares = block_squares + x * x
            total = total + block_sum.astype(np.float64)  # float64 in block order, from 0
            squares = squares + block_squares.astype(np.float64)
        sum_norm = 0.0
        for row in kept:  # sqrt (float64) of the row's float32 sum of squares (numpy's sum of a 1-D row)
            sum_norm += math.sqrt(float(np.sum(row * row, dtype=np.float32)))
        magnitude = np.abs(kept)
        head = [
            len(kept),
            sum_norm,
            float(magnitude.max()) if len(kept) else 0.0,
            int(np.count_nonzero(np.isfinite(kept) & (magnitude > 65504))),
            int(np.count_nonzero(np.isinf(kept))),
        ]
    return np.concatenate([np.array(head, dtype=np.float64), total, squares])


def assert_close_to_float64(got: dict, values: np.ndarray) -> None:
    """The merged statistics against numpy's float64 over the rows without a NaN, within what the
    contract's float32 blocks allow (``BOUND`` of the magnitudes summed; docs/store-format.md)."""
    rows = values.reshape(len(values), -1).astype(np.float64)
    rows = rows[~np.isnan(rows).any(axis=1)]
    expected = {
        "count": len(rows), "mean": rows.mean(axis=0), "std": rows.std(axis=0),
        "mean_norm": np.linalg.norm(rows, axis=1).mean(), "max_abs": np.abs(rows).max(),
        "float16_overflow": int((np.isfinite(rows) & (np.abs(rows) > 65504)).sum()), "infinite": int(np.isinf(rows).sum()),
    }  # fmt: skip
    assert got["count"] == expected["count"]
    slack = 1.01  # the float64 steps' own rounding, far below the float32 blocks'
    mean_error = BOUND * np.abs(rows).mean(axis=0) * slack + 1e-15
    assert got["mean"].shape == values.shape[1:] or got["mean"].size == rows.shape[1]
    assert (np.abs(got["mean"].ravel() - expected["mean"]) <= mean_error).all()
    squares = np.square(rows).mean(axis=0)
    variance_error = BOUND * (squares + 2 * np.abs(expected["mean"]) * np.abs(rows).mean(axis=0)) * slack + 1e-15
    assert (np.abs(np.square(got["std"].ravel()) - np.square(expected["std"])) <= variance_error).all()
    assert abs(got["mean_norm"] - expected["mean_norm"]) <= 1e-6 * expected["mean_norm"]  # float32 row sums
    assert got["max_abs"] == expected["max_abs"]
    assert (got["float16_overflow"], got["infinite"]) == (expected["float16_overflow"], expected["infinite"])


def staged_store(path, layers: dict, dtype: str, chunk_size: int, batch: int, device, device_stats: bool):
    """An image store of ``layers`` (name -> (N, ...) float32 array; 4-D ones kept whole in NCHW) written
    the job's way: ``HostStaging`` (on ``device``; the statistics of whole blocks computed there when
    ``device_stats``), ``ChunkWriter``, ``write_chunk``, in batches of ``batch`` rows. Returns the store."""
    import torch

    from extract.capture.staging import HostStaging
    from extract.store.chunks import Plan
    from extract.store.store import FeatureStore
    from extract.store.writer import ChunkWriter

    n = len(next(iter(layers.values())))
    shapes = {name: values.shape[1:] for name, values in layers.items()}
    layouts = {name: "NCHW" for name, values in layers.items() if values.ndim == 4}
    store = FeatureStore.create(
        path, shapes=shapes, num_samples=n, chunk_size=chunk_size, dtype=dtype, compressor="none",
        attrs={"status": "running", "layers": list(layers), "num_samples": n, "chunk_size": chunk_size},
        layouts=layouts,
    )  # fmt: skip
    stats = {layer: store.array(f"stats/{layer}").attrs.get("channel_axis") for layer in store.stats_layers()}
    staging = HostStaging(
        shapes, batch, getattr(torch, dtype), torch.device(device), slots=2, stats=stats, chunk_size=chunk_size,
        device_stats=device_stats,
    )  # fmt: skip
    writer = ChunkWriter(store, staging, Plan(n, chunk_size), shapes, threads=2)
    for start in range(0, n, batch):
        indices = torch.arange(start, min(n, start + batch))
        slot = staging.acquire(writer.check)
        staging.rows = indices.numpy()
        for name, values in layers.items():
            staging.stage(name, torch.from_numpy(values[start : start + batch]).to(device))
        staging.seal(slot)
        writer.submit(slot, indices, torch.zeros(len(indices), dtype=torch.int64), np.ones(len(indices), bool))
    writer.close()
    return store
