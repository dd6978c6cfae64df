"""Where a store is made: the checks of ``--out`` (on disk and on object storage) before any compute,
the root metadata read there, and the scratch a creation on disk builds beside its target and renames
into place, so that a crash during creation never leaves half a store at ``--out``."""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ExtractError, InvalidRequestError, StoreDamagedError
from . import remote
from .arrays import METADATA
from .fence import ROOT_METADATA
from .location import open_store
from .schema import FORMAT, KNOWN_FORMAT_VERSIONS

SCRATCH = (".creating-", ".trash-", ".debris-")  # sibling directories of a store being built or deleted
DAMAGED = "extract.damaged_root"  # check_out_path's key for a store whose root metadata do not decode


def store_attrs(path: Path, damaged: bool = False) -> dict[str, Any] | None:
    """The attributes of the extract store at ``path``, or None; root metadata that do not decode are
    None too, or, with ``damaged``, a ``StoreDamagedError`` naming them."""
    meta = path / METADATA
    if not meta.is_file():
        return None
    try:
        data = meta.read_bytes()
    except OSError:
        data = b""  # unreadable: as damaged as undecodable
    return decoded_attrs(data, str(meta), damaged)


def decoded_attrs(data: bytes, where: str, damaged: bool) -> dict[str, Any] | None:
    """The attributes in root metadata ``data`` if they are an extract store's (see ``store_attrs``)."""
    try:
        attrs = json.loads(data).get("attributes", {})
        if not isinstance(attrs, dict):
            raise ValueError("attributes are not a mapping")
    except (ValueError, AttributeError):
        if damaged:
            raise StoreDamagedError(
                f"{where} does not decode as zarr metadata; rerun the job with --overwrite"
            ) from None
        return None
    return attrs if attrs.get("format") == FORMAT else None


def check_version(where: Path | str, attrs: dict[str, Any]) -> None:
    version = attrs.get("format_version")
    if version not in KNOWN_FORMAT_VERSIONS:
        raise StoreDamagedError(
            f"{where} has format_version {version!r}; this extract knows {', '.join(map(str, KNOWN_FORMAT_VERSIONS))} "
            "(a newer extract wrote it, or its zarr.json was edited)"
        )


def damaged_root(path: Path) -> str | None:
    """How the root ``zarr.json`` of what is recognisably an extract store at ``path`` is damaged (torn,
    garbage), or None: it decodes, or the directory is not recognisably a store, and then it is never
    replaced. Recognisable by its ``done`` and ``features`` metadata; not by a lock named for it alone,
    which the refused run itself would remove, so that the ``--overwrite`` it advises would be refused."""
    try:
        if isinstance(json.loads((path / "zarr.json").read_bytes()), dict):
            return None
        why = "it is not a JSON object"
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        why = f"it does not decode: {getattr(e, 'strerror', None) or type(e).__name__}"
    return why if all((path / name / "zarr.json").is_file() for name in ("done", "features")) else None


def real_path(path: Path) -> Path:
    """``path`` with its symbolic links resolved: a store reached through a link and by its own path is
    one store, with one lock. Where no link is involved, ``path`` as given, so messages keep its words."""
    real = path.resolve()
    return path if real == Path(os.path.abspath(path)) else real


def check_out_path(path: Path) -> dict[str, Any] | None:
    """Refuse an ``--out`` that cannot become a store, before any compute.

    Returns the attributes of an existing extract store there, or ``None`` when there is none yet.
    Whether an existing store can be written is decided later (a complete one on a read-only mount
    is fine: there is nothing to write).
    """
    if path.is_file():
        raise InvalidRequestError(f"--out {path} is a regular file, not a store; choose another --out")
    for above in Path(os.path.abspath(path)).parents:  # a store inside a store would become its member
        if store_attrs(above) is not None:
            raise InvalidRequestError(f"--out {path} is inside the extract store {above}; choose a path outside it")
    if path.is_dir():
        attrs = store_attrs(path)
        if attrs is None and (damage := damaged_root(path)) is not None:
            return {DAMAGED: damage}  # replaced with --overwrite, refused without: decided with the job
        if attrs is None and any(path.iterdir()):
            raise InvalidRequestError(
                f"--out {path} is a directory that is not an extract store; choose a new path (it is never overwritten)"
            )
        return attrs
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise InvalidRequestError(f"--out {path}: {parent} is a file, not a directory; choose another --out")
    check_writable(parent, f"--out {path}: cannot create it under {parent} (not writable)")
    return None


def check_out_url(url: str) -> dict[str, Any] | None:
    """``check_out_path`` for a store on object storage: the attributes of the store there, ``None`` when
    there is none yet (an empty prefix, or a store's debris: a creation or deletion that did not finish,
    which its lock's next holder deletes), or ``{DAMAGED: why}``. A prefix of other objects is refused."""
    found = remote.survey(open_store(url))
    attrs = None if found.root is None else decoded_attrs(found.root, f"{url}/{METADATA}", damaged=False)
    if attrs is not None:
        return attrs
    if found.root is not None and found.ours:
        return {DAMAGED: "it does not decode as an extract store's metadata"}
    if found.occupied and not found.ours:
        raise InvalidRequestError(
            f"--out {url} is a prefix of objects that are not an extract store; choose a new prefix "
            "(it is never overwritten)"
        )
    return None


def check_writable(directory: Path, problem: str) -> None:
    # os.access says yes to root even on a read-only filesystem; creating a file tells the truth.
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ExtractError(f"{problem} ({e.strerror}); choose another --out") from None


def move_into_place(scratch: Path, path: Path) -> None:
    """Rename ``scratch`` to ``path``, an absent path or an empty directory. A holder that lost its lock
    can still land the writes it checked a moment before the old store went aside (zarr has several in
    flight at once), and each makes the directories of its chunk again: debris without root metadata,
    which goes aside too, as often as such a write lands."""
    for attempt in itertools.count():
        try:
            os.rename(scratch, path)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or (path / ROOT_METADATA).exists() or attempt >= 100:
                raise
        debris = path.with_name(f".{path.name}.debris-{os.getpid()}-{attempt}")
        os.rename(path, debris)
        shutil.rmtree(debris, ignore_errors=True)


def sweep_scratch(path: Path) -> None:
    """Delete what a killed creation or overwrite left beside ``path``. Only the lock's holder calls this:
    nobody else can be building or deleting there."""
    for entry in path.parent.iterdir() if path.parent.is_dir() else []:
        if any(entry.name.startswith(f".{path.name}{kind}") for kind in SCRATCH):
            shutil.rmtree(entry, ignore_errors=True)
