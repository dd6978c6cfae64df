"""bfloat16 against float16 storage (issue 31): bytes per token, write and read speed, and the cast check.

A token chunk of (4096, 768) activations (a GPT-2-small layer): standard normal values times per-channel
scales drawn log-normal, and three "massive" channels near 3000, so that float16 holds every value and
the two dtypes store the same data. Timed interleaved in one process (the order rotates every repeat),
medians, into fresh stores on local disk:

    bytes       stored bytes per token (objects and metadata under features/), codecs none (the token
                stores' default) and zstd-1
    write       the host cast from float32 (torch ``.to``) + ``FeatureStore.write_chunk`` (statistics,
                digests and done included), codec none: ms a chunk and MB/s of float32 activations
    read        ``Features.load`` of the whole layer as float32 numpy, and in the stored dtype as torch
                (bfloat16: the bits straight into the tensor); ``TokenStream`` batches of 4096 rows in
                the stored dtype
    check       ``HostStaging.stage`` of one float32 batch into the storage dtype on the CPU, with the
                overflow check (the batch's largest finite |x|) and with it switched off

    python benchmarks/bf16.py --json bf16.json
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
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extract import TokenStream, open_features  # noqa: E402
from extract.capture import cast  # noqa: E402
from extract.capture.staging import HostStaging  # noqa: E402
from extract.store.dtypes import host_values  # noqa: E402
from extract.store.store import FeatureStore, TextArrays  # noqa: E402

ROWS, FEATURES = 4096, 768
DTYPES = ("float16", "bfloat16")


def activations(seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.normal(0.0, 1.0, FEATURES)).astype(np.float32)
    scales[[7, 138, 447]] = 3000.0  # massive channels, within float16's range
    return torch.from_numpy(rng.standard_normal((ROWS, FEATURES)).astype(np.float32) * scales)


CONTEXT = 128


def _store(path: Path, dtype: str, chunks: int, compressor: str) -> FeatureStore:
    """A token store of ``chunks`` chunks of ``ROWS`` tokens, in contexts of ``CONTEXT``."""
    tokens = ROWS * chunks
    text = TextArrays(
        offsets=np.arange(tokens // CONTEXT + 1, dtype=np.int64) * CONTEXT,
        labels=np.full(tokens // CONTEXT, -1, dtype=np.int64),
        valid=np.ones(tokens // CONTEXT, dtype=bool),
    )
    store = FeatureStore.create(
        path, shapes={"h": (FEATURES,)}, num_samples=tokens, chunk_size=ROWS, dtype=dtype, compressor=compressor,
        attrs={"status": "running", "layers": ["h"], "num_samples": tokens, "chunk_size": ROWS}, kind="tokens",
        text=text,
    )  # fmt: skip
    store.integrity.digests_array(), store.stats_layers()  # the existence checks, outside the timing
    return store


def write(values: torch.Tensor, dtype: str, chunks: int, compressor: str, root: Path) -> dict[str, float]:
    """Seconds per chunk: the host cast and write_chunk; and the stored bytes per token."""
    path = root / f"{dtype}-{compressor}-{time.monotonic_ns()}.zarr"
    store = _store(path, dtype, chunks, compressor)
    columns = {"token_ids": np.ones(ROWS, dtype=np.int32), "special": np.zeros(ROWS, dtype=bool)}
    target = getattr(torch, dtype)
    wall, cpu = time.perf_counter(), time.process_time()
    for k in range(chunks):
        stored = host_values(values.to(target))
        store.write_chunk(k, k * ROWS, (k + 1) * ROWS, {"h": stored}, None, None, columns)
    timing = {"wall": (time.perf_counter() - wall) / chunks, "cpu": (time.process_time() - cpu) / chunks}
    store.update_attrs(status="complete")
    return {**timing, "bytes_per_token": store.stored_bytes() / (ROWS * chunks), "path": str(path)}


def read(path: str, dtype: str) -> dict[str, float]:
    f = open_features(path)
    out = {}
    start = time.perf_counter()
    f.load("h")
    out["numpy_float32"] = time.perf_counter() - start
    start = time.perf_counter()
    f.load("h", dtype=None, as_torch=True)
    out["torch_stored"] = time.perf_counter() - start
    start = time.perf_counter()
    for _ in TokenStream(path, "h", batch_size=ROWS, dtype=dtype, window=2, threads=1):
        pass
    out["token_stream"] = time.perf_counter() - start
    return out


def check(values: torch.Tensor, dtype: str, checked: bool, batches: int) -> float:
    """Seconds per ``stage`` of one batch (float32 values into ``dtype``), with or without the check."""
    staging = HostStaging({"h": (FEATURES,)}, ROWS, getattr(torch, dtype), torch.device("cpu"), slots=1)
    narrows = cast.narrows
    cast.narrows = narrows if checked else (lambda source, target: False)  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        for _ in range(batches):
            slot = staging.acquire()
            staging.stage("h", values)
            staging.ready(slot)
            staging.release(slot)
        return (time.perf_counter() - start) / batches
    finally:
        cast.narrows = narrows  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    values = activations()
    raw: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        raw.setdefault(key, []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = DTYPES[repeat % 2 :] + DTYPES[: repeat % 2]
            for dtype in order:
                for compressor in ("none", "zstd"):
                    written = write(values, dtype, args.chunks, compressor, Path(tmp))
                    add(f"{dtype} {compressor} bytes/token", written["bytes_per_token"])
                    add(f"{dtype} {compressor} write wall ms", written["wall"] * 1e3)
                    add(f"{dtype} {compressor} write cpu ms", written["cpu"] * 1e3)
                    if compressor == "none":
                        for name, seconds in read(written["path"], dtype).items():
                            add(f"{dtype} read {name} ms/chunk", seconds / args.chunks * 1e3)
                for checked in (True, False):
                    seconds = check(values, dtype, checked, 8)
                    add(f"{dtype} stage {'checked' if checked else 'unchecked'} ms", seconds * 1e3)
    med = {key: statistics.median(found) for key, found in raw.items()}
    megabytes = ROWS * FEATURES * 4 / 1e6
    for key, value in med.items():
        rate = f"  ({megabytes / value * 1e3:7.0f} MB/s of float32)" if key.endswith("ms") and "write" in key else ""
        print(f"{key:40s} {value:10.2f}{rate}")
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.platform(), "median": med, "raw": raw}, indent=1))


if __name__ == "__main__":
    main()
