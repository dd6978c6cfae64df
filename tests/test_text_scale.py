"""Text at scale (issue 28): planning a corpus and running a rank's batches never materializes an array
with one entry per token of the corpus. The bound is on what Python and numpy allocate (tracemalloc
sees every numpy buffer), with a corpus whose token ids (4 bytes each) would break it, so it cannot
flake on timing or on the allocator's caching; the figures themselves are in benchmarks/text_scale.py."""

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from extract.data.source import Document, TextSource
from extract.data.tokenize import Corpus, PackInfo, TokenRows, survey
from extract.job.text import ChunkColumns, TextBatch, TextBatches
from extract.store.chunks import Plan

DOCUMENTS = 16_000
VOCAB = 1000


class Synthetic(TextSource):
    """Documents of ragged lengths (1 to 500 tokens, or ``lengths``) given as token ids: document i holds
    ids ``(i + j) % VOCAB`` for j < its length."""

    def __init__(self, count: int, lengths: tuple[int, int] = (1, 500)) -> None:
        self.lengths = np.random.default_rng(0).integers(*lengths, size=count)

    def __len__(self) -> int:
        return len(self.lengths)

    def key(self, index: int) -> str:
        return f"doc/{index}"

    def documents(self, start: int, stop: int):
        for i in range(start, stop):
            # the list of ints a source gives, made by numpy: a comprehension of 4M ints took half the test
            yield Document(input_ids=(np.arange(i, i + int(self.lengths[i])) % VOCAB).tolist(), label=i % 3)


class Encoder:
    """The ids as given, cut to the context length (as ``TextModel.encode`` does); 0 is special."""

    def encode_many(self, documents, context_length):
        out = []
        for _, ids in documents:
            kept = np.asarray(ids if context_length is None else ids[:context_length], dtype=np.int32)
            out.append(SimpleNamespace(ids=kept, special=kept == 0, dropped=len(ids) - len(kept)))
        return out

    def special_ids(self):
        return np.array([0])


def _peak(work) -> int:
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("packing", [None, PackInfo(256, bos=1, separator=2)], ids=["ragged", "packed"])
def test_planning_and_a_ranks_batches_hold_no_array_of_the_corpus_tokens(packing):
    source, model = Synthetic(DOCUMENTS), Encoder()
    state = SimpleNamespace(process_index=0, num_processes=1)
    tokens = int(source.lengths.sum())  # about 4M
    found: dict[str, Corpus] = {}
    survey_peak = _peak(lambda: found.setdefault("corpus", survey(source, model, 400, state, packing)))
    corpus = found["corpus"]
    offsets = corpus.offsets
    plan = Plan(int(offsets[-1]), 4096)
    rows = TokenRows(source, model, 400, corpus)
    chunks = list(range(plan.num_chunks // 2, plan.num_chunks))  # rank 1 of 2
    seen = {"rows": 0, "columns": 0}

    def run_batches() -> None:
        for item in TextBatches(offsets, rows, plan, chunks, per_token=True, tokens_per_batch=2048, pad_id=0):
            if isinstance(item, ChunkColumns):
                seen["columns"] += len(item.columns["token_ids"])
            elif isinstance(item, TextBatch):
                seen["rows"] += len(item.rows)

    batches_peak = _peak(run_batches)
    owned = plan.samples_in(chunks)
    assert seen == {"rows": owned, "columns": owned}  # every row of the rank's chunks, once
    per_document = 40 * DOCUMENTS  # the plan's few bytes per document, and their offsets
    assert survey_peak < 2 * tokens + per_document, (survey_peak, tokens)
    assert batches_peak < 2 * tokens + per_document, (batches_peak, tokens)


def test_token_rows_equal_the_corpus_concatenated():
    """Any slice of rows, as the chunks' owners make them, equals the whole corpus's rows."""
    source, model = Synthetic(300), Encoder()
    state = SimpleNamespace(process_index=0, num_processes=1)
    for packing in (None, PackInfo(64, bos=1, separator=2), PackInfo(64, bos=None, separator=None)):
        corpus = survey(source, model, 200, state, packing)
        rows = TokenRows(source, model, 200, corpus)
        whole = rows.rows(0, int(corpus.offsets[-1]))
        if packing is None:
            expected = np.concatenate(
                [[(i + j) % VOCAB for j in range(min(200, n))] for i, n in enumerate(source.lengths)]
            )
            assert whole.token_ids.tolist() == expected.tolist()
        else:
            stream = []
            for i, n in enumerate(source.lengths):
                stream += [packing.separator] if stream and packing.separator is not None else []
                stream += [(i + j) % VOCAB for j in range(n)]
            contexts = len(stream) // packing.content
            body = np.array(stream[: contexts * packing.content]).reshape(contexts, packing.content)
            if packing.bos is not None:
                body = np.concatenate([np.full((contexts, 1), packing.bos), body], axis=1)
            assert whole.token_ids.tolist() == body.reshape(-1).tolist()
        rng = np.random.default_rng(1)
        for _ in range(20):
            start = int(rng.integers(0, len(whole.token_ids) - 1))
            stop = int(rng.integers(start + 1, len(whole.token_ids) + 1))
            part = rows.rows(start, stop)
            for name, values in part.columns(start, stop).items():
                assert values.tolist() == whole.columns(start, stop)[name].tolist(), (name, start, stop)


@pytest.mark.parametrize("packing", [None, PackInfo(128, bos=1, separator=2)], ids=["ragged", "packed"])
def test_short_documents_cost_at_most_two_bytes_a_token(packing):
    """60-token documents (chat turns, docstrings): planning and a rank's batches hold at most 2 bytes per
    token of the corpus, everything per document included (its facts are numpy arrays of the narrowest
    types, no Python object per document). A billion tokens of such documents is 17M documents."""
    documents = 60_000
    source, model = Synthetic(documents, lengths=(30, 91)), Encoder()
    state = SimpleNamespace(process_index=0, num_processes=1)
    tokens = int(source.lengths.sum())  # about 3.6M
    found: dict[str, Corpus] = {}
    survey_peak = _peak(lambda: found.setdefault("corpus", survey(source, model, 400, state, packing)))
    corpus = found["corpus"]
    plan = Plan(int(corpus.offsets[-1]), 4096)
    chunks = list(range(plan.num_chunks // 2, plan.num_chunks))

    def run_batches() -> None:
        rows = TokenRows(source, model, 400, corpus)
        for _ in TextBatches(corpus.offsets, rows, plan, chunks, per_token=True, tokens_per_batch=2048, pad_id=0):
            pass

    batches_peak = _peak(run_batches)
    assert survey_peak < 2 * tokens, (survey_peak / tokens, "bytes a token")
    assert batches_peak < 2 * tokens, (batches_peak / tokens, "bytes a token")
