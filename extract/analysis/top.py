"""Each SAE latent's top contexts over a corpus of sparse codes, in one streaming pass (issue 32).

    top = top_contexts(chunks, num_latents=16384, k=20)     # chunks: (row_start, indices, values)
    batches = list(contexts(top, window, tokenizer.decode, context=16, codes=read_codes))
    write_parquet("top.parquet", batches)
    write_json("dashboard.json", saedashboard_json(top, batches, model_id="gpt2", layer=6))
    write_json("delphi.json", delphi_json(top, batches, module="blocks.6.hook_resid_post"))
    write_html("top.html", top, [c for c in batches[0] if c.latent in (1, 5, 9)])

**The pass.** ``chunks`` yields ``(row_start, indices (n, w) int, values (n, w) float)`` as the store yields
its sparse codes (numpy or torch, any device): rows ``row_start .. row_start + n``, each with its ``w``
largest latents, index -1 past the active ones. An entry is *active* when its index is >= 0. For every
latent the pass keeps its ``k`` best (row, value): value descending, ties to the lower row, whatever the
order the chunks come in. It is vectorised in torch and runs where the chunks' tensors are (or on
``device``): a block of entries is compared with each latent's current k-th best (one gather); the
few that beat it wait in a buffer that is merged into the lists by three stable sorts (row, then value
descending, then latent) and one scatter once it holds ``num_latents x k`` entries. Work is linear in
the nonzeros plus sorts whose cost per buffered entry is O(log), and few entries beat a full list;
memory is O(num_latents x (k + bins)) plus one chunk (measured: ``benchmarks/sae_top.py``).

**Frequency and histogram.** ``counts[l]`` is the rows where latent l is active, ``frequency = counts /
total_rows``. The histogram is over fixed edges, the same for every latent and known before the pass (so
one pass suffices): by default ``DEFAULT_EDGES``, 4 bins per octave from 2^-12 to 2^12 (97 edges). Bin 0
holds values below the first edge (and negative ones), bin i (1..96) ``[edges[i-1], edges[i])``, the last
bin values >= the last edge: ``np.histogram(v, [-inf, *edges, inf])``. A float16 code (the stored kind) is
at least 2^-24, so the default range loses nothing to the lowest bin but codes under 2.4e-4.

**Contexts.** ``contexts`` asks a ``window(rows, before, after)`` function (the store's: it knows the
documents and their token ids) for each top row's ``Window``: the document key, the token's position in
it, the token ids of up to ``before`` tokens before and ``after`` after it within the document, and where
the token sits in them. ``decode`` (the tokenizer's) turns ids into text; ``context_text`` marks the
activating token as ``«token»``. Given ``codes(start, stop)`` (the store's sparse codes of a row range),
every token of a window gets the latent's activation on it; without it, only the activating one does.

**Outputs.** ``write_parquet``: one row per (latent, rank), columns ``latent, rank, row, key, position,
activation, center, context_tokens, context_activations, context_text``. ``saedashboard_json``: the batch
format SAEDashboard's Neuronpedia runner writes and loads back with
``NeuronpediaDashboardBatch(**json.load(f))`` (``sae_dashboard/neuronpedia/neuronpedia_dashboard.py``):
top keys ``model_id, layer, sae_set, features``; per latent ``feature_index`` (the latent),
``frac_nonzero`` (frequency), ``freq_hist_data_bar_values`` / ``_heights`` (bin centres, geometric; the
outer bins at the first / last edge; and counts, from the first to the last non-empty bin) and
``activations``: one per context, ``bin_min = -1, bin_max = max activation, bin_contains = -1`` (what the
runner records for its "TOP ACTIVATIONS" group), ``tokens`` (each token decoded alone) and ``values``
(the latent's activation on each). Fields it computes from the model (logits, neuron alignment) are left
to their defaults. ``delphi_json``: per latent, the fields of delphi's ``LatentRecord``
(``delphi/latents/latents.py``): ``latent: {module_name, latent_index}``, ``examples`` (one
``ActivatingExample`` each: ``tokens``, ``activations``, ``str_tokens``, ``quantile`` 0, best first) and
``per_token_frequency``: ``LatentRecord(latent=Latent(**r["latent"]), examples=[ActivatingExample(
tokens=torch.tensor(e["tokens"]), activations=torch.tensor(e["activations"]), str_tokens=e["str_tokens"])
...], per_token_frequency=r["per_token_frequency"])`` rebuilds it. ``write_html``: a self-contained page,
each token a span whose background's opacity is its activation over the latent's largest.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

DEFAULT_EDGES = 2.0 ** (np.arange(-48, 49) / 4)  # 4 bins per octave, 2^-12 .. 2^12
MARK = ("«", "»")  # around the activating token in context_text


@dataclass
class TopContexts:
    """The pass's result, on the host. ``rows[l]`` / ``values[l]``: latent l's best rows and their
    values, best first (row -1 and value NaN past its ``counts[l]``)."""

    rows: np.ndarray  # (num_latents, k) int64
    values: np.ndarray  # (num_latents, k) float32
    counts: np.ndarray  # (num_latents,) int64
    total_rows: int
    histogram: np.ndarray  # (num_latents, len(edges) + 1) int64
    edges: np.ndarray

    @property
    def frequency(self) -> np.ndarray:
        return self.counts / max(self.total_rows, 1)

    def active_latents(self) -> np.ndarray:
        return np.flatnonzero(self.counts > 0)


class TopAccumulator:
    """The streaming state: ``add`` each chunk, then ``result``.

    A chunk is taken in blocks of about ``block_entries`` entries. Each block's entries are compared
    with their latent's current k-th best (one gather); the few that beat it wait in a pending buffer,
    which is merged into the lists once it holds ``num_latents x k`` entries (and at the end), so a merge
    (sorting the touched lists with the pending entries) costs O(log) per pending entry, amortised.
    Padding (index -1) is counted against a spare latent ``num_latents`` whose k-th best is +inf, so the
    one filter drops it too."""

    def __init__(
        self,
        num_latents: int,
        k: int,
        edges: np.ndarray | None = None,
        device: torch.device | str | None = None,
        block_entries: int = 2**19,
    ) -> None:
        self.num_latents, self.k, self.device, self.block_entries = num_latents, k, device, block_entries
        self.edges = np.asarray(DEFAULT_EDGES if edges is None else edges, dtype=np.float32)
        self.total_rows = 0
        self._state: dict[str, torch.Tensor] | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending_entries = 0
        self._rows_end = 0  # past the highest row seen: a chunk from there on cannot tie from a lower row

    def _start(self, device: torch.device) -> dict[str, torch.Tensor]:
        latents, bins = self.num_latents + 1, len(self.edges) + 1
        edges = torch.from_numpy(self.edges).to(device)
        # float16 codes (the stored kind) take one of 65536 bit patterns: bin each once, then look it up
        patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
        state = {
            "value": torch.full((latents, self.k), -torch.inf, device=device),
            "row": torch.full((latents, self.k), -1, dtype=torch.int64, device=device),
            "last_value": torch.full((latents,), -torch.inf, device=device),  # the k-th best, contiguous
            "last_row": torch.full((latents,), -1, dtype=torch.int64, device=device),
            "hist": torch.zeros(latents * bins, dtype=torch.int64, device=device),
            "edges": edges,
            "bins16": torch.bucketize(patterns.to(device), edges, right=True),
        }
        state["last_value"][-1] = torch.inf  # the spare latent of the padding: nothing beats it
        return state

    def add(self, row_start: int, indices: Any, values: Any) -> None:
        """One chunk: rows ``row_start ..`` with their codes (index -1: inactive)."""
        index = torch.as_tensor(indices)
        device = torch.device(self.device) if self.device is not None else index.device
        state = self._state = self._state or self._start(device)
        index, value = index.to(device), torch.as_tensor(values).to(device)
        self.total_rows += len(index)
        step = max(1, self.block_entries // max(index.shape[1], 1))
        for start in range(0, len(index), step):
            self._add(state, row_start + start, index[start : start + step], value[start : start + step])
            if self._pending_entries >= self.num_latents * self.k:
                self._merge(state)

    def _add(self, state: dict[str, torch.Tensor], row_start: int, index: torch.Tensor, value: torch.Tensor) -> None:
        width = index.shape[1]
        latent = (
            index.reshape(-1).to(torch.int64).remainder(self.num_latents + 1)
        )  # -1: the spare latent (no copy: not in place)
        value = value.reshape(-1)
        if value.dtype == torch.float16:
            bucket = state["bins16"][value.view(torch.int16).to(torch.int64) & 0xFFFF]
        else:
            bucket = torch.bucketize(value.to(torch.float32), state["edges"], right=True)  # edges <= value
        state["hist"] += torch.bincount(latent * (len(self.edges) + 1) + bucket, minlength=len(state["hist"]))
        value = value.to(torch.float32)
        last = state["last_value"][latent]
        better = value > last
        if row_start < self._rows_end:  # an earlier chunk: an equal value beats the k-th best from a lower row
            tie = torch.nonzero(value == last).squeeze(1)
            better[tie] |= row_start + tie // width < state["last_row"][latent[tie]]
        self._rows_end = max(self._rows_end, row_start + len(index))
        position = torch.nonzero(better).squeeze(1)
        self._pending.append((latent[position], value[position], row_start + position // width))
        self._pending_entries += len(position)

    def _merge(self, state: dict[str, torch.Tensor]) -> None:
        """Merge the pending entries into their latents' lists: three stable sorts and one scatter."""
        if not self._pending_entries:
            return
        latent, value, row = (torch.cat(parts) for parts in zip(*self._pending, strict=True))
        self._pending, self._pending_entries = [], 0
        touched = torch.nonzero(torch.bincount(latent, minlength=self.num_latents + 1)).squeeze(1)
        held = state["row"][touched].reshape(-1) >= 0
        latent = torch.cat([touched.repeat_interleave(self.k)[held], latent])
        value = torch.cat([state["value"][touched].reshape(-1)[held], value])
        row = torch.cat([state["row"][touched].reshape(-1)[held], row])
        order = torch.argsort(row, stable=True)  # the last sort decides first: latent, value down, row
        order = order[torch.argsort(-value[order], stable=True)]
        order = order[torch.argsort(latent[order], stable=True)]
        latent, value, row = latent[order], value[order], row[order]
        rank = torch.arange(len(latent), device=latent.device) - torch.searchsorted(latent, latent)
        keep = rank < self.k
        state["value"][latent[keep], rank[keep]] = value[keep]
        state["row"][latent[keep], rank[keep]] = row[keep]
        state["last_value"][touched] = state["value"][touched, -1]
        state["last_row"][touched] = state["row"][touched, -1]

    def result(self) -> TopContexts:
        state = self._state or self._start(torch.device("cpu"))
        self._merge(state)
        latents = self.num_latents
        rows = state["row"][:latents].cpu().numpy()
        values = state["value"][:latents].cpu().numpy()
        values[rows < 0] = np.nan
        hist = state["hist"].view(latents + 1, -1)[:latents].cpu().numpy()
        return TopContexts(rows, values, hist.sum(1), self.total_rows, hist, self.edges.copy())


def top_contexts(
    chunks: Iterable[tuple[int, Any, Any]],
    num_latents: int,
    k: int = 20,
    edges: np.ndarray | None = None,
    device: torch.device | str | None = None,
    block_entries: int = 2**19,
) -> TopContexts:
    """Each latent's ``k`` best (row, value), its frequency and histogram, in one pass over ``chunks``."""
    accumulator = TopAccumulator(num_latents, k, edges, device, block_entries)
    for row_start, indices, values in chunks:
        accumulator.add(row_start, indices, values)
    return accumulator.result()


@dataclass(frozen=True)
class Window:
    """A top row's place in its document, as the store's ``window`` function gives it."""

    key: str  # the document's key
    position: int  # the token's position in the document
    tokens: np.ndarray  # token ids around it, within the document
    center: int  # where the token is in ``tokens``
    first_row: int | None = None  # the store row of tokens[0], when the window's tokens are consecutive rows


WindowFn = Callable[[np.ndarray, int, int], Sequence[Window]]  # (rows, before, after) -> one Window per row
CodesFn = Callable[[int, int], tuple[np.ndarray, np.ndarray]]  # rows [start, stop) -> (indices, values)
Decode = Callable[[list[int]], str]


@dataclass
class Context:
    """One (latent, rank): its row, where it is, and the decoded context around it."""

    latent: int
    rank: int
    row: int
    key: str
    position: int
    activation: float
    center: int
    context_tokens: list[int]
    context_activations: list[float]
    context_text: str
    pieces: list[str] = field(repr=False)  # each token decoded alone

    def record(self) -> dict[str, Any]:
        """The Parquet row."""
        return {name: getattr(self, name) for name in PARQUET_COLUMNS}


PARQUET_COLUMNS = (
    "latent",
    "rank",
    "row",
    "key",
    "position",
    "activation",
    "center",
    "context_tokens",
    "context_activations",
    "context_text",
)


def contexts(
    top: TopContexts,
    window: WindowFn,
    decode: Decode,
    context: int = 16,
    latents: Iterable[int] | None = None,
    codes: CodesFn | None = None,
    batch_rows: int = 4096,
) -> Iterator[list[Context]]:
    """The decoded contexts of ``latents`` (by default every active one), ``context`` tokens on each side
    of every top row, in batches of about ``batch_rows`` top rows (so the caller can stream them out)."""
    chosen = top.active_latents() if latents is None else np.asarray(list(latents), dtype=np.int64)
    pieces: dict[int, str] = {}  # each token decoded alone, once
    block: list[int] = []
    for latent in chosen:
        block.append(int(latent))
        if len(block) * top.rows.shape[1] >= batch_rows:
            yield _contexts(top, block, window, decode, context, codes, pieces)
            block = []
    if block:
        yield _contexts(top, block, window, decode, context, codes, pieces)


def _contexts(
    top: TopContexts,
    latents: list[int],
    window: WindowFn,
    decode: Decode,
    context: int,
    codes: CodesFn | None,
    pieces: dict[int, str],
) -> list[Context]:
    entries = [
        (latent, rank, int(top.rows[latent, rank]), float(top.values[latent, rank]))
        for latent in latents
        for rank in np.flatnonzero(top.rows[latent] >= 0).tolist()
    ]
    unique_rows = np.unique(np.array([e[2] for e in entries], dtype=np.int64))
    windows = dict(zip(unique_rows.tolist(), window(unique_rows, context, context), strict=True))
    window_codes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    out = []
    for latent, rank, row, value in entries:
        w = windows[row]
        tokens = [int(t) for t in np.asarray(w.tokens)]
        for t in tokens:
            if t not in pieces:
                pieces[t] = decode([t])
        acts = _activations(w, row, latent, value, codes, window_codes)
        c = w.center
        text = decode(tokens[:c]) + MARK[0] + decode(tokens[c : c + 1]) + MARK[1] + decode(tokens[c + 1 :])
        out.append(
            Context(
                latent, rank, row, w.key, int(w.position), value, c, tokens, acts, text, [pieces[t] for t in tokens]
            )
        )
    return out


def _activations(
    w: Window,
    row: int,
    latent: int,
    value: float,
    codes: CodesFn | None,
    cache: dict[int, tuple[np.ndarray, np.ndarray]],
) -> list[float]:
    """The latent's activation on each token of the window (only the top row's without ``codes``)."""
    if codes is None or w.first_row is None:
        acts = np.zeros(len(w.tokens), dtype=np.float32)
    else:
        if row not in cache:
            cache[row] = codes(w.first_row, w.first_row + len(w.tokens))
        indices, values = cache[row]
        acts = np.where(np.asarray(indices) == latent, np.asarray(values, dtype=np.float32), 0).sum(1)
    acts[w.center] = value  # the pass's own value (the same code), also where codes are not given
    return [float(a) for a in acts]


def write_parquet(path: str | Path, batches: Iterable[list[Context]]) -> int:
    """Write the contexts, one row per (latent, rank), batch by batch; returns the rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("latent", pa.int32()),
            ("rank", pa.int32()),
            ("row", pa.int64()),
            ("key", pa.string()),
            ("position", pa.int64()),
            ("activation", pa.float32()),
            ("center", pa.int32()),
            ("context_tokens", pa.list_(pa.int32())),
            ("context_activations", pa.list_(pa.float32())),
            ("context_text", pa.string()),
        ]
    )
    written = 0
    with pq.ParquetWriter(str(path), schema) as writer:
        for batch in batches:
            writer.write_table(pa.Table.from_pylist([c.record() for c in batch], schema=schema))
            written += len(batch)
    return written


def _by_latent(batches: Iterable[Iterable[Context]]) -> dict[int, list[Context]]:
    grouped: dict[int, list[Context]] = {}
    for batch in batches:
        for c in batch:
            grouped.setdefault(c.latent, []).append(c)
    return {latent: sorted(cs, key=lambda c: c.rank) for latent, cs in grouped.items()}


def histogram_bars(top: TopContexts, latent: int) -> tuple[list[float], list[int]]:
    """A latent's histogram from its first to its last non-empty bin: bin centres (geometric; the outer
    bins at the first / last edge) and counts."""
    edges = top.edges.astype(np.float64)
    centres = np.concatenate([[edges[0]], np.sqrt(edges[:-1] * edges[1:]), [edges[-1]]])
    heights = top.histogram[latent]
    filled = np.flatnonzero(heights)
    if not len(filled):
        return [], []
    span = slice(filled[0], filled[-1] + 1)
    return [float(c) for c in centres[span]], [int(h) for h in heights[span]]


def saedashboard_json(
    top: TopContexts, batches: Iterable[Iterable[Context]], model_id: str = "", layer: int = 0, sae_set: str = ""
) -> dict[str, Any]:
    """SAEDashboard's (Neuronpedia) batch format of the contexts' latents (see the module's docstring)."""
    features = []
    for latent, cs in _by_latent(batches).items():
        values, heights = histogram_bars(top, latent)
        best = float(top.values[latent, 0])
        features.append(
            {
                "feature_index": latent,
                "frac_nonzero": float(top.frequency[latent]),
                "freq_hist_data_bar_values": values,
                "freq_hist_data_bar_heights": heights,
                "activations": [
                    {
                        "bin_min": -1,
                        "bin_max": best,
                        "bin_contains": -1,
                        "tokens": c.pieces,
                        "values": c.context_activations,
                    }
                    for c in cs
                ],
            }
        )
    return {"model_id": model_id, "layer": layer, "sae_set": sae_set, "features": features}


def delphi_json(top: TopContexts, batches: Iterable[Iterable[Context]], module: str) -> dict[str, Any]:
    """delphi's ``LatentRecord`` fields for each latent of the contexts (see the module's docstring)."""
    records = {}
    for latent, cs in _by_latent(batches).items():
        examples = [
            {"tokens": c.context_tokens, "activations": c.context_activations, "str_tokens": c.pieces, "quantile": 0}
            for c in cs
        ]
        records[str(latent)] = {
            "latent": {"module_name": module, "latent_index": latent},
            "examples": examples,
            "per_token_frequency": float(top.frequency[latent]),
        }
    return {"module": module, "total_rows": top.total_rows, "latents": records}


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(document, ensure_ascii=False))


STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:72em;color:#222}"
    ".ctx{font-family:ui-monospace,monospace;white-space:pre-wrap;margin:0;padding:.25em 0;border-bottom:1px solid #eee}"
    ".tok{border-radius:2px}.tok.top{outline:1.5px solid #b30;font-weight:bold}"
    ".hist{display:flex;align-items:flex-end;height:40px;gap:1px;margin:.3em 0}.hist div{background:#999;width:5px}"
    ".meta{color:#666;font-size:85%;font-family:system-ui,sans-serif}.ctx .meta{display:inline-block;min-width:18em}"
)
HIGHLIGHT = (255, 140, 0)  # the activation colour; its opacity is the activation over the latent's largest


def write_html(path: str | Path, top: TopContexts, batch: Iterable[Context], title: str = "Top contexts") -> None:
    """A self-contained page of the contexts in ``batch`` (a handful of latents): per latent its
    frequency, histogram and contexts, each token's background as strong as its activation."""
    body = [_latent_html(top, latent, cs) for latent, cs in _by_latent([batch]).items()]
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{''.join(body)}</body></html>"
    )
    Path(path).write_text(page, encoding="utf-8")


def _latent_html(top: TopContexts, latent: int, cs: list[Context]) -> str:
    best = float(top.values[latent, 0])
    centres, heights = histogram_bars(top, latent)
    tallest = max(heights, default=1)
    bars = "".join(
        f"<div style='height:{max(1, round(40 * h / tallest))}px' title='{c:.3g}: {h}'></div>"
        for c, h in zip(centres, heights, strict=True)
    )
    lines = "".join(
        f"<p class='ctx'><span class='meta'>#{c.rank} {html.escape(c.key)} @{c.position} "
        f"(row {c.row}) {c.activation:.3g}</span>  {_tokens_html(c, best)}</p>"
        for c in cs
    )
    head = (
        f"<h2>latent {latent}</h2><p class='meta'>active on {top.counts[latent]} of {top.total_rows} rows "
        f"(frequency {top.frequency[latent]:.3g}); largest {best:.4g}</p>"
    )
    return f"<section id='latent-{latent}'>{head}<div class='hist'>{bars}</div>{lines}</section>"


def _tokens_html(c: Context, best: float) -> str:
    spans = []
    for i, (piece, act) in enumerate(zip(c.pieces, c.context_activations, strict=True)):
        alpha = min(max(act / best, 0.0), 1.0) if best > 0 else 0.0
        style = f" style='background:rgba({HIGHLIGHT[0]},{HIGHLIGHT[1]},{HIGHLIGHT[2]},{alpha:.3f})'" if alpha else ""
        kind = "tok top" if i == c.center else "tok"
        shown = html.escape(piece).replace("\n", "⏎")
        spans.append(f"<span class='{kind}' data-act='{act:.6g}' title='{act:.4g}'{style}>{shown}</span>")
    return "".join(spans)
