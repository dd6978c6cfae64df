"""The errors ``extract`` raises: one base the command lines turn into one line and exit status 2 (its
``exit_code``), and typed subclasses that also derive from the builtin a Python user expects (zarr's
``errors.py`` does the same), so that callers catch types, not message strings.

What a library caller must tell apart has a type of its own:

- the request is bad (an option, a layer, a pool, an index; fix the arguments): ``InvalidRequestError``,
  a ``ValueError``, and its subclasses (``LayerNotFoundError`` is also a ``KeyError``, ``SampleIndexError``
  an ``IndexError``);
- another job holds the store: ``StoreBusyError``, a ``BlockingIOError`` (what ``fcntl.flock`` raises for a
  lock another process holds);
- the store holds a different job: ``StoreMismatchError``, a ``FileExistsError`` (as ``open(path, "x")``
  raises: something is at the path, and only ``--overwrite`` replaces it);
- the store is damaged, edited or unfinished: ``StoreDamagedError``, a ``ValueError`` (as zarr raises for
  metadata or a checksum that do not validate).

Besides the errors, the two exceptions that end a run, ``Interrupted`` and ``PeerStopped`` (each a
``BaseException``, like ``KeyboardInterrupt``), and the signal ``StopForward`` live here. Two stay beside the
code that raises and catches them, since no caller ever meets them: ``ChecksumMismatch`` (``read/direct.py``)
and ``Misplaced`` (``read/placed.py``). Each is a ``ValueError`` as zarr's checksum codec raises, so that the
checked reads take them with zarr's own and turn them into a ``StoreDamagedError`` naming the chunk."""

import signal


class ExtractError(Exception):
    """Bad input or environment: the message names the culprit and the fix."""

    exit_code = 2  # the command's exit status
    quiet = False  # another process of the job prints the message (one line for the job, not one a rank)
    alone = False  # this process met it alone (a rank's own chunk), so it speaks even if others are quiet


class ProcessGroupError(ExtractError):
    """The processes of a launched job could not connect to each other; exit status 1, since it is not
    the arguments but the machine (another job, or leftover processes, on the same port) that is wrong."""

    exit_code = 1


class InvalidRequestError(ExtractError, ValueError):
    """The request is bad: an option, a layer, a pool or an index that the model, the data or the store
    cannot serve; the message names it and the values there are. Fix the arguments and ask again."""


class LayerNotFoundError(InvalidRequestError, KeyError):
    """A layer name or glob that matches no module of the model, or no layer of a store."""

    def __str__(self) -> str:  # KeyError's own str() would quote the message
        return str(self.args[0]) if self.args else ""


class StoreNotFoundError(ExtractError, FileNotFoundError):
    """No store at the path given."""


class SampleIndexError(InvalidRequestError, IndexError):
    """An index into a store's samples that is out of range or of the wrong shape."""


class StoreBusyError(ExtractError, BlockingIOError):
    """Another job holds the store's lock: wait for it, or stop it. A ``BlockingIOError``, as
    ``fcntl.flock`` raises for a lock another process holds."""


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


class StoreMismatchError(ExtractError, FileExistsError):
    """The store at ``--out`` holds a different job (another model, data or layers, or the same job
    batched otherwise, which would round differently): pass ``--overwrite`` to replace it, or choose
    another ``--out``. A ``FileExistsError``, as ``open(path, "x")`` raises for a path already taken."""


class StoreDamagedError(ExtractError, ValueError):
    """A store whose metadata or objects are damaged, edited or unfinished; the message says how to
    repair it (``python -m extract.verify --repair``, a rerun, or ``--overwrite``). A ``ValueError``, as
    zarr raises for metadata or a checksum that do not validate."""


class LocationError(InvalidRequestError):
    """A store argument that is neither a local path nor a store URL this version can open."""


class ObjectStorageMissing(ExtractError, ImportError):
    """A store URL was given but the ``s3`` extra (obstore) is not installed."""


class ForkedAfterObjectStorageError(ExtractError, RuntimeError):
    """Object storage was used in a process forked from one that had used it: obstore's runtime does
    not survive ``fork`` (its first request would hang), so the use is refused instead."""


class LockUnavailable(ExtractError):
    """The lock cannot be created at all (read-only filesystem, no permission): nothing can be written."""


class WriterError(ExtractError, RuntimeError):
    """The writer failed; the run stops with the cause attached. Exit status 1: not bad input (the
    command line says it with what a rerun does: ``extract.cli.extract``)."""

    exit_code = 1


class CastOverflowError(ExtractError, OverflowError):
    """A layer's values that the cast to the storage dtype would turn into inf (beyond float16's 65504):
    the job stops instead of storing them, naming the layer, the largest |x| and the dtypes that hold it.
    Exit status 2: the command line's ``--dtype`` does not fit the model."""


class PoolShapeError(InvalidRequestError):
    """A ``--pool`` (or a reader's ``pool=``) that does not fit an output's shape or layout; ``for_layer``
    says it for the layer of the command line."""

    def __init__(self, pool: str, shape: tuple[int, ...], wanted: str, instead: str) -> None:
        from .names.layers import shape_text  # names imports errors: here, not at the top

        self.pool, self.shape, self.wanted, self.instead = pool, shape, wanted, instead
        super().__init__(
            f"--pool {pool} needs a {wanted} output but got shape {shape_text(shape)}; use --pool {instead}"
        )

    def for_layer(self, layer: str) -> InvalidRequestError:
        from .names.layers import shape_text

        if self.wanted == "known layout":
            return InvalidRequestError(
                f"--pool {self.pool} cannot tell which axes of layer '{layer}' {shape_text(self.shape, self.shape[0])} "
                f"are spatial; say it with --layout {layer}=NCHW or --layout {layer}=NHWC"
            )
        return InvalidRequestError(
            f"--pool {self.pool} does not fit layer '{layer}': it needs a {self.wanted} output, "
            f"the layer gives {shape_text(self.shape, self.shape[0])}; use --pool {self.instead} for this layer"
        )


class PoolMismatchError(InvalidRequestError):
    """A ``pool=`` that does not fit the stored layer's shape."""


class TextShapeError(InvalidRequestError):
    """A layer whose output is not one row per token of the batch (a pooler, a classifier head)."""

    def __init__(self, shape: tuple[int, ...], batch: tuple[int, int]) -> None:
        self.shape, self.batch = shape, batch
        super().__init__(f"gives shape {shape} for a batch of {batch[0]} sequences of {batch[1]} tokens")

    def for_layer(self, layer: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"layer '{layer}' {self.args[0]}: not one row per token (B, T, ...); pick a layer inside the "
            "model's blocks (see --list-layers)"
        )


class ExcludeRuleError(InvalidRequestError):
    """An ``exclude`` rule of ``TokenStream`` that is not one of the forms it knows."""


class UnalignedStoresError(InvalidRequestError):
    """Stores given to ``TokenStream`` together whose rows are not the same tokens (another tokenizer,
    corpus, packing or chunking)."""


class UnusableLayerError(ExtractError):
    """One layer of a store cannot be read as asked (a pool that does not fit it, a damaged object,
    a size that differs between two stores): the commands skip it with a note and go on."""

    def __init__(self, store: object, layer: str, reason: str) -> None:
        self.store, self.layer, self.reason = store, layer, reason
        super().__init__(f"layer '{layer}' of {store} cannot be used: {reason}")

    @property
    def note(self) -> str:
        return f"skipped layer '{self.layer}' of {self.store}: {self.reason}"


class SaeMissingError(ExtractError, ImportError):
    """``--sae`` was given but sae_lens (the ``sae`` extra) is not installed."""


class SaeNotFoundError(ExtractError, FileNotFoundError):
    """An ``--sae`` path that is not a directory in SAELens's saved format (``cfg.json`` beside
    ``sae_weights.safetensors``): the message names the file that is missing."""


class SaeMismatchError(InvalidRequestError):
    """An SAE that does not fit the layer it was given for (its ``d_in`` against the layer's width, its
    hook name against the layer), or a saved SAE this version cannot encode with exactly (an unknown
    architecture, a normalization whose statistics are not in the directory, a single attention head)."""


class SaeInvalidError(ExtractError, ValueError):
    """An ``--sae`` directory whose files are not what SAELens saves, found before anything loads: a
    ``cfg.json`` that is not a JSON object or asks a ``k`` outside 1..``d_sae``, a weights file that is torn
    or not safetensors, or weights whose shapes are not the config's."""


class ExportError(InvalidRequestError):
    """A store that cannot be exported as asked, or a destination that must not be written."""


def rebuilt(kind: type[ExtractError], message: str) -> ExtractError:
    """An error of ``kind`` with ``message``: a rank told of rank 0's error raises the same type, or, for
    a type whose constructor takes other arguments, the nearest of its bases that takes a message (a
    ``PoolShapeError`` is still an ``InvalidRequestError`` there)."""
    for base in kind.__mro__:
        if not issubclass(base, ExtractError):
            continue
        try:
            return base(message)
        except TypeError:  # a subclass whose constructor takes other arguments
            continue
    return ExtractError(message)


class Interrupted(BaseException):
    """The run stopped on a signal; finished chunks are marked done and a rerun resumes. A
    BaseException, like KeyboardInterrupt: it may be raised inside a user's factory or a library
    during start-up, and no ``except Exception`` there may turn a stop request into an error."""

    def __init__(self, signum: int, chunks_written: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        self.chunks_written = chunks_written  # the whole job's, once the store's owner has counted them
        self.this_run: int | None = None  # of those, written by this run (set with the job's count)
        self.num_chunks: int | None = None  # the job's chunks
        self.quiet = False  # ranks other than 0 stay silent: rank 0 reports for the job
        super().__init__(signum, chunks_written)

    def progress(self) -> str:
        """``N chunks written and marked done``, with what is left of the job once the store was counted."""
        done = f"{self.chunks_written} chunk{'s' if self.chunks_written != 1 else ''} written and marked done"
        if self.num_chunks is None or self.this_run is None:
            return done
        return f"{done}, {self.num_chunks - self.chunks_written} of {self.num_chunks} left (this run wrote {self.this_run})"

    def __str__(self) -> str:
        return f"interrupted by {signal.Signals(self.signum).name}: {self.progress()}; rerun the same command to resume"


class PeerStopped(Interrupted):
    """Another process of the job stopped (a signal, a crash) while this one waited for it at a barrier."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(signal.SIGTERM, 0)
        self.exit_code = 1
        self.cause = (str(cause).strip().splitlines() or [type(cause).__name__])[0]

    def __str__(self) -> str:
        return f"another process of the job stopped ({self.cause}); {self.progress()}; rerun the same command to resume"


class StopForward(Exception):
    """Raised once every requested layer has fired; ``Capture`` swallows it. Not an ``ExtractError``: it
    is no failure but the signal that ends a forward early, and a caller's ``except ExtractError`` must
    not take it."""
