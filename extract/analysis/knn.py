"""k-NN classification as in DINO's evaluation: cosine similarity, the k most similar training
samples vote for their class with weight exp(similarity / T).

Computed in blocks: the test samples a block at a time (as many as ``test_block_bytes`` hold), the
training set streamed from the store past each test block, keeping only a running top-k. Memory is
bounded by the blocks, whatever N is, and the similarities run on ``device`` (a GPU when there is one).
"""

from __future__ import annotations

import numpy as np
import torch

from .options import DEFAULT_K, DEFAULT_TEMPERATURE
from .samples import BLOCK_BYTES, Samples


def _normalized(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.nn.functional.normalize(x.to(device, torch.float32), dim=1)


def knn_predict(
    train: Samples,
    test: Samples,
    num_classes: int,
    *,
    k: int = DEFAULT_K,
    temperature: float = DEFAULT_TEMPERATURE,
    device: str | torch.device = "cpu",
    train_block_bytes: int = BLOCK_BYTES,
    test_block_bytes: int = BLOCK_BYTES,
    similarity_bytes: int | None = None,
) -> np.ndarray:
    """The predicted class of every test sample (in ``test.rows`` order).

    Memory: a block of test and of training vectors (``*_block_bytes``) and the similarities between
    them with their labels (about 24 bytes per pair: values, labels, and the merge with the top-k),
    which ``similarity_bytes`` bounds (default 256 MiB on the CPU, 4 GiB on a GPU): queries come in
    blocks small enough that a training block holds at least 4 chunks, and the training blocks are
    shortened to fit (one chunk at least). Each test block streams the training set once."""
    device = torch.device(device)
    if similarity_bytes is None:
        similarity_bytes = 4 * 2**30 if device.type == "cuda" else 8 * BLOCK_BYTES
    k = min(k, len(train))
    predictions = np.empty(len(test), dtype=np.int64)
    max_queries = max(1, similarity_bytes // (24 * 4 * train.features.chunk_size))
    for part, queries, _ in test.blocks(test_block_bytes, max_rows=max_queries):
        train_rows = max(1, similarity_bytes // (24 * len(queries))) - k
        queries = _normalized(queries, device)
        top_similarity = torch.full((len(queries), k), -torch.inf, device=device)
        top_label = torch.zeros((len(queries), k), dtype=torch.int64, device=device)
        for _, keys, labels in train.blocks(train_block_bytes, max_rows=train_rows):
            similarity = queries @ _normalized(keys, device).T
            labels = labels.to(device).expand(len(queries), -1)
            # merge this block into the running top-k: top-k of (previous top-k, block)
            merged = torch.cat([top_similarity, similarity], dim=1)
            top_similarity, at = merged.topk(k, dim=1)
            top_label = torch.cat([top_label, labels], dim=1).gather(1, at)
        votes = torch.zeros((len(queries), num_classes), device=device, dtype=torch.float32)
        votes.scatter_add_(1, top_label, (top_similarity / temperature).exp())
        predictions[part] = votes.argmax(1).cpu().numpy()
    return predictions
