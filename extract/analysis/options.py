"""The analysis commands' options and their defaults, importing no torch, numpy or store: the
command lines read their defaults from here to build their parsers, so that ``extract probe --help``
(``report``, ``compare``) costs no library. The machinery (``probe.py``, ``report.py``, ``knn.py``,
``linear.py``, ``cka.py``) takes them from here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ExtractError

if TYPE_CHECKING:
    import torch

DEFAULT_K = 20  # k-NN: neighbours that vote (DINO's)
DEFAULT_TEMPERATURE = 0.07  # k-NN: vote weight exp(similarity / T) (DINO's)
DEFAULT_LRS = (0.01, 0.03, 0.1, 0.3)  # the mini-batch linear probe's learning rates, swept
MATCHES = ("keys", "rows")  # how CKA pairs two stores' samples

METHODS = ("linear", "knn")
SOLVERS = ("auto", "lbfgs", "sgd")
DEFAULT_MAX_FULL_BATCH_MIB = 1024
DEFAULT_TEST_FRACTION = 0.2


@dataclass(frozen=True)
class ProbeOptions:
    """How to probe each layer (the flags of ``python -m extract.probe``); checked when made.

    Which rows train and test (one store split by ``test_fraction``, or two stores) is not an
    option of the probe but of ``probe_layers``: ``probe_rows`` is given its rows."""

    method: str = "linear"  # linear | knn
    pool: str | None = None  # None: avg for maps, cls for tokens (``default_pool``)
    seed: int = 0  # of the split and of the mini-batch order
    device: str | torch.device | None = None  # k-NN and mini-batch training; None: a GPU if there is one
    # linear
    solver: str = "auto"  # lbfgs | sgd | auto: L-BFGS when the train set fits max_full_batch_mib
    max_full_batch_mib: float = DEFAULT_MAX_FULL_BATCH_MIB
    epochs: int | None = None  # None: 100 L-BFGS iterations, or 10 SGD passes
    lr: float = 1.0  # the L-BFGS step size
    weight_decay: float = 1e-3
    lrs: Sequence[float] = DEFAULT_LRS  # SGD learning rates, swept on a held-out 10% of the train set
    batch_size: int = 256
    num_workers: int = 0
    # knn
    k: int = DEFAULT_K
    temperature: float = DEFAULT_TEMPERATURE

    def __post_init__(self) -> None:
        object.__setattr__(self, "lrs", tuple(self.lrs))  # frozen means frozen: a caller's list may change
        if self.method not in METHODS:
            raise ExtractError(f"unknown --method '{self.method}'; choose one of {', '.join(METHODS)}")
        if self.solver not in SOLVERS:
            raise ExtractError(f"unknown --solver '{self.solver}'; choose one of {', '.join(SOLVERS)}")
        if self.k < 1 or self.temperature <= 0:
            raise ExtractError(f"--k must be positive and --temperature above 0; got {self.k} and {self.temperature}")
        if (self.epochs is not None and self.epochs < 1) or self.batch_size < 1 or self.num_workers < 0:
            raise ExtractError(
                "--epochs and --batch-size must be positive, --num-workers 0 or more; "
                f"got {self.epochs}, {self.batch_size}, {self.num_workers}"
            )


@dataclass(frozen=True)
class ReportConfig:
    """What the report shows and from how many samples (the flags of ``python -m extract.report``);
    checked when made."""

    layers: Sequence[str] | None = None  # names or globs; None: every stored layer
    pca_layer: str | None = None  # the layer of the PCA and neighbour figures; None: the deepest
    probe_json: Sequence[str | Path] = ()  # accuracies from ``extract.probe --json`` instead of probing here
    max_samples: int = 5000  # drawn at random, for the probes and CKA
    pca_samples: int = 2000
    queries: int = 4  # query samples with neighbour thumbnails
    neighbours: int = 6  # shown per query
    seed: int = 0
    device: str | torch.device | None = None  # None: a GPU if there is one
    k: int = DEFAULT_K  # the k-NN probe's voting neighbours: probe's default, so both commands agree

    def __post_init__(self) -> None:
        if min(self.max_samples, self.pca_samples) < 10 or self.queries < 1 or self.neighbours < 1:
            raise ExtractError(
                "--max-samples and --pca-samples must be at least 10, --queries and --neighbours positive"
            )
        if self.k < 1:
            raise ExtractError(f"--k must be positive (the k-NN probe's voting neighbours); got {self.k}")
