"""The errors ``extract`` raises: one base the command lines turn into one line and exit status 2 (its
``exit_code``), and typed subclasses that also derive from the builtin a Python user expects (zarr's
``errors.py`` does the same), so that callers catch types, not message strings."""


class ExtractError(Exception):
    """Bad input or environment: the message names the culprit and the fix."""

    exit_code = 2  # the command's exit status
    quiet = False  # another process of the job prints the message (one line for the job, not one a rank)
    alone = False  # this process met it alone (a rank's own chunk), so it speaks even if others are quiet


class ProcessGroupError(ExtractError):
    """The processes of a launched job could not connect to each other; exit status 1, since it is not
    the arguments but the machine (another job, or leftover processes, on the same port) that is wrong."""

    exit_code = 1


class LayerNotFoundError(ExtractError, KeyError):
    """A layer name or glob that matches no module of the model, or no layer of a store."""

    def __str__(self) -> str:  # KeyError's own str() would quote the message
        return str(self.args[0]) if self.args else ""


class StoreNotFoundError(ExtractError, FileNotFoundError):
    """No store at the path given."""


class SampleIndexError(ExtractError, IndexError):
    """An index into a store's samples that is out of range or of the wrong shape."""


class StoreBusyError(ExtractError):
    """Another job holds the store's lock: wait for it, or stop it."""


class StoreBeingCreatedError(StoreNotFoundError, StoreBusyError):
    """No store at the path yet, but a live job holds its lock and is creating it (on disk it is built
    beside its target and renamed into place; on object storage its root metadata are written last):
    wait for the job, and read the store when it is done. Both a ``StoreNotFoundError`` (there is no
    store to read yet) and a ``StoreBusyError`` (a job holds it), so either ``except`` catches it."""


class LockLostError(ExtractError):
    """This job lost the store's lock (it was paused or stalled past the stale age and another job took
    the store, or the lock was removed): it stops and writes nothing more. Exit status 1: not bad input."""

    exit_code = 1


class ObjectStorageError(ExtractError):
    """A request to object storage failed past its retries (an outage, a refused credential); exit
    status 1: not bad input. Nothing was marked done that was not written; a rerun resumes."""

    exit_code = 1


class StoreDamagedError(ExtractError):
    """A store whose metadata or objects are damaged, edited or unfinished; the message says how to
    repair it (``python -m extract.verify --repair``, a rerun, or ``--overwrite``)."""


def rebuilt(kind: type[ExtractError], message: str) -> ExtractError:
    """An error of ``kind`` with ``message``: a rank told of rank 0's error raises the same type."""
    try:
        return kind(message)
    except TypeError:  # a subclass whose constructor takes other arguments
        return ExtractError(message)
