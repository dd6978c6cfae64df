"""A real S3 endpoint on loopback for the tests: moto's server mode (``moto.server.ThreadedMotoServer``)
started once per session in this process, one bucket, and a fresh prefix per test.

moto 5.2 honours ``If-None-Match: *`` and ``If-Match`` on PutObject (412 Precondition Failed; obstore
raises ``AlreadyExistsError`` and ``PreconditionError``), and ``If-Match`` on a missing key answers 404,
as S3 does (obstore: ``PreconditionError``). But it checks the precondition and then writes without a
lock, in a threaded server, where S3 makes the two one atomic step; so the fixture serializes moto's
conditional PutObject and DeleteObject, to test the lock against S3's semantics, not moto's race.

moto keeps its objects in memory: they last as long as the session's server.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

BUCKET = "extract-tests"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str

    def env(self) -> dict[str, str]:
        """The environment a client (this process's or a subprocess's) needs to reach the server."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    def client(self) -> Any:
        """A boto3 client of the server, for what obstore has no call for (buckets, raw listings)."""
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )  # fmt: skip


@dataclass
class S3Prefix:
    """A fresh prefix of the session's bucket, for one test; or, with ``prefix`` empty, the top of a
    fresh bucket of its own (``s3_top``)."""

    server: S3Server
    prefix: str  # no leading or trailing slash; empty: the bucket's top

    def url(self, name: str = "") -> str:
        """``s3://BUCKET/PREFIX/name`` (``s3://BUCKET/name`` at the bucket's top)."""
        return f"s3://{self.server.bucket}" + "".join(f"/{part}" for part in (self.prefix, name) if part)

    def key(self, name: str) -> str:
        """The bucket's key of ``name`` under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def keys(self) -> list[str]:
        """Every key under the prefix, relative to it."""
        client = self.server.client()
        start = self.prefix + "/" if self.prefix else ""
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.server.bucket, Prefix=start)
        return sorted(o["Key"][len(start) :] for page in pages for o in page.get("Contents", []))


def upload(s3: S3Prefix, local: Path, name: str) -> str:
    """Every file of the store at ``local`` as an object under ``s3``'s prefix; returns the store's URL."""
    client = s3.server.client()
    for file in sorted(local.rglob("*")):
        if file.is_file():
            client.upload_file(str(file), s3.server.bucket, f"{s3.prefix}/{name}/{file.relative_to(local)}")
    return s3.url(name)


def _atomic_conditional_writes() -> None:
    """Make moto's check of a PutObject's or DeleteObject's precondition and its write one step."""
    from moto.s3.responses import S3Response

    if getattr(S3Response, "_extract_atomic", False):
        return
    guard = threading.Lock()

    def atomic(method: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if "If-Match" in self.headers or "If-None-Match" in self.headers:
                with guard:
                    return method(self, *args, **kwargs)
            return method(self, *args, **kwargs)

        return call

    S3Response.put_object = atomic(S3Response.put_object)
    S3Response.delete_object = atomic(S3Response.delete_object)
    S3Response._extract_atomic = True


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 (a free port), with the tests' bucket."""
    pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (pip install 'extract[test]')")
    pytest.importorskip("obstore", reason="the S3 tests need obstore (pip install 'extract[s3]')")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line a request otherwise
    _atomic_conditional_writes()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(endpoint=f"http://{host}:{port}", bucket=BUCKET)
    s3.client().create_bucket(Bucket=BUCKET)
    try:
        yield s3
    finally:
        server.stop()


def _aimed(server: S3Server, patch: pytest.MonkeyPatch) -> S3Prefix:
    """A fresh prefix of the bucket, with this process's environment (through ``patch``) pointing obstore at
    ``server``."""
    for variable in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"):
        patch.delenv(variable, raising=False)
    for variable, value in server.env().items():
        patch.setenv(variable, value)
    return S3Prefix(server=server, prefix=f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Prefix:
    """A fresh prefix of the bucket, with this process's environment pointing obstore at the server."""
    return _aimed(s3_server, monkeypatch)


@pytest.fixture(scope="module", name="s3")
def s3_per_module(s3_server: S3Server) -> Iterator[S3Prefix]:
    """``s3`` for a whole module (imported by a test file whose stores are made once and read by many tests)."""
    with pytest.MonkeyPatch.context() as patch:
        yield _aimed(s3_server, patch)


@pytest.fixture
def s3_top(s3: S3Prefix) -> S3Prefix:
    """The top of a fresh bucket of its own (stores at ``s3://BUCKET/NAME.zarr``, their locks beside them
    at the top), with the environment of ``s3``."""
    bucket = f"top-{uuid.uuid4().hex[:12]}"
    s3.server.client().create_bucket(Bucket=bucket)
    return S3Prefix(server=S3Server(endpoint=s3.server.endpoint, bucket=bucket), prefix="")


def s3_server_or_none(request: pytest.FixtureRequest) -> S3Server | None:
    """The session's S3 server, for a fixture whose other jobs run without one: None where moto or obstore
    is not installed."""
    try:
        return request.getfixturevalue("s3_server")
    except pytest.skip.Exception:
        return None
