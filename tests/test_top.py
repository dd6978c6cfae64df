"""Each latent's top contexts (``extract.analysis.top``) against brute force over dense codes: numpy
sorts every latent's active rows by (value descending, row ascending) and histograms them with
``np.histogram``; the streaming pass must agree whatever the chunk sizes, their order and the device,
with many ties. The contexts, the Parquet rows, the two JSON formats and the HTML page are checked
against the toy corpus they came from."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

from extract.analysis.top import (
    DEFAULT_EDGES,
    MARK,
    TopAccumulator,
    Window,
    contexts,
    delphi_json,
    saedashboard_json,
    top_contexts,
    write_html,
    write_json,
    write_parquet,
)


def _codes(rows: int, num_latents: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sparse codes as the encoder stores them: distinct latents per row, largest first, -1 padding.
    Values come from a coarse set (many ties) spread over powers of two (below, inside and above the
    default edges)."""
    rng = np.random.default_rng(seed)
    indices = np.full((rows, width), -1, dtype=np.int32)
    values = np.zeros((rows, width), dtype=np.float16)
    for r in range(rows):
        m = rng.integers(0, width + 1)
        latent = rng.choice(num_latents, m, replace=False)
        value = (rng.integers(1, 6, m) / 4 * 2.0 ** rng.choice([-14, -3, 0, 0, 0, 2, 13], m)).astype(np.float16)
        order = np.argsort(-value.astype(np.float32), kind="stable")
        indices[r, :m], values[r, :m] = latent[order], value[order]
    return indices, values


def _dense(indices: np.ndarray, values: np.ndarray, num_latents: int) -> tuple[np.ndarray, np.ndarray]:
    active = np.zeros((len(indices), num_latents), dtype=bool)
    dense = np.zeros((len(indices), num_latents), dtype=np.float32)
    rows, slots = np.nonzero(indices >= 0)
    active[rows, indices[rows, slots]] = True
    dense[rows, indices[rows, slots]] = values[rows, slots]
    return active, dense


def _brute_force(active: np.ndarray, dense: np.ndarray, k: int, edges: np.ndarray):
    num_latents = dense.shape[1]
    rows = np.full((num_latents, k), -1, dtype=np.int64)
    values = np.full((num_latents, k), np.nan, dtype=np.float32)
    hist = np.zeros((num_latents, len(edges) + 1), dtype=np.int64)
    bins = np.concatenate([[-np.inf], edges.astype(np.float64), [np.inf]])
    for latent in range(num_latents):
        r = np.flatnonzero(active[:, latent])
        v = dense[r, latent]
        best = np.lexsort((r, -v))[:k]  # value descending, then the lower row
        rows[latent, : len(best)], values[latent, : len(best)] = r[best], v[best]
        hist[latent] = np.histogram(v.astype(np.float64), bins=bins)[0]
    return rows, values, active.sum(0), hist


def _chunks(indices, values, seed, as_torch=False, device="cpu"):
    """Random chunk sizes (an empty one too), delivered in a shuffled order."""
    rng = np.random.default_rng(seed)
    cuts = np.unique(np.concatenate([[0, len(indices)], rng.integers(0, len(indices), 12), [7, 7]]))
    chunks = [(int(a), indices[a:b], values[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    chunks.append((len(indices), indices[:0], values[:0]))
    rng.shuffle(chunks)
    if as_torch:
        return [(a, torch.from_numpy(i).to(device), torch.from_numpy(v).to(device)) for a, i, v in chunks]
    return chunks


@pytest.mark.parametrize(("as_torch", "block_entries"), [(False, 2**19), (True, 2**19), (True, 100)])
def test_top_equals_brute_force_over_dense_codes(as_torch, block_entries):
    num_latents, width, k = 40, 8, 5
    indices, values = _codes(3000, num_latents, width, seed=0)
    chunks = _chunks(indices, values, seed=1, as_torch=as_torch)
    top = top_contexts(chunks, num_latents, k, block_entries=block_entries)
    active, dense = _dense(indices, values, num_latents)
    rows, best, counts, hist = _brute_force(active, dense, k, DEFAULT_EDGES)
    np.testing.assert_array_equal(top.rows, rows)
    np.testing.assert_array_equal(top.values, best)
    np.testing.assert_array_equal(top.counts, counts)
    np.testing.assert_array_equal(top.frequency, counts / len(indices))
    np.testing.assert_array_equal(top.histogram, hist)
    assert top.total_rows == len(indices)
    assert hist[:, 0].sum() and hist[:, -1].sum()  # values below and above the edges were binned
    ties = [(best[l, :-1] == best[l, 1:]).any() for l in range(num_latents)]  # noqa: E741
    assert sum(ties) > num_latents // 2  # the order among equal values was tested


@pytest.mark.parametrize("dtype", [np.float32, np.float16])  # float16: binned by its bit pattern
def test_latents_that_never_fire_negative_codes_and_custom_edges(dtype):
    indices = np.array([[2, -1], [2, 0], [-1, -1], [3, 0]], dtype=np.int64)
    values = np.array([[1.0, 0.0], [3.0, 0.5], [0.0, 0.0], [-0.75, 2.0]], dtype=dtype)
    edges = np.array([-0.5, 0.25, 1.0, 2.0])
    top = top_contexts([(10, indices, values)], num_latents=5, k=3, edges=edges)
    assert indices[0, 1] == -1 and values[0, 0] == 1.0  # the caller's arrays are left as they were
    active, dense = _dense(indices, values, 5)
    rows, best, counts, hist = _brute_force(active, dense, 3, edges)
    np.testing.assert_array_equal(top.rows, rows + np.where(rows >= 0, 10, 0))
    np.testing.assert_array_equal(top.values, best)
    np.testing.assert_array_equal(top.histogram, hist)
    assert hist[3, 0] == 1 and list(top.active_latents()) == [0, 2, 3] and top.rows[1].tolist() == [-1, -1, -1]
    assert TopAccumulator(4, 3).result().total_rows == 0  # no chunk at all


@pytest.mark.cuda
def test_top_on_cuda_equals_brute_force():
    num_latents, width, k = 300, 16, 7
    indices, values = _codes(20000, num_latents, width, seed=5)
    top = top_contexts(_chunks(indices, values, seed=6, as_torch=True, device="cuda"), num_latents, k)
    rows, best, counts, hist = _brute_force(*_dense(indices, values, num_latents), k, DEFAULT_EDGES)
    np.testing.assert_array_equal(top.rows, rows)
    np.testing.assert_array_equal(top.values, best)
    np.testing.assert_array_equal(top.counts, counts)
    np.testing.assert_array_equal(top.histogram, hist)


# A toy corpus: documents of token ids, a vocabulary with characters HTML must escape and a newline.
VOCAB = [" the", " cat", " sat", " on", " mat", "<b>", " &", "\n", " dog", " ran", "'q'", " x"]


def _decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(3)
    lengths = np.array([7, 1, 30, 12, 50])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    token_ids = rng.integers(0, len(VOCAB), offsets[-1])
    num_latents, k = 12, 3
    indices, values = _codes(int(offsets[-1]), num_latents, 4, seed=4)

    def window(rows: np.ndarray, before: int, after: int) -> list[Window]:
        out = []
        for row in rows.tolist():
            doc = int(np.searchsorted(offsets, row, side="right") - 1)
            position = row - offsets[doc]
            start, stop = max(0, position - before), min(lengths[doc], position + after + 1)
            first = int(offsets[doc] + start)
            tokens = token_ids[first : offsets[doc] + stop]
            out.append(Window(f"doc{doc}", int(position), tokens, int(position - start), first))
        return out

    top = top_contexts([(0, indices, values)], num_latents, k)
    batches = list(
        contexts(top, window, _decode, context=4, codes=lambda a, b: (indices[a:b], values[a:b]), batch_rows=10)
    )
    active, dense = _dense(indices, values, num_latents)
    return {"top": top, "batches": batches, "offsets": offsets, "token_ids": token_ids, "dense": dense, "k": k}


def test_contexts_are_the_documents_tokens_around_each_top_row(corpus):
    top, offsets, token_ids, dense = corpus["top"], corpus["offsets"], corpus["token_ids"], corpus["dense"]
    everything = [c for batch in corpus["batches"] for c in batch]
    assert len(corpus["batches"]) > 1  # streamed in batches
    assert [(c.latent, c.rank, c.row) for c in everything] == [
        (latent, rank, int(top.rows[latent, rank]))
        for latent in top.active_latents()
        for rank in range(corpus["k"])
        if top.rows[latent, rank] >= 0
    ]
    for c in everything:
        doc = int(np.searchsorted(offsets, c.row, side="right") - 1)
        first = max(offsets[doc], c.row - 4)
        last = min(offsets[doc + 1], c.row + 5)
        assert (c.key, c.position, c.center) == (f"doc{doc}", c.row - offsets[doc], c.row - first)
        assert c.context_tokens == token_ids[first:last].tolist()
        assert c.activation == top.values[c.latent, c.rank] == dense[c.row, c.latent]
        np.testing.assert_array_equal(c.context_activations, dense[first:last, c.latent])
        before, token, after = (
            _decode(c.context_tokens[: c.center]),
            VOCAB[token_ids[c.row]],
            _decode(c.context_tokens[c.center + 1 :]),
        )
        assert c.context_text == f"{before}{MARK[0]}{token}{MARK[1]}{after}"
        assert c.pieces == [VOCAB[t] for t in c.context_tokens]


def test_parquet_has_one_row_per_latent_and_rank(corpus, tmp_path):
    import pyarrow.parquet as pq

    written = write_parquet(tmp_path / "top.parquet", corpus["batches"])
    table = pq.read_table(tmp_path / "top.parquet")
    everything = [c for batch in corpus["batches"] for c in batch]
    assert written == table.num_rows == len(everything)
    assert table.column_names[:6] == ["latent", "rank", "row", "key", "position", "activation"]
    got = table.to_pylist()
    for row, c in zip(got, everything, strict=True):
        assert row["context_activations"] == pytest.approx(c.context_activations)
        assert {n: v for n, v in row.items() if n != "context_activations"} == {
            n: v for n, v in c.record().items() if n != "context_activations"
        }


def test_saedashboard_and_delphi_json_hold_the_contexts(corpus, tmp_path):
    top, dense = corpus["top"], corpus["dense"]
    write_json(tmp_path / "dash.json", saedashboard_json(top, corpus["batches"], model_id="toy", layer=1, sae_set="s"))
    write_json(tmp_path / "delphi.json", delphi_json(top, corpus["batches"], module="blocks.1.hook_resid_post"))
    dash = json.loads((tmp_path / "dash.json").read_text())
    delphi = json.loads((tmp_path / "delphi.json").read_text())
    assert (dash["model_id"], dash["layer"], dash["sae_set"]) == ("toy", 1, "s")
    by_latent = {}
    for c in (c for batch in corpus["batches"] for c in batch):
        by_latent.setdefault(c.latent, []).append(c)
    assert [f["feature_index"] for f in dash["features"]] == list(by_latent) == [int(x) for x in delphi["latents"]]
    for feature in dash["features"]:
        latent = feature["feature_index"]
        cs = by_latent[latent]
        assert feature["frac_nonzero"] == pytest.approx((dense[:, latent] != 0).mean())
        assert sum(feature["freq_hist_data_bar_heights"]) == (dense[:, latent] != 0).sum()
        assert len(feature["freq_hist_data_bar_values"]) == len(feature["freq_hist_data_bar_heights"])
        assert [a["tokens"] for a in feature["activations"]] == [[VOCAB[t] for t in c.context_tokens] for c in cs]
        assert [a["values"] for a in feature["activations"]] == [pytest.approx(c.context_activations) for c in cs]
        assert [a["bin_max"] for a in feature["activations"]] == [pytest.approx(dense[:, latent].max())] * len(cs)
        record = delphi["latents"][str(latent)]
        assert record["latent"] == {"module_name": "blocks.1.hook_resid_post", "latent_index": latent}
        assert [e["tokens"] for e in record["examples"]] == [c.context_tokens for c in cs]
        assert [e["activations"][c.center] for e, c in zip(record["examples"], cs, strict=True)] == pytest.approx(
            [c.activation for c in cs]
        )
        assert record["per_token_frequency"] == pytest.approx(feature["frac_nonzero"])


class _Spans(HTMLParser):
    """Every token span of the page, per context paragraph, and every tag seen."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: list[list[dict]] = []
        self.tags: list[str] = []
        self._span: dict | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        if tag == "p" and attrs.get("class") == "ctx":
            self.contexts.append([])
        if tag == "span" and "tok" in attrs.get("class", "").split():
            self._span = {**attrs, "text": ""}

    def handle_data(self, data):
        if self._span is not None:
            self._span["text"] += data

    def handle_endtag(self, tag):
        if tag == "span" and self._span is not None:
            self.contexts[-1].append(self._span)
            self._span = None


def test_html_highlights_each_token_by_its_activation(corpus, tmp_path):
    top = corpus["top"]
    chosen = [int(x) for x in top.active_latents()[:3]]
    batch = [c for b in corpus["batches"] for c in b if c.latent in chosen]
    write_html(tmp_path / "top.html", top, batch, title="toy <latents>")
    page = (tmp_path / "top.html").read_text()
    parser = _Spans()
    parser.feed(page)
    assert "b" not in parser.tags and "<title>toy &lt;latents&gt;</title>" in page  # escaped, never markup
    assert "http" not in page and "<script" not in page  # self-contained
    assert len(parser.contexts) == len(batch)
    for spans, c in zip(parser.contexts, batch, strict=True):
        best = float(top.values[c.latent, 0])
        assert [s["text"] for s in spans] == [p.replace("\n", "⏎") for p in c.pieces]
        assert [s["class"] == "tok top" for s in spans] == [i == c.center for i in range(len(c.pieces))]
        for s, act in zip(spans, c.context_activations, strict=True):
            assert float(s["data-act"]) == pytest.approx(act, rel=1e-5)
            if act > 0:
                alpha = float(s["style"].rsplit(",", 1)[1].rstrip(")"))
                assert alpha == pytest.approx(min(act / best, 1.0), abs=1e-3)
            else:
                assert "style" not in s
