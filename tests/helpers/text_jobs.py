"""The token jobs of the text tests: a corpus of real documents with the three tiny text models
(``text_models``), the layers and hidden-state indices of each kind, the job's command line (per token
or ``--pack``ed), what SAELens's packing gives from the tokenizer alone, and the tolerance of a match."""

from pathlib import Path

import numpy as np

from .text_models import real_documents, save_text_model, write_jsonl

CONTEXT = 96  # a few of the real documents are longer: truncation is exercised
LAYERS = {
    "gpt2": ["transformer.h.0", "hidden_states.3", "lm_head"],
    "llama": ["model.layers.1", "hidden_states.0"],
    "bert": ["encoder.layer.0", "hidden_states.3"],
}
# (stored layer, index into output_hidden_states) where the alias or module is a hidden state
HIDDEN = {
    "gpt2": {"transformer.h.0": 1, "hidden_states.3": 3},
    "llama": {"model.layers.1": 2, "hidden_states.0": 0},
    "bert": {"encoder.layer.0": 1, "hidden_states.3": 3},
}
PACK = 48

TokenCorpus = tuple[Path, list[str], list[int], dict[str, Path]]  # root, documents, labels, model per kind


def token_corpus(root: Path) -> TokenCorpus:
    """23 real documents and an empty one (stored empty), labelled 0, 1, 2 in turn, in ROOT/docs.jsonl;
    a GPT-2, a Llama and a BERT saved under ROOT."""
    documents = [*real_documents(23), ""]
    labels = [i % 3 for i in range(len(documents))]
    write_jsonl(root / "docs.jsonl", documents, label=labels)
    models = {kind: save_text_model(kind, root / kind) for kind in ("gpt2", "llama", "bert")}
    return root, documents, labels, models


def token_job(corpus: TokenCorpus, kind: str, out: object, *extra: object) -> list:
    """The per-token job of ``kind`` over the corpus, labelled, in float32, cut to ``CONTEXT`` tokens."""
    root, _, _, models = corpus
    return [
        "--model", f"hf:{models[kind]}", "--layers", *LAYERS[kind], "--data", f"text:{root / 'docs.jsonl'}",
        "--label-key", "label", "--dtype", "float32", "--context-length", str(CONTEXT), "--out", str(out), *extra,
    ]  # fmt: skip


def packed_job(corpus: TokenCorpus, kind: str, out: object, *extra: object) -> list:
    """The job of ``kind`` over the corpus packed into contexts of ``PACK`` tokens."""
    root, _, _, models = corpus
    return [
        "--model", f"hf:{models[kind]}", "--layers", *LAYERS[kind], "--data", f"text:{root / 'docs.jsonl'}",
        "--dtype", "float32", "--pack", str(PACK), "--out", str(out), *extra,
    ]  # fmt: skip


def close(a: np.ndarray, b: np.ndarray, tol: float = 1e-4) -> bool:
    """``a`` equals ``b`` within ``tol`` of ``b``'s largest magnitude (at least 1): float32 sums in
    another order, another padding or another batch."""
    scale = max(1.0, float(np.abs(b).max())) if b.size else 1.0
    return float(np.abs(a - b).max() / scale) <= tol if a.size else a.shape == b.shape


def packed_by_hand(model_dir: Path, documents: list[str], separator_is_bos: bool) -> tuple:
    """The contexts SAELens builds, from transformers' own tokenizer: each document's content tokens,
    EOS (BOS for Llama) between two documents, cut into BOS + PACK - 1 tokens; and per token its
    document and position (-1 for the inserted ones); and how many tokens were left over."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    separator = tokenizer.bos_token_id if separator_is_bos else tokenizer.eos_token_id
    stream, doc, position = [], [], []
    for i, document in enumerate(documents):
        ids = tokenizer(document, add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        if stream:
            stream, doc, position = stream + [separator], doc + [-1], position + [-1]
        stream, doc, position = stream + ids, doc + [i] * len(ids), position + list(range(len(ids)))
    contexts = len(stream) // (PACK - 1)

    def shaped(values, first):
        body = np.array(values[: contexts * (PACK - 1)]).reshape(contexts, PACK - 1)
        return np.concatenate([np.full((contexts, 1), first), body], axis=1)

    return (
        shaped(stream, tokenizer.bos_token_id),
        shaped(doc, -1),
        shaped(position, -1),
        len(stream) - contexts * (PACK - 1),
    )
