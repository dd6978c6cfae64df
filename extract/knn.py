"""k-NN classification as in DINO's evaluation: cosine similarity, the k most similar training
samples vote for their class with weight exp(similarity / T).

Computed in blocks: the test samples a block at a time (as many as ``test_block_bytes`` hold), the
training set streamed from the store past each test block, keeping only a running top-k. Memory is
bounded by the blocks, whatever N is, and the similarities run on ``device`` (a GPU when there is one).
"""

from __future__ import annotations

import numpy as np
import torch

from .samples import BLOCK_BYTES, Samples

DEFAULT_K = 20
DEFAULT_TEMPERATURE = 0.07


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
    test_block_bytes: int = 4 * BLOCK_BYTES,
) -> np.ndarray:
    """The predicted class of every test sample (in ``test.rows`` order)."""
    device = torch.device(device)
    k = min(k, len(train))
    predictions = np.empty(len(test), dtype=np.int64)
    for part, queries, _ in test.blocks(test_block_bytes):
        queries = _normalized(queries, device)
        top_similarity = torch.full((len(queries), k), -torch.inf, device=device)
        top_label = torch.zeros((len(queries), k), dtype=torch.int64, device=device)
        for _, keys, labels in train.blocks(train_block_bytes):
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
