"""``TokenStream`` on object storage (issue 37): the window's chunk objects fetched one zarr read a chunk
by the stream's 2 threads (``per_chunk``, as before), against all fetched at once (``prefetch``,
``extract/read/prefetch.py``).

A token store of one layer of float16 rows (``--megabytes``, D=768, the job's default chunk size and
``--compressor``: ``none``, a token store's default), written locally through ``FeatureStore`` as
``benchmarks/token_stream.py`` writes it, uploaded to moto's S3 server (``python -m moto.server`` in a
process of its own on 127.0.0.1, so that its CPU is not the stream's). Then one epoch of
``TokenStream(url, layer, batch_size, window=window, threads=2, dtype=float16)`` per variant, interleaved,
median of ``--repeats``:

- straight to moto on loopback (a round trip of well under a millisecond), and
- through a proxy (a process of its own) that delays every piece a client sends by ``--latency-ms``
  before the server gets it, so that each request waits that long for its answer, as S3's first byte does
  (the answer itself is not delayed), and
- through one that does the same and also sends each connection's answers at ``--connection-mb-s`` at
  most, as S3 serves one connection (obstore opens a connection per request in flight): the S3-like case.

GB/s are of stored float16 bytes delivered (1 GB = 1e9 B); CPU-s/GB is of this process (every thread:
the stream's, zarr's, obstore's), not of the server or the proxy.

    python benchmarks/stream_s3.py [--megabytes 80] [--latency-ms 25] [--connection-mb-s 90] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import zarr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from s3_requests import BUCKET, free_port, point_at, start_server  # noqa: E402
from token_stream import CONTEXT, LAYER, timed, token_store  # noqa: E402

from extract.job.plan import MAX_TOKEN_CHUNK_SIZE, default_chunk_size  # noqa: E402
from extract.read import prefetch  # noqa: E402
from extract.read.tokens import TokenStream  # noqa: E402
from extract.store.chunks import Plan  # noqa: E402


async def _delaying_proxy(listen: int, upstream: int, delay: float, rate: float) -> None:
    """Forward 127.0.0.1:``listen`` to 127.0.0.1:``upstream``: what a client sends reaches the server
    ``delay`` seconds later (in order, each piece on its own clock, so a long upload is not slowed), and
    what the server answers reaches the client at ``rate`` bytes a second at most per connection (0: as
    fast as it comes)."""
    loop = asyncio.get_running_loop()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, late: float, rate: float) -> None:
        pieces: asyncio.Queue = asyncio.Queue()
        free = loop.time()  # when the connection has sent what it was given, at ``rate``

        async def deliver() -> None:
            while (piece := await pieces.get()) is not None:
                due, data = piece
                await asyncio.sleep(max(0.0, due - loop.time()))
                writer.write(data)
                await writer.drain()
            writer.close()

        delivering = asyncio.create_task(deliver())
        try:
            while data := await reader.read(1 << 16):
                if rate:
                    free = max(free, loop.time()) + len(data) / rate
                await pieces.put((free if rate else loop.time() + late, data))
        except ConnectionError:
            pass
        await pieces.put(None)
        await delivering

    async def connect(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", upstream)
        await asyncio.gather(
            pipe(client_reader, server_writer, delay, 0.0),
            pipe(server_reader, client_writer, 0.0, rate),
            return_exceptions=True,
        )

    server = await asyncio.start_server(connect, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


def start_proxy(upstream: str, delay_ms: float, mb_per_s: float = 0) -> tuple[subprocess.Popen, str]:
    """The delaying proxy in front of ``upstream`` (http://127.0.0.1:PORT), in a process of its own."""
    port = free_port()
    proxy = subprocess.Popen(
        [sys.executable, __file__, "--proxy", str(port), upstream.rpartition(":")[2], str(delay_ms), str(mb_per_s)],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            with __import__("socket").create_connection(("127.0.0.1", port), timeout=1):
                return proxy, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proxy.kill()
    raise SystemExit("the proxy did not start")


def upload(endpoint: str, local: Path, prefix: str) -> str:
    """Every file of the store at ``local`` under ``prefix`` of the bucket; the store's URL."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip
    for file in sorted(local.rglob("*")):
        if file.is_file():
            client.upload_file(str(file), BUCKET, f"{prefix}/{file.relative_to(local)}")
    return f"s3://{BUCKET}/{prefix}"


@contextmanager
def per_chunk_reads() -> Iterator[None]:
    """The stream as before: no array is prefetched, each chunk is one zarr read on a stream thread."""
    original = prefetch.prefetchable
    prefetch.prefetchable = lambda array: False
    try:
        yield
    finally:
        prefetch.prefetchable = original


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=80, help="raw float16 size of the layer (default 80)")
    p.add_argument("--dim", type=int, default=768, help="D, values per token (default 768)")
    p.add_argument("--compressor", default="none", help="the store's --compressor (default none)")
    p.add_argument("--batch-size", type=int, default=4096, help="tokens per batch (default 4096)")
    p.add_argument("--window", type=int, default=8, help="TokenStream window, chunks (default 8)")
    p.add_argument("--latency-ms", type=float, default=25, help="the proxy's delay per request (default 25)")
    p.add_argument("--repeats", type=int, default=3, help="timed epochs per variant, median reported (default 3)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--connection-mb-s", type=float, default=90, help="the S3-like proxy's cap per connection, MB/s (default 90)"
    )
    p.add_argument("--proxy", nargs=4, metavar=("LISTEN", "UPSTREAM", "DELAY_MS", "MB_S"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.proxy:
        listen, upstream, delay_ms, mb_per_s = args.proxy
        asyncio.run(_delaying_proxy(int(listen), int(upstream), float(delay_ms) / 1000, float(mb_per_s) * 1e6))
        return 0

    load_before = round(os.getloadavg()[0], 2)
    server, endpoint = start_server()
    delaying, delayed = start_proxy(endpoint, args.latency_ms)
    capping, capped = start_proxy(endpoint, args.latency_ms, args.connection_mb_s)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            row_bytes = args.dim * 2
            num_tokens = max(CONTEXT, int(args.megabytes * 1e6) // row_bytes // CONTEXT * CONTEXT)
            plan = Plan(num_tokens, default_chunk_size(num_tokens, row_bytes, largest=MAX_TOKEN_CHUNK_SIZE))
            token_ids = np.random.default_rng(0).integers(1, 50000, num_tokens, dtype=np.int32)
            local = Path(tmp) / "tokens.zarr"
            token_store(local, plan, args.dim, token_ids, np.zeros(num_tokens, bool), [LAYER], 0, "float16",
                        compressor=args.compressor)  # fmt: skip
            url = upload(endpoint, local, f"s3stream-{uuid.uuid4().hex[:8]}/tokens.zarr")
        epochs = iter(range(10**6))
        variants: dict[str, Callable[[], None]] = {}
        places = {
            "loopback": endpoint,
            f"+{args.latency_ms:g} ms": delayed,
            f"+{args.latency_ms:g} ms, {args.connection_mb_s:g} MB/s": capped,
        }
        for place, at in places.items():
            point_at(at)  # the streams made now open their stores through ``at``
            for name, reads in (("per_chunk", per_chunk_reads), ("prefetch", None)):
                stream = TokenStream(url, LAYER, args.batch_size, window=args.window, threads=2, dtype="float16")

                def epoch(stream: TokenStream = stream, reads: Callable | None = reads) -> None:
                    stream.set_epoch(next(epochs))
                    with reads() if reads is not None else _nothing():
                        assert sum(len(batch) for batch in stream) == num_tokens

                variants[f"{place} {name}"] = epoch
        seconds, cpu = timed(variants, args.repeats)
    finally:
        for process in (capping, delaying, server):
            process.kill()
    nbytes = num_tokens * row_bytes
    rates = {name: nbytes / s / 1e9 for name, s in seconds.items()}
    cpu_per_gb = {name: c / (nbytes / 1e9) for name, c in cpu.items()}
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "versions": {"zarr": zarr.__version__, "obstore": _version("obstore"), "moto": _version("moto")},
        "load_average_1min": {"before": load_before, "after": round(os.getloadavg()[0], 2)},
        "num_tokens": num_tokens,
        "dim": args.dim,
        "chunk_size": plan.chunk_size,
        "chunks": plan.num_chunks,
        "compressor": args.compressor,
        "bytes": nbytes,
        "batch_size": args.batch_size,
        "window": args.window,
        "latency_ms": args.latency_ms,
        "connection_mb_s": args.connection_mb_s,
        "repeats": args.repeats,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "gb_per_s": {k: round(v, 3) for k, v in rates.items()},
        "cpu_seconds_per_gb": {k: round(v, 3) for k, v in cpu_per_gb.items()},
    }
    print(
        f"{num_tokens} tokens x {args.dim} float16 ({nbytes / 1e6:.0f} MB), {plan.num_chunks} chunks of "
        f"{plan.chunk_size} ({plan.chunk_size * row_bytes / 1e6:.1f} MB), --compressor {args.compressor}, "
        f"batch {args.batch_size}, window {args.window}, threads 2"
    )
    print(f"{'variant':<34} {'seconds':>8} {'GB/s':>7} {'CPU-s/GB':>9}")
    for name, s in seconds.items():
        print(f"{name:<34} {s:>8.3f} {rates[name]:>7.3f} {cpu_per_gb[name]:>9.3f}")
    print(f"1-min load average {load_before} -> {result['load_average_1min']['after']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
