"""A layer's SAE codes in a store (issue 32, ``--sae LAYER=PATH``): read as a sparse matrix, one latent
dense, chunk by chunk, and each latent's statistics.

    features.latents("blocks.6.hook_resid_post", rows=slice(0, 4096))   # scipy.sparse.csr_array, rows x d_sae
    features.latents(layer, as_torch=True)                              # torch.sparse_csr_tensor
    features.latent(layer, 123)                                         # (N,) float32, one latent dense
    features.stats("latents/" + layer)                                  # frequency, mean, max per latent, ...

The store keeps ``latents/<layer>/indices`` (N, k) int32 and ``latents/<layer>/values`` (N, k) float16,
chunked like the features: each row's k largest active latents, largest first, padded with index -1 and
value 0. The group's attributes say ``d_sae``, ``k``, ``hook_name``, ``architecture``, ``sae_path`` and
``sae_sha256``; ``stats/latents/<layer>`` holds one row per chunk (its ``columns`` attribute: ``count``,
``sum`` and ``max`` of each latent, ``rows_over_k`` and ``dropped_mass``), recorded from the dense codes
before the top-k. Every read is checked as the features' are: a chunk whose object is missing or fails
its checksum is a one-line error naming it (``CheckedReads``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import LayerNotFoundError, SampleIndexError
from ..names.layers import closest

if TYPE_CHECKING:  # made by Features, which imports this module
    from .features import Features

LATENTS = "latents"  # the group of ``latents/<layer>``; ``stats/latents/<layer>`` beside the layers' statistics
STATS_COLUMNS = ("count", "sum", "max", "rows_over_k", "dropped_mass")


def code_layers(features: Features) -> list[str]:
    """The layers the store has SAE codes of."""
    store = features.store
    if not store.has(LATENTS):
        return []
    return sorted(store.group[LATENTS].group_keys())


def codes_of(features: Features, layer: str) -> LatentCodes:
    """``layer``'s codes in ``features``, opened once per ``Features``."""
    if layer not in features._codes:
        features._codes[layer] = LatentCodes(features, layer)
    return features._codes[layer]


class LatentCodes:
    """One layer's sparse codes (``latents/<layer>``) in ``features``, read through its checked reads."""

    def __init__(self, features: Features, layer: str) -> None:
        known = code_layers(features)
        if layer not in known:
            have = f"codes of {', '.join(known)} (closest: {closest(layer, known)})" if known else "no SAE codes"
            raise LayerNotFoundError(
                f"{features.path} has no SAE codes of layer '{layer}'; it has {have}"
                + ("" if known else " (extract with --sae LAYER=PATH to have them)")
            )
        self.features, self.layer = features, layer
        self.name = f"{LATENTS}/{layer}"
        self.indices = features.store.array(f"{self.name}/indices")
        self.values = features.store.array(f"{self.name}/values")
        self.attrs = dict(features.store.group[self.name].attrs)
        self.d_sae, self.k = int(self.attrs["d_sae"]), int(self.indices.shape[1])
        self.num_rows = int(self.indices.shape[0])

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``start:stop``: (indices (n, k) int32, values (n, k) float16), each chunk checked."""
        size = self.features.chunk_size
        chunks = list(range(start // size, -(-stop // size))) if stop > start else []
        reads = self.features._reads
        indices = reads.checked(
            self.indices.path,
            f"SAE codes '{self.indices.path}'",
            chunks,
            lambda: reads.placed(self.indices.path, self.indices)[start:stop],
        )
        values = reads.checked(
            self.values.path,
            f"SAE codes '{self.values.path}'",
            chunks,
            lambda: reads.placed(self.values.path, self.values)[start:stop],
        )
        return np.asarray(indices), np.asarray(values)

    def chunks(self, chunks: Sequence[int] | None = None) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(row start, indices, values) of each chunk (every one by default), in order; the next is read
        by a background thread while the caller works on this one."""
        plan = self.features._reads.plan
        order = list(range(plan.num_chunks) if chunks is None else chunks)
        if not order:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="extract-codes") as background:
            upcoming = background.submit(self.read, *plan.bounds(order[0]))
            for n, chunk in enumerate(order):
                indices, values = upcoming.result()
                if n + 1 < len(order):
                    upcoming = background.submit(self.read, *plan.bounds(order[n + 1]))
                yield plan.bounds(chunk)[0], indices, values

    def matrix(self, rows: slice, as_torch: bool = False, dtype: str = "float32") -> Any:
        """Rows ``rows`` as a (rows, d_sae) CSR matrix: scipy's ``csr_array``, or ``torch.sparse_csr_tensor``."""
        if not isinstance(rows, slice):
            raise SampleIndexError(f"latents(rows=...) takes a slice of rows, got {type(rows).__name__}")
        start, stop, step = rows.indices(self.num_rows)
        if step != 1:
            raise SampleIndexError(f"latents(rows=...) takes a slice of consecutive rows, got step {step}")
        indices, values = self.read(start, max(start, stop))
        return csr(indices, values, self.d_sae, as_torch, dtype)

    def latent(self, index: int) -> np.ndarray:
        """(N,) float32: latent ``index``'s code on every row (0 where inactive), one chunk at a time."""
        if not -self.d_sae <= index < self.d_sae:
            raise SampleIndexError(f"latent {index} is out of range for {self.d_sae} latents of '{self.layer}'")
        index %= self.d_sae
        out = np.zeros(self.num_rows, dtype=np.float32)
        for start, indices, values in self.chunks():
            row, slot = np.nonzero(indices == index)
            out[start + row] = values[row, slot]
        return out

    def stats(self) -> dict[str, Any]:
        """Each latent's statistics over the done chunks, from the rows recorded with each chunk (no codes
        read), of the dense codes before the top-k: ``rows``, ``count`` (rows where it fired), ``frequency``
        (count / rows), ``mean`` (sum / rows), ``mean_active`` (sum / count, NaN where it never fired),
        ``max`` (d_sae,) float64; ``rows_over_k`` and ``fraction_over_k`` (rows with more than k active
        latents: the top-k dropped some), ``dropped_mass`` (the sum of the codes it dropped) and
        ``dropped_fraction`` (of the sum of every code)."""
        reads = self.features._reads
        name = f"stats/{self.name}"
        done, recorded = reads.chunk_rows(name, f"statistics of the SAE codes of '{self.layer}'")
        columns = self.features.store.array(name).attrs["columns"]

        def part(column: str) -> np.ndarray:
            start, stop = columns[column]
            return recorded[:, start:stop]

        rows = int(part("rows").sum()) if "rows" in columns else reads.plan.samples_in(done)
        count, total = part("count").sum(0), part("sum").sum(0)
        over, dropped = float(part("rows_over_k").sum()), float(part("dropped_mass").sum())
        with np.errstate(invalid="ignore", divide="ignore"):
            return {
                "rows": rows,
                "count": count,
                "frequency": count / rows if rows else np.full(self.d_sae, math.nan),
                "mean": total / rows if rows else np.full(self.d_sae, math.nan),
                "mean_active": np.where(count > 0, total / count, math.nan),
                "max": part("max").max(0) if len(done) else np.full(self.d_sae, math.nan),
                "rows_over_k": int(over),
                "fraction_over_k": over / rows if rows else math.nan,
                "dropped_mass": dropped,
                "dropped_fraction": dropped / float(total.sum()) if total.sum() else math.nan,
            }


def csr(indices: np.ndarray, values: np.ndarray, d_sae: int, as_torch: bool = False, dtype: str = "float32") -> Any:
    """(n, k) codes (index -1: none) as an (n, d_sae) CSR matrix, columns sorted within each row. scipy's
    sparse arrays hold no float16, so the values are ``dtype`` (float32: every float16 exactly)."""
    active = indices >= 0
    # sort each row's columns (the stored order is by value): padding sorts last
    order = np.argsort(np.where(active, indices, np.iinfo(np.int32).max), axis=1, kind="stable")
    indices, values = np.take_along_axis(indices, order, 1), np.take_along_axis(values, order, 1)
    active = np.take_along_axis(active, order, 1)
    crow = np.zeros(len(indices) + 1, dtype=np.int64)
    np.cumsum(active.sum(1), out=crow[1:])
    columns, data = indices[active].astype(np.int64), values[active]
    if as_torch:
        import torch  # here only: scipy's matrix, the default, needs no torch

        with warnings.catch_warnings():  # "sparse CSR support is in beta": the layout is what a caller asked for
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(
                torch.from_numpy(crow),
                torch.from_numpy(columns),
                torch.from_numpy(data).to(getattr(torch, dtype)),
                size=(len(indices), d_sae),
                check_invariants=False,  # built valid here
            )
    import scipy.sparse

    return scipy.sparse.csr_array((data.astype(dtype), columns, crow), shape=(len(indices), d_sae))
