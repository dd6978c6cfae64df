"""Where a store keeps a layer's sparse SAE codes (``--sae``; ``extract.store.latents``): the capture
stages them under these names and the store and the reader find them there."""

from __future__ import annotations

LATENTS = "latents"
STATS = "stats"  # ``extract.store.stats.STATS``


def indices_path(layer: str) -> str:
    return f"{LATENTS}/{layer}/indices"


def values_path(layer: str) -> str:
    return f"{LATENTS}/{layer}/values"


def stats_path(layer: str) -> str:
    return f"{STATS}/{LATENTS}/{layer}"
