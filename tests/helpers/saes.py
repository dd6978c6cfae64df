"""What the SAE tests compare against: each row's top-k codes chosen by numpy."""

from __future__ import annotations

import numpy as np


def top_k_codes(dense: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k largest nonzero codes by numpy: value descending, then latent ascending; (indices
    (rows, k) int64 padded with -1, values (rows, k) of ``dense``'s dtype padded with 0)."""
    indices = np.full((len(dense), k), -1, dtype=np.int64)
    values = np.zeros((len(dense), k), dtype=dense.dtype)
    for r, row in enumerate(dense):
        order = np.lexsort((np.arange(len(row)), -row))  # the last key sorts first
        order = order[row[order] != 0][:k]
        indices[r, : len(order)], values[r, : len(order)] = order, row[order]
    return indices, values
