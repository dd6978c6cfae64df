"""The analysis commands' options, declared once (``option(...)``: flag, help, default) and importing no
torch, numpy or store: the command lines build their parsers and docs/cli.md from these declarations, so
that ``extract probe --help`` (``report``, ``compare``) costs no library. The machinery (``probe.py``,
``report.py``, ``knn.py``, ``linear.py``, ``cka.py``) takes them from here."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ExtractError
from ..names.options import option

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


POOL_HELP = "avg | max | cls | mean | none (default: avg for maps, cls for tokens"
DEVICE_HELP = "cpu | cuda[:N]"
A_GPU = "(default: a GPU if there is one)"


def rates(text: str) -> list[float]:
    """``--lrs``: comma-separated positive numbers (argparse names the flag in its message)."""
    try:
        chosen = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of numbers, e.g. 0.01,0.1") from None
    if not chosen or min(chosen) <= 0:
        raise argparse.ArgumentTypeError(f"learning rates must be positive, got '{text}'")
    return chosen


@dataclass(frozen=True)
class ProbeOptions:
    """How to probe each layer (the flags of ``python -m extract.probe``); checked when made.

    Which rows train and test (one store split by ``test_fraction``, or two stores) is not an
    option of the probe but of ``probe_layers``: ``probe_rows`` is given its rows."""

    method: str = field(default="linear", metadata=option(help=" or ".join(METHODS)))
    pool: str | None = field(  # None: avg for maps, cls for tokens (``default_pool``)
        default=None,
        metadata=option(help=f"{POOL_HELP}; a layer pooled at extraction is read as stored)"),
    )
    seed: int = field(default=0, metadata=option(help="seed of the split and of the mini-batch order"))
    device: str | torch.device | None = field(  # None: a GPU if there is one
        default=None, metadata=option(help=f"{DEVICE_HELP} for k-NN and mini-batch training {A_GPU}")
    )
    # linear
    solver: str = field(
        default="auto",
        metadata=option(
            group="linear",
            help=f"{' | '.join(SOLVERS[1:] + SOLVERS[:1])}: auto is L-BFGS when the train set fits --max-full-batch-mib",
        ),
    )
    max_full_batch_mib: float = field(
        default=DEFAULT_MAX_FULL_BATCH_MIB,
        metadata=option(group="linear", help="largest float32 train set for L-BFGS"),
    )
    epochs: int | None = field(  # None: 100 L-BFGS iterations, or 10 SGD passes
        default=None,
        metadata=option(
            group="linear", help="L-BFGS iterations (default 100) or SGD passes over the train set (default 10)"
        ),
    )
    lr: float = field(default=1.0, metadata=option(group="linear", help="L-BFGS step size"))
    weight_decay: float = field(default=1e-3, metadata=option(group="linear", help="L2 penalty on the weights"))
    lrs: Sequence[float] = field(
        default=DEFAULT_LRS,
        metadata=option(
            group="linear", parse=rates, help="SGD learning rates swept on a held-out 10% of the train set"
        ),
    )
    batch_size: int = field(default=256, metadata=option(group="linear", help="SGD batch size"))
    num_workers: int = field(default=0, metadata=option(group="linear", help="DataLoader workers reading SGD batches"))
    # knn
    k: int = field(default=DEFAULT_K, metadata=option(group="knn", help="neighbours that vote"))
    temperature: float = field(
        default=DEFAULT_TEMPERATURE, metadata=option(group="knn", help="vote weight exp(similarity / T)")
    )

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

    layers: Sequence[str] | None = field(  # None: every stored layer
        default=None, metadata=option(metavar="L", help="layers or globs (default: all)")
    )
    pca_layer: str | None = field(  # None: the deepest
        default=None,
        metadata=option(metavar="L", help="the layer of the PCA and neighbour figures (default: the deepest)"),
    )
    probe_json: Sequence[str | Path] = field(
        default=(), metadata=option(metavar="FILE", help="accuracies from extract.probe --json instead of probing here")
    )
    max_samples: int = field(default=5000, metadata=option(help="samples (drawn at random) the probes and CKA use"))
    pca_samples: int = field(default=2000, metadata=option(help="samples in the PCA plot"))
    queries: int = field(default=4, metadata=option(help="query samples with neighbour thumbnails"))
    neighbours: int = field(default=6, metadata=option(help="neighbours shown per query"))
    seed: int = field(default=0, metadata=option(help="seed of the samples drawn"))
    device: str | torch.device | None = field(  # None: a GPU if there is one
        default=None, metadata=option(help=f"{DEVICE_HELP} {A_GPU}")
    )
    k: int = field(  # probe's default, so both commands agree
        default=DEFAULT_K, metadata=option(help="neighbours that vote in the k-NN probe, as probe's")
    )

    def __post_init__(self) -> None:
        if min(self.max_samples, self.pca_samples) < 10 or self.queries < 1 or self.neighbours < 1:
            raise ExtractError(
                "--max-samples and --pca-samples must be at least 10, --queries and --neighbours positive"
            )
        if self.k < 1:
            raise ExtractError(f"--k must be positive (the k-NN probe's voting neighbours); got {self.k}")


@dataclass(frozen=True)
class CompareOptions:
    """How CKA is computed (the flags of ``python -m extract.compare``, besides the stores and the
    outputs); checked when made."""

    pool: str | None = field(default=None, metadata=option(help=f"{POOL_HELP})"))
    match: str = field(
        default="keys",
        metadata=option(
            choices=MATCHES,
            help="pair two stores' samples by key, or by row: the same images from different sources",
        ),
    )
    batch_size: int = field(default=1024, metadata=option(help="samples per CKA minibatch"))
    window: int | None = field(
        default=None,
        metadata=option(help="chunks read together and mixed into minibatches (default: as many as 512 MiB hold)"),
    )
    max_samples: int | None = field(
        default=None, metadata=option(help="use this many samples drawn at random (default: all)")
    )
    seed: int = field(default=0, metadata=option(help="seed of the minibatches"))
    device: str | None = field(default=None, metadata=option(help=f"{DEVICE_HELP} {A_GPU}"))

    def __post_init__(self) -> None:
        if (self.window is not None and self.window < 1) or (self.max_samples is not None and self.max_samples < 4):
            raise ExtractError("--window must be positive and --max-samples at least 4")
