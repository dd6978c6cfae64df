"""Where a store lives: a local path, or a URL on object storage (``s3://``, ``gs://``, ``az://``).

``--out`` and every command that takes a store take either. A URL names a bucket (a container on
Azure) and a key prefix ending in the store's name, ``s3://bucket/some/prefix/name.zarr``, or a store
at the bucket's top, ``s3://bucket/name.zarr``; the store's lock is the object ``name.zarr.lock``
beside it (same bucket, the store's key plus ``.lock``; at the top of the bucket for a store there),
as on disk, so that it exists before the store does. A bare bucket is not a store.

Object storage goes through zarr's own ``zarr.storage.ObjectStore`` over ``obstore`` (the ``s3``
extra), not ``FsspecStore`` over ``s3fs``:

- obstore exposes conditional writes natively: ``put(..., mode="create")`` is ``If-None-Match: *`` and
  ``mode={"e_tag": ...}`` is ``If-Match``, with typed errors (``AlreadyExistsError``,
  ``PreconditionError``) for a failed precondition. The lock (``object_lock.py``) is made of exactly
  these; s3fs has no conditional replace (``If-Match``) in its API, and its create-if-absent is an
  S3-only extra argument.
- one Rust client (the ``object_store`` crate) for S3, GCS and Azure, with the same conditional
  semantics, credentials from each cloud's usual environment, and retries with backoff built in;
  s3fs, gcsfs and adlfs are three libraries with three behaviours.
- zarr's ``ObjectStore`` wraps obstore directly, and concurrent reads and writes are async in Rust,
  not in fsspec's event-loop thread.

Credentials, region and endpoint come from the environment obstore reads (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ...;
``GOOGLE_*``; ``AZURE_*``). Two additions: ``AWS_DEFAULT_REGION`` is used where ``AWS_REGION`` is not
set, and an ``http://`` S3 endpoint (a local S3-compatible server such as moto or MinIO) is allowed
without also setting ``AWS_ALLOW_HTTP``: naming a plain-HTTP endpoint is the user's choice of it.

Transient errors (5xx, connection errors and resets, timeouts) are retried by obstore with
exponential backoff and jitter, ``RETRIES`` times at most and for ``EXTRACT_OBJECT_RETRY_TIMEOUT``
seconds at most (``RETRY_TIMEOUT`` by default); after that the request's error reaches the caller.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..errors import (
    ForkedAfterObjectStorageError,
    LocationError,
    ObjectStorageError,
    ObjectStorageMissing,
)

if TYPE_CHECKING:
    from zarr.abc.store import Store

INSTALL = "pip install 'extract[s3]'"
# The schemes a store URL may have, and the cloud each is (obstore's own names for the Azure ones).
SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "az": "azure", "azure": "azure", "abfs": "azure", "abfss": "azure"}
RETRIES = 10
RETRY_TIMEOUT = 120.0  # seconds from a request's first try after which no more retries are made
RETRY_TIMEOUT_VARIABLE = "EXTRACT_OBJECT_RETRY_TIMEOUT"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
_ENV_PREFIX = {"s3": "AWS", "gcs": "GOOGLE", "azure": "AZURE"}
# obstore's ClientConfig keys that take a string (the environment's values are strings).
_CLIENT_KEYS = (
    "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type", "http1_only",
    "http2_keep_alive_interval", "http2_keep_alive_timeout", "http2_keep_alive_while_idle", "http2_only",
    "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url", "proxy_ca_certificate", "proxy_excludes",
    "randomize_addresses", "read_timeout", "timeout", "user_agent",
)  # fmt: skip


def is_url(text: str | os.PathLike[str]) -> bool:
    """Whether ``text`` is a URL (``scheme://...``) rather than a local path. A Windows drive path
    (``C:\\x``) and a relative path with a colon in it are paths."""
    return isinstance(text, str) and _URL.match(text) is not None


@dataclass(frozen=True)
class Location:
    """A parsed store argument: ``path`` for a local store, or ``url`` (normalized: no trailing slash)
    with its ``scheme``, ``bucket`` and ``key`` (the store's prefix inside the bucket)."""

    path: Path | None = None
    url: str | None = None
    scheme: str | None = None  # as given: s3, gs, az, ...
    bucket: str | None = None  # the container on Azure; with ``abfs://`` the URL's authority
    key: str | None = None

    @property
    def remote(self) -> bool:
        return self.url is not None

    @property
    def name(self) -> str:
        """The store's own name, the last part of its path or key (``name.zarr``)."""
        if self.path is not None:
            return self.path.name
        assert self.key is not None
        return self.key.rpartition("/")[2]

    @property
    def parent_url(self) -> str:
        """The URL of the prefix the store lives in (where its lock lives too): the bucket itself,
        ``s3://bucket``, for a store at the bucket's top (``s3://bucket/name.zarr``)."""
        assert self.url is not None and self.key is not None
        parent = self.key.rpartition("/")[0]
        return f"{self.scheme}://{self.bucket}" + (f"/{parent}" if parent else "")

    @property
    def place(self) -> Path | str:
        """The path, or the URL: how the store is named in messages (and ``Features.path``)."""
        return self.url if self.url is not None else self.path  # type: ignore[return-value]

    @property
    def lock(self) -> str:
        """Where the store's lock is: ``<path>.lock`` or ``<url>.lock`` beside the store."""
        return f"{self.url}.lock" if self.url is not None else str(self.path) + ".lock"

    def __str__(self) -> str:
        return self.url if self.url is not None else str(self.path)


def parse(text: str | os.PathLike[str]) -> Location:
    """The location ``text`` names: a local path, or a store URL checked here so that a typo is one
    line now rather than a request error later."""
    return _parse(text, store=True)


def locate(where: str | os.PathLike[str] | Location) -> Location:
    """``where`` as a ``Location``: parsed where a path or URL first enters, passed on as it is after."""
    return where if isinstance(where, Location) else parse(where)


def _parse(text: str | os.PathLike[str], *, store: bool) -> Location:
    """``parse``; ``store=False`` for a prefix that holds stores, not a store (where their locks are):
    that may be a whole bucket, whose key is then empty."""
    if not is_url(text):
        return Location(path=Path(text))
    assert isinstance(text, str)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in ("s3", "gs", "az", "abfs"))
        raise LocationError(f"store {text!r}: unsupported scheme {scheme}://; use a local path or one of {known}")
    if parts.query or parts.fragment:
        raise LocationError(f"store {text!r}: a store URL takes no ?query or #fragment")
    if not parts.netloc:
        raise LocationError(f"store {text!r} names no bucket; write {scheme}://BUCKET/PREFIX/NAME.zarr")
    key = parts.path.strip("/")
    if not key and not store:
        return Location(url=f"{scheme}://{parts.netloc}", scheme=scheme, bucket=parts.netloc, key="")
    if not key:
        raise LocationError(
            f"store {text!r} is a whole bucket; name the store inside it: {scheme}://{parts.netloc}/NAME.zarr"
        )
    segments = key.split("/")
    if any(s in ("", ".", "..") for s in segments):
        raise LocationError(f"store {text!r}: its key {key!r} has an empty, '.' or '..' part")
    return Location(url=f"{scheme}://{parts.netloc}/{key}", scheme=scheme, bucket=parts.netloc, key=key)


def _retry_timeout() -> float:
    from .held_lock import seconds_setting  # the lock's own settings are read the same way

    return seconds_setting(RETRY_TIMEOUT_VARIABLE, RETRY_TIMEOUT)


def retry_config(timeout: float | None = None) -> dict[str, Any]:
    """obstore's retry configuration: exponential backoff with jitter from 100 ms, each wait capped at
    5 s (an outage longer than a request is worth waiting through is the caller's to report), ``RETRIES``
    tries and ``timeout`` seconds (``EXTRACT_OBJECT_RETRY_TIMEOUT``, ``RETRY_TIMEOUT``) at most."""
    seconds = _retry_timeout() if timeout is None else timeout
    backoff = {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5), "base": 2}
    return {"max_retries": RETRIES, "backoff": backoff, "retry_timeout": timedelta(seconds=seconds)}


def _env_client_options(cloud: str) -> dict[str, Any]:
    """The HTTP client options set in the environment (``AWS_ALLOW_HTTP``, ``AWS_TIMEOUT``, ...). obstore
    reads them itself, but only while no ``client_options`` are passed: passed ones replace them all."""
    prefix = _ENV_PREFIX[cloud]
    return {
        key: os.environ[f"{prefix}_{key.upper()}"] for key in _CLIENT_KEYS if f"{prefix}_{key.upper()}" in os.environ
    }


def _s3_options() -> tuple[dict[str, Any], dict[str, Any]]:
    """Config and client options for S3 beyond what obstore reads from the environment itself."""
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    if not os.environ.get("AWS_REGION") and os.environ.get("AWS_DEFAULT_REGION"):
        config["region"] = os.environ["AWS_DEFAULT_REGION"]
    endpoint = next((os.environ[v] for v in _ENDPOINT_VARIABLES if os.environ.get(v)), None)
    if endpoint is not None and endpoint.lower().startswith("http://") and "AWS_ALLOW_HTTP" not in os.environ:
        client["allow_http"] = True
    return config, client


_used_in: int | None = None  # the process whose obstore runtime is live (inherited by a fork)


def check_not_forked(location: Location) -> None:
    """Raise ``ForkedAfterObjectStorageError`` when ``location`` is on object storage and this process was
    forked from one that used it (a DataLoader worker started with ``fork``, Linux's default before
    Python 3.14). A path is never refused: only obstore's runtime is lost in a fork."""
    if location.url is not None:
        _check_not_forked(location.url)


def _check_not_forked(url: str) -> None:
    if _used_in is not None and _used_in != os.getpid():
        raise ForkedAfterObjectStorageError(
            f"{url}: this process was forked from one that had used object storage, and obstore cannot "
            "make requests after a fork; pass multiprocessing_context='spawn' (or 'forkserver') to the DataLoader"
        )


def object_store(url: str, *, retry_timeout: float | None = None, request_timeout: float | None = None) -> Any:
    """An ``obstore`` store rooted at ``url`` (its key is the store's prefix), configured from the
    environment, retrying transient errors (``retry_config``); ``request_timeout`` caps each try
    (obstore's default otherwise)."""
    global _used_in
    _check_not_forked(url)
    _used_in = _used_in or os.getpid()
    try:
        from obstore.store import from_url
    except ImportError:
        raise ObjectStorageMissing(f"{url} is on object storage, which needs obstore: {INSTALL}") from None
    location = _parse(url, store=False)  # the prefix of a lock may be a whole bucket
    assert location.scheme is not None
    cloud = SCHEMES[location.scheme]
    config, client = _s3_options() if cloud == "s3" else ({}, {})
    if request_timeout is not None:
        client["timeout"] = timedelta(seconds=request_timeout)
    if client:
        client = {**_env_client_options(cloud), **client}
    try:
        return from_url(
            url, config=config or None, client_options=client or None, retry_config=retry_config(retry_timeout)
        )
    except Exception as e:  # obstore's configuration errors: an unknown key, a malformed URL
        hint = ""
        if cloud == "azure" and "Account must be specified" in str(e):
            hint = "; set AZURE_STORAGE_ACCOUNT_NAME, or write abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/..."
        raise LocationError(f"store {url}: {one_line(e)}{hint}") from None


def open_store(text: str | os.PathLike[str] | Location, *, read_only: bool = False) -> Store:
    """The zarr store for a store argument: ``LocalStore`` for a path, ``ObjectStore`` over obstore for
    a URL. A writable one caps each request, and its retries, at a third of the lock's stale age each
    (``write_timeout``)."""
    location = locate(text)
    if location.path is not None:
        from zarr.storage import LocalStore

        return LocalStore(location.path, read_only=read_only)
    assert location.url is not None
    timeout = None if read_only else write_timeout()
    inner = object_store(location.url, retry_timeout=timeout, request_timeout=timeout)
    from zarr.storage import ObjectStore

    return ObjectStore(inner, read_only=read_only)


def write_timeout() -> float:
    """The cap on a write's tries (``EXTRACT_OBJECT_RETRY_TIMEOUT``), and on each try, of a job: at most
    a third of the lock's stale age. A job's write is checked against the store's writer before its
    first try (``fence.py``), so its last try must end before another job could take the store over
    (the stale age after the job's last heartbeat): a write held up in an outage then never lands in
    the next job's store. For longer outages, raise ``EXTRACT_LOCK_STALE_AFTER`` too."""
    from .held_lock import timings

    return min(_retry_timeout(), max(5.0, timings()[1] / 3))


def lock_object(location: Location, *, timeout: float | None = None) -> tuple[Any, str]:
    """The obstore store of the prefix a remote store lives in (the bucket itself for a store at its
    top), and the key of its lock there (``name.zarr.lock``); ``timeout`` caps each request's tries and
    its retries, each."""
    assert location.url is not None, "a local store's lock is a file (lock.py)"
    store = object_store(location.parent_url, retry_timeout=timeout, request_timeout=timeout)
    return store, location.name + ".lock"


def one_line(error: BaseException) -> str:
    """The first line of an obstore error (they carry a multi-line debug dump of the request), with the
    operating system's reason from the dump when the first line hides it ("error sending request")."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    reasons = re.findall(r'message: "([^"\n]+)"', text)
    return f"{first} ({reasons[-1]})" if reasons and reasons[-1] not in first else first


def described(error: BaseException) -> str:
    """obstore's ``error`` in one line, said to be object storage's (the request, its object, the reason)."""
    return f"object storage: {one_line(error)}"


def storage_error(where: str, error: BaseException) -> ObjectStorageError:
    """obstore's ``error`` (an outage past the retries, a refused credential) as extract's, naming ``where``."""
    return ObjectStorageError(f"{where}: {described(error)}")


@contextmanager
def storage_errors(where: str | Location) -> Iterator[None]:
    """Raise obstore's errors met in the block as ``ObjectStorageError``s naming ``where``; others pass."""
    try:
        yield
    except Exception as e:
        if not from_object_storage(e):
            raise
        raise storage_error(str(where), e) from None


def from_object_storage(error: BaseException) -> bool:
    """Whether ``error`` is obstore's: a request that failed past its retries, a refused credential.
    Told by its module, so that a command on local stores never imports obstore to ask."""
    return type(error).__module__.startswith("obstore")
