"""Requests and bytes per chunk on object storage, and throughput against plain concurrent PUTs/GETs.

Against moto's S3 server (``moto.server``, in a process of its own on 127.0.0.1), so this measures
what ``extract``'s client side costs over the same server, not S3:

1. **Requests per chunk.** A whole job (``python -m extract``, a subprocess, ``--out s3://...``)
   through the counting proxy of the tests (``tests/helpers/faultproxy.py``, in pass-through), then a whole
   read of the store (``open_features(url).load`` of every layer, labels, valid): requests by method
   and kind of key (chunk objects, ``zarr.json`` metadata, the lock, listings), and bytes sent or
   received in request and response bodies, per chunk of the store, against the bytes it holds.
2. **Throughput.** The store's write path (``FeatureStore.write_chunk`` on ``--threads`` threads, as
   ``ChunkWriter`` runs it: features, labels, valid, digests, then ``done[k]``) into a store on S3,
   against plain ``obstore`` PUTs of objects of the same sizes, as many at once as the threads; and
   ``Features.load`` (zarr's concurrent chunk GETs) against plain ``obstore`` GETs of the same keys,
   as many at once as zarr's ``async.concurrency``. Directly to the server (no proxy), interleaved,
   median of ``--repeats``. MB/s are of feature bytes (the payload).

    python benchmarks/s3_requests.py --json s3.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers.faultproxy import FaultProxy  # noqa: E402

from extract.read.features import open_features  # noqa: E402
from extract.store.location import object_store  # noqa: E402
from extract.store.store import FeatureStore  # noqa: E402

BUCKET = "bench"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
TINY = ROOT / "tests" / "helpers" / "tiny_models.py"
JOB = ["--model", f"{TINY}:dict_net", "--layers", "heads.conv", "fc", "--image-size", "32",
       "--num-workers", "0", "--dtype", "float32", "--batch-size", "8"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip
    for _ in range(200):
        try:
            client.create_bucket(Bucket=BUCKET)
            return server, endpoint
        except Exception:  # noqa: BLE001 - not listening yet
            time.sleep(0.05)
    server.kill()
    raise SystemExit("moto's server did not start")


def point_at(endpoint: str) -> dict[str, str]:
    """This process's environment pointed at ``endpoint`` (for the clients made from now on)."""
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}
    os.environ.update(env)
    return env


def listing(url: str) -> dict[str, int]:
    """key (relative to ``url``) -> size, of every object under the store's prefix."""
    import obstore

    return {m["path"]: m["size"] for batch in obstore.list(object_store(url)) for m in batch}


def chunk_objects(objects: dict[str, int], prefix: str = "features/") -> dict[str, int]:
    return {k: v for k, v in objects.items() if k.startswith(prefix) and "/c/" in k}


# -- 1. requests and bytes per chunk -------------------------------------------------------------


def counted(proxy: FaultProxy) -> dict[str, Any]:
    c = proxy.counts
    return {
        "requests": dict(c.requests),
        "by_kind": {f"{m} {k}": n for (m, k), n in sorted(c.classes.items())},
        "body_up": {f"{m} {k}": n for (m, k), n in sorted(c.body_up.items()) if n},
        "body_down": {f"{m} {k}": n for (m, k), n in sorted(c.body_down.items()) if n},
        "total": c.total,
        "connections": c.connections,
    }


def requests_per_chunk(endpoint: str, samples: int, chunk_size: int) -> dict[str, Any]:
    url = f"s3://{BUCKET}/counts-{uuid.uuid4().hex[:8]}/job.zarr"
    with FaultProxy(endpoint, env=point_at(endpoint)) as proxy:
        env = {**os.environ, **proxy.env(), "PYTHONPATH": str(ROOT)}
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "extract", *JOB, "--data", f"synthetic:{samples}", "--chunk-size", str(chunk_size),
             "--out", url],
            env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        job_seconds = time.perf_counter() - started
        write = counted(proxy)
        proxy.reset_counts()
        point_at(proxy.endpoint)
        features = open_features(url)
        for layer in features.layers:
            features.load(layer)
        features.labels, features.valid  # noqa: B018 - read them too
        read = counted(proxy)
    point_at(endpoint)
    objects = listing(url)
    chunks = -(-samples // chunk_size)
    feature_objects = chunk_objects(objects)
    return {
        "url": url, "samples": samples, "chunk_size": chunk_size, "chunks": chunks, "job_seconds": job_seconds,
        "objects": len(objects), "stored_bytes": sum(objects.values()),
        "feature_objects": len(feature_objects), "feature_bytes": sum(feature_objects.values()),
        "write": write, "read": read,
    }  # fmt: skip


# -- 2. throughput against plain PUTs and GETs ---------------------------------------------------


def write_extract(url: str, values: np.ndarray, chunks: int, threads: int) -> float:
    """Seconds for ``chunks`` whole chunks of ``values`` through ``FeatureStore.write_chunk``."""
    rows = len(values)
    FeatureStore.create(
        url, shapes={"x": values.shape[1:]}, num_samples=rows * chunks, chunk_size=rows, dtype="float16",
        compressor="none", attrs={"writer": "bench"},
    )  # fmt: skip
    store = FeatureStore.open(url, writer="bench")
    labels, valid = np.zeros(rows, dtype=np.int64), np.ones(rows, dtype=bool)
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: store.write_chunk(k, k * rows, (k + 1) * rows, {"x": values}, labels, valid),
                      range(chunks)))  # fmt: skip
    seconds = time.perf_counter() - started
    store.update_attrs(status="complete")  # as the job does at the end: for the read that follows
    return seconds


async def _bounded(calls: list[Any], limit: int) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(call: Any) -> Any:
        async with gate:
            return await call()

    return await asyncio.gather(*(one(c) for c in calls))


def put_plain(url: str, sizes: list[int], limit: int) -> float:
    import obstore

    store = object_store(url)
    payloads = [os.urandom(size) for size in sizes]
    started = time.perf_counter()

    async def put(i: int, data: bytes) -> Any:
        return await obstore.put_async(store, f"x/c/{i}/0/0/0", data, use_multipart=False)

    asyncio.run(_bounded([lambda i=i, d=d: put(i, d) for i, d in enumerate(payloads)], limit))
    return time.perf_counter() - started


def read_extract(url: str, dtype: str | None) -> tuple[float, float]:
    """Seconds for ``Features.load`` of the whole layer, first on a fresh ``open_features`` (which also
    reads the done flags and lists the objects once, for the damage checks), then again. ``dtype=None``
    keeps float16 (the bytes as a plain GET has them), ``"float32"`` is ``load``'s default."""
    features = open_features(url)
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        features.load("x", dtype=dtype)
        seconds.append(time.perf_counter() - started)
    return seconds[0], seconds[1]


def get_plain(url: str, keys: list[str], limit: int) -> float:
    import obstore

    store = object_store(url)
    started = time.perf_counter()

    async def get(key: str) -> int:
        result = await obstore.get_async(store, key)
        return len(await result.bytes_async())

    asyncio.run(_bounded([lambda k=k: get(k) for k in keys], limit))
    return time.perf_counter() - started


def delete_prefix(url: str) -> None:
    import obstore

    store = object_store(url)
    keys = [m["path"] for batch in obstore.list(store) for m in batch]
    if keys:
        obstore.delete(store, keys)


def one_repeat(
    repeat: int, values: np.ndarray, chunks: int, threads: int, concurrency: int, times: dict[str, list[float]]
) -> None:
    """Each write variant, then each read, into fresh prefixes, the order rotating with ``repeat``."""
    base = f"s3://{BUCKET}/tp-{uuid.uuid4().hex[:8]}"
    ours, plain = f"{base}/ours.zarr", f"{base}/plain"
    writes = [
        lambda: times["write extract"].append(write_extract(ours, values, chunks, threads)),
        lambda: times["write plain"].append(put_plain(plain, [values.nbytes] * chunks, threads)),
    ]
    for write in writes if repeat % 2 == 0 else writes[::-1]:
        write()
    keys = sorted(chunk_objects(listing(ours)))
    assert len(keys) == chunks, keys

    def ours_read() -> None:
        first, again = read_extract(ours, None)
        times["read extract"].append(first)
        times["read extract again"].append(again)
        times["read extract f32"].append(read_extract(ours, "float32")[1])

    reads = [ours_read, lambda: times["read plain"].append(get_plain(ours, keys, concurrency))]
    for read in reads if repeat % 2 == 0 else reads[::-1]:
        read()
    delete_prefix(base)


def throughput(endpoint: str, chunk_mib: float, chunks: int, threads: int, repeats: int) -> dict[str, Any]:
    import zarr

    point_at(endpoint)
    shape = (1024, 14, 14)  # ResNet-50 layer3, float16: 392 KiB a sample
    rows = max(1, round(chunk_mib * 2**20 / (np.prod(shape) * 2)))
    values = np.random.default_rng(0).standard_normal((rows, *shape)).astype(np.float16)
    payload = chunks * values.nbytes
    concurrency = zarr.config.get("async.concurrency")
    names = ("write extract", "write plain", "read extract", "read extract again",
             "read extract f32", "read plain")  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in names}
    for repeat in range(repeats):
        one_repeat(repeat, values, chunks, threads, concurrency, times)
    medians = {k: statistics.median(v) for k, v in times.items()}
    mb_s = {k: payload / v / 1e6 for k, v in medians.items()}
    return {
        "chunk_mib": values.nbytes / 2**20, "rows": rows, "chunks": chunks, "threads": threads,
        "read_concurrency": concurrency, "payload_mb": payload / 1e6, "seconds": medians, "mb_per_s": mb_s,
        "write_ratio": mb_s["write extract"] / mb_s["write plain"],
        "read_ratio": mb_s["read extract"] / mb_s["read plain"], "all": times,
    }  # fmt: skip


def show_counts(small: dict[str, Any], large: dict[str, Any]) -> dict[str, Any]:
    """Each phase's requests and body bytes by kind, for the larger job, and per chunk at the margin:
    (larger - smaller) / (their difference in chunks), which leaves out what a job costs once (the
    lock, creation, the resume check, opening every array)."""
    extra = large["chunks"] - small["chunks"]
    print(f"\nwhole jobs of {small['samples']} and {large['samples']} samples, chunks of {large['chunk_size']}, "
          f"2 layers ({large['feature_objects'] / large['chunks']:.0f} feature objects a chunk, "
          f"{large['feature_bytes'] / large['chunks'] / 1e3:.1f} kB); {large['objects']} objects, "
          f"{large['stored_bytes'] / 1e3:.1f} kB stored, for the larger")  # fmt: skip
    margin: dict[str, Any] = {}
    for phase in ("write", "read"):
        a, b = small[phase], large[phase]
        per_chunk = (b["total"] - a["total"]) / extra
        print(f"  {phase}: {b['total']} requests for {large['chunks']} chunks; {per_chunk:.2f} per extra chunk")
        print(f"    {'kind':12s} {'requests':>8s} {'/chunk':>7s} {'up kB/chunk':>12s} {'down kB/chunk':>14s}")
        rows = {}
        for kind in sorted(set(a["by_kind"]) | set(b["by_kind"])):
            n = (b["by_kind"].get(kind, 0) - a["by_kind"].get(kind, 0)) / extra
            up = (b["body_up"].get(kind, 0) - a["body_up"].get(kind, 0)) / extra / 1e3
            down = (b["body_down"].get(kind, 0) - a["body_down"].get(kind, 0)) / extra / 1e3
            rows[kind] = {"per_chunk": n, "up_kb": up, "down_kb": down}
            print(f"    {kind:12s} {b['by_kind'].get(kind, 0):8d} {n:7.2f} {up:12.2f} {down:14.2f}")
        margin[phase] = {"per_chunk": per_chunk, "by_kind": rows}
    return margin


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=128, help="samples of the smaller job of part 1 (the larger: 4x)")
    p.add_argument("--chunk-size", type=int, default=16, help="its chunk size")
    p.add_argument("--chunk-mib", type=float, nargs="+", default=[16, 1], help="chunk sizes of part 2")
    p.add_argument("--chunks", type=int, default=16, help="chunks written and read per repeat (part 2)")
    p.add_argument("--threads", type=int, nargs="+", default=[2, 8], help="writer threads (CPU default 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    server, endpoint = start_server()
    try:
        small = requests_per_chunk(endpoint, args.samples, args.chunk_size)
        large = requests_per_chunk(endpoint, 4 * args.samples, args.chunk_size)
        margin = show_counts(small, large)
        rates = []
        print(f"\nthroughput, MB/s of feature bytes (median of {args.repeats}), extract / plain obstore:")
        for mib in args.chunk_mib:
            for threads in args.threads:
                r = throughput(endpoint, mib, args.chunks, threads, args.repeats)
                rates.append(r)
                m = r["mb_per_s"]
                print(f"  {r['chunk_mib']:5.1f} MiB chunks x {r['chunks']}, {threads} threads: write "
                      f"{m['write extract']:6.1f} vs plain {m['write plain']:6.1f} ({r['write_ratio']:.2f}x); read {m['read extract']:6.1f}, again "
                      f"{m['read extract again']:6.1f}, again as float32 {m['read extract f32']:6.1f} vs plain "
                      f"{m['read plain']:6.1f} ({r['read_ratio']:.2f}x; {r['read_concurrency']} at once)", flush=True)  # fmt: skip
    finally:
        server.kill()
        server.wait()
    result = {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "counts": [small, large], "per_chunk": margin, "throughput": rates,
    }  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
