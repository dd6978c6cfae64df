"""A token store's sparse SAE codes (``--sae LAYER=PATH``, issue 32; layout in docs/store-format.md).

    latents/<layer>/indices    (N, k) int32, chunks (C, k), fill -1: each row's k largest active latents
    latents/<layer>/values     (N, k) float16, chunks (C, k), fill 0: their codes (0 where the index is -1);
                               float32 for a mixture-of-experts block's routing (``BLOCK@router``: the
                               experts' ids and weights, architecture ``router``)
    stats/latents/<layer>      (K, 3 + 3 * d_sae) float64, one row per chunk (one object each)

The group ``latents/<layer>`` says what made them (attrs ``d_sae``, ``k``, ``hook_name``,
``architecture``, ``sae_path``, ``sae_sha256``); the root attribute ``latents`` lists the layers with the
same record, under the identity's digests (``identity_sha256``), and the identity holds each SAE's sha256
and k: an edit of either record is named by ``verify`` (``metadata_problems``) and refused by a resume
(``edited``), which would otherwise call the store complete, or add codes of another SAE to it. The
codes are row arrays and the statistics chunk arrays of the store: written with each chunk before its
``done``, under its ``digests``, checked by ``verify`` and redone by ``--repair`` as every other array.

A statistics row holds the chunk's ``rows``, ``rows_over_k`` (rows with more than k active latents: some
were dropped), ``dropped_mass`` (the sum of the codes the top-k did not keep), then per latent ``count``
(rows where it is active), ``sum`` and ``max`` of its codes (zeros included) over the chunk's rows,
computed in float64 on the device from the dense codes before the top-k. The array's ``columns``
attribute says where each lies, as [start, stop).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr

from ..names.latents import LATENTS, indices_path, stats_path, values_path
from .schema import checked, codecs, identity_digests
from .stats import STATS

if TYPE_CHECKING:
    from .store import FeatureStore

ATTRIBUTE = "latents"  # the root attribute: {layer: the group's attrs}
HEAD = ("rows", "rows_over_k", "dropped_mass")  # then count, sum, max: (d_sae,) each
PER_LATENT = ("count", "sum", "max")
# the group's attrs, which a job records for each SAE
DESCRIPTION = ("d_sae", "k", "hook_name", "architecture", "sae_path", "sae_sha256", "values_dtype")


def row_arrays(layers: Iterable[str]) -> list[str]:
    """The codes' arrays, one row per token, in the order of the ``digests`` columns."""
    return [path for layer in layers for path in (indices_path(layer), values_path(layer))]


def layers_of(attrs: Mapping[str, Any]) -> list[str]:
    """The layers a store keeps codes of (none before ``--sae``)."""
    return list(attrs.get(ATTRIBUTE) or {})


def columns(d_sae: int) -> dict[str, list[int]]:
    """Where each statistic lies in a row, as [start, stop): recorded as the array's ``columns``."""
    layout = {name: [i, i + 1] for i, name in enumerate(HEAD)}
    for i, name in enumerate(PER_LATENT):
        start = len(HEAD) + i * d_sae
        layout[name] = [start, start + d_sae]
    return layout


def stats_row(stats: Mapping[str, np.ndarray], d_sae: int) -> np.ndarray:
    """A chunk's statistics (``LatentStats.numpy()``, merged over its rows) as its row."""
    row = np.empty(len(HEAD) + len(PER_LATENT) * d_sae, dtype=np.float64)
    for name, (start, stop) in columns(d_sae).items():
        row[start:stop] = stats[name]
    return row


def merge(into: dict[str, np.ndarray] | None, part: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Two parts of a chunk's rows' statistics together (maxima by max, the rest summed)."""
    if into is None:
        return {name: np.array(value, dtype=np.float64, copy=True) for name, value in part.items()}
    for name, value in part.items():
        into[name] = np.maximum(into[name], value) if name == "max" else into[name] + value
    return into


def empty_stats(d_sae: int) -> dict[str, np.ndarray]:
    """The statistics of no rows (``LatentStats.zeros``)."""
    zero = np.zeros((), np.float64)
    per = {"count": np.zeros(d_sae), "sum": np.zeros(d_sae), "max": np.full(d_sae, -np.inf)}
    return {"rows": zero, "rows_over_k": zero.copy(), "dropped_mass": zero.copy(), **per}


def create(root: zarr.Group, latents: Mapping[str, Mapping[str, Any]], num_samples: int, chunk_size: int) -> list[str]:
    """The ``latents`` group and each layer's codes and statistics arrays (empty); returns the
    statistics arrays' paths, for the digests' columns (the codes are in ``row_arrays``)."""
    if not latents:
        return []
    num_chunks = -(-num_samples // chunk_size)
    group = root.create_group(LATENTS)
    paths = []
    for layer, description in latents.items():
        k, d_sae = int(description["k"]), int(description["d_sae"])
        codes = group.create_group(layer, attributes={key: description.get(key) for key in DESCRIPTION})
        values_dtype = description.get("values_dtype", "float16")
        for name, dtype, fill in (("indices", "int32", -1), ("values", values_dtype, 0)):
            codes.create_array(
                name, shape=(num_samples, k), chunks=(chunk_size, k), dtype=dtype, fill_value=fill,
                compressors=checked(codecs("zstd")), dimension_names=("token", f"{layer}.latent_rank"),
            )  # fmt: skip
        width = len(HEAD) + len(PER_LATENT) * d_sae
        root.require_group(STATS).require_group(LATENTS).create_array(
            layer, shape=(num_chunks, width), chunks=(1, width), dtype="float64", fill_value=np.nan,
            compressors=checked(codecs("zstd")), dimension_names=("chunk", f"{layer}.latent_statistic"),
            attributes={"columns": columns(d_sae), "d_sae": d_sae},
        )  # fmt: skip
        paths.append(stats_path(layer))
    return paths


@dataclass
class ChunkCodes:
    """One chunk's codes of one layer, as the writer hands them to the store."""

    indices: np.ndarray  # (rows, k) int32
    values: np.ndarray  # (rows, k) float16 (float32: routing weights)
    stats: dict[str, np.ndarray]  # merged ``LatentStats.numpy()`` of the chunk's rows


def write_chunk(store: FeatureStore, chunk: int, start: int, stop: int, codes: Mapping[str, ChunkCodes]) -> None:
    """Chunk ``chunk``'s codes and statistics row of every layer (before its digests and ``done``)."""
    for layer, part in codes.items():
        store.array(indices_path(layer))[start:stop] = part.indices
        store.array(values_path(layer))[start:stop] = part.values
        rows = store.array(stats_path(layer))
        rows[chunk] = stats_row(part.stats, int(rows.attrs["d_sae"]))


def metadata_problems(store: FeatureStore, attrs: Mapping[str, Any]) -> list[str]:
    """The SAE records that disagree with what decided the codes: the root ``latents`` record of each layer
    against the identity's SAE (its weights' sha256 and k), each ``latents/<layer>`` group's attributes
    against that record, and k against the width of the codes. Each problem names its attribute."""
    recorded: Mapping[str, Any] = attrs.get(ATTRIBUTE) or {}
    decided: Mapping[str, Any] = ((attrs.get("identity") or {}).get("sae") or {}).get("layers") or {}
    problems = []
    if decided and sorted(recorded) != sorted(decided):
        problems.append(
            f"{ATTRIBUTE} lists layers {sorted(recorded)}, but the identity has SAEs of {sorted(decided)} (it was edited)"
        )
    for layer, decides in decided.items():
        record = recorded.get(layer) or {}
        for key in ("sae_sha256", "k"):
            if key in decides and record.get(key) != decides[key]:
                problems.append(
                    f"{ATTRIBUTE}[{layer}].{key} is {_said(record.get(key))}, but the identity's is "
                    f"{_said(decides[key])} (it was edited)"
                )
    for layer, record in recorded.items():
        group = store.group.get(f"{LATENTS}/{layer}")
        if not isinstance(group, zarr.Group):
            continue  # its arrays' absence is the damage opening names
        edited = [key for key in DESCRIPTION if group.attrs.get(key) != (record or {}).get(key)]
        problems += [
            f"{LATENTS}/{layer}.attrs.{key} is {_said(group.attrs.get(key))}, but the store's {ATTRIBUTE} record "
            f"says {_said((record or {}).get(key))} (it was edited)"
            for key in edited
        ]
        width = store.array(indices_path(layer)).shape[1:]
        if "k" not in edited and width != ((record or {}).get("k"),):
            problems.append(f"{ATTRIBUTE}[{layer}].k is {(record or {}).get('k')!r}, but its codes are {width} wide")
    return problems


def edited(store: FeatureStore) -> list[str]:
    """``metadata_problems``, and the root ``latents`` record against its digest where the store recorded
    one (a store from before it did is checked against its identity alone)."""
    attrs = store.attrs
    digest = (attrs.get("identity_sha256") or {}).get(ATTRIBUTE)
    problems = metadata_problems(store, attrs)  # the most telling first: a resume's refusal names it
    if digest is not None and identity_digests(attrs, [])[ATTRIBUTE] != digest:
        problems.append(f"{ATTRIBUTE} differs from the digest recorded at the store's creation (it was edited)")
    return problems


def _said(value: Any) -> str:
    """A value as a problem names it: a sha256 by its first 12 digits (enough to tell two apart in a line)."""
    if isinstance(value, str) and len(value) == 64:
        return repr(value[:12] + "...")
    return repr(value)


def restore(store: FeatureStore) -> list[str]:
    """Put back edited SAE records where the digest recorded at creation proves the right one: the root
    ``latents`` from the groups' attributes, then each group's attributes from the proven root record.
    Returns what was restored (nothing for a store without the digest: nothing proves either side)."""
    attrs = store.attrs
    digest, recorded = (attrs.get("identity_sha256") or {}).get(ATTRIBUTE), attrs.get(ATTRIBUTE)
    if digest is None or not isinstance(recorded, dict):
        return []

    def proven(value: Any) -> bool:
        return identity_digests({**attrs, ATTRIBUTE: value}, [])[ATTRIBUTE] == digest

    restored = []
    groups = {layer: store.group.get(f"{LATENTS}/{layer}") for layer in recorded}
    if not proven(recorded):
        if not all(isinstance(group, zarr.Group) for group in groups.values()):
            return []
        candidate = {layer: {key: group.attrs.get(key) for key in DESCRIPTION} for layer, group in groups.items()}
        if not proven(candidate):
            return []
        store.update_attrs(**{ATTRIBUTE: candidate})
        recorded = candidate
        restored.append(f"the attribute {ATTRIBUTE}")
    for layer, group in groups.items():
        record = recorded.get(layer) or {}
        if isinstance(group, zarr.Group) and any(group.attrs.get(key) != record.get(key) for key in DESCRIPTION):
            group.attrs.update({key: record.get(key) for key in DESCRIPTION})
            restored.append(f"the attributes of {LATENTS}/{layer}")
    return restored
