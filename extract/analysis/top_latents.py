"""Each SAE latent's top contexts over a token store's codes, written out (``extract top``, issue 32).

    summary = top_latents(open_features("store.zarr"), "blocks.6.hook_resid_post", k=20, context=16, out="top/")

One streaming pass over ``latents/<layer>`` chunk by chunk (``top.top_contexts``: bounded memory, the next
chunk read while this one is ranked) finds every latent's ``k`` best tokens (value descending, ties to the
lower row), its firing frequency and histogram; then each top token's context, ``context`` tokens on each
side within its document (a packed store: within its source document's run in the context), is read from
the store and decoded with the store's tokenizer (``attrs["tokenizer"]["name_or_path"]``, or the one
given), with the latent's activation on every token of it. Written to ``out``: ``top.parquet`` (one row
per latent and rank), ``saedashboard.json`` and ``delphi.json`` (the formats of ``top.py``), and
``top.html`` for a handful of latents (``html_latents``; default the ``HTML_LATENTS`` most frequent).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ExtractError, InvalidRequestError
from ..names import Kind
from ..read.features import Features
from ..read.latents import LatentCodes, codes_of
from . import top as tops

HTML_LATENTS = 8
CACHED_CHUNKS = 128  # chunks of token ids and codes kept while the contexts are read


@dataclass(frozen=True)
class TopSummary:
    """What ``top_latents`` wrote: the files, the latents written and the rows passed over."""

    out: Path
    files: list[Path]
    latents: int
    contexts: int
    rows: int

    def line(self) -> str:
        names = ", ".join(p.name for p in self.files)
        return f"{self.out}: top contexts of {self.latents} latents ({self.contexts} rows) over {self.rows} tokens: {names}"


class _Chunks:
    """Rows ``[start, stop)`` of a per-row array, read whole chunks at a time and kept (the last
    ``CACHED_CHUNKS``): the contexts of one batch of latents touch the same chunks again and again."""

    def __init__(self, read: Callable[[int, int], Any], chunk_size: int, num_rows: int) -> None:
        self.read, self.size, self.num_rows = read, chunk_size, num_rows
        self.kept: OrderedDict[int, Any] = OrderedDict()

    def _chunk(self, chunk: int) -> Any:
        if chunk in self.kept:
            self.kept.move_to_end(chunk)
        else:
            self.kept[chunk] = self.read(chunk * self.size, min((chunk + 1) * self.size, self.num_rows))
            if len(self.kept) > CACHED_CHUNKS:
                self.kept.popitem(last=False)
        return self.kept[chunk]

    def get(self, start: int, stop: int) -> list[Any]:
        """The pieces of each chunk the rows span, in order (one per chunk)."""
        pieces = []
        for chunk in range(start // self.size, -(-stop // self.size)):
            base = chunk * self.size
            value = self._chunk(chunk)
            cut = slice(max(start, base) - base, min(stop, base + self.size) - base)
            pieces.append(tuple(v[cut] for v in value) if isinstance(value, tuple) else value[cut])
        return pieces


class StoreWindows:
    """The store's ``window(rows, before, after)`` for ``top.contexts``: each row's document key, its
    position in the document, and the token ids around it within the document."""

    def __init__(self, features: Features) -> None:
        if features.kind is not Kind.TOKENS:
            raise InvalidRequestError(f"{features.path} is a {features.kind} store; top contexts need a token store")
        self.features, self.text = features, features.text
        self.offsets = self.text.offsets
        self.keys = features.keys if features.store.has("keys") else None
        self.packed = self.text.pack is not None
        self.token_ids = _Chunks(
            lambda a, b: self.text.load_token_ids(slice(a, b)), features.chunk_size, features.num_samples
        )

    def _key(self, document: int) -> str:
        return str(self.keys[document]) if self.keys is not None else f"document {document}"

    def __call__(self, rows: np.ndarray, before: int, after: int) -> list[tops.Window]:
        windows = []
        segments = np.searchsorted(self.offsets, rows, side="right") - 1
        for row, segment in zip(np.asarray(rows).tolist(), segments.tolist(), strict=True):
            low = max(int(self.offsets[segment]), row - before)
            high = min(int(self.offsets[segment + 1]), row + after + 1)
            if self.packed:  # the token's own source document's run within the context
                doc = self.text.doc
                same, at = doc[low:high] == doc[row], row - low
                cut_before, cut_after = np.flatnonzero(~same[:at]), np.flatnonzero(~same[at:])
                low, high = (
                    low + (int(cut_before[-1]) + 1 if len(cut_before) else 0),
                    low + (at + int(cut_after[0]) if len(cut_after) else len(same)),
                )
                key = self._key(int(doc[row])) if doc[row] >= 0 else f"context {segment}"
                position = int(self.text.doc_position[row])
            else:
                key, position = self._key(segment), row - int(self.offsets[segment])
            tokens = np.concatenate(self.token_ids.get(low, high))
            windows.append(tops.Window(key, position, tokens, row - low, first_row=low))
        return windows


def _codes(codes: LatentCodes) -> tops.CodesFn:
    cache = _Chunks(codes.read, codes.features.chunk_size, codes.num_rows)

    def read(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        pieces = cache.get(start, stop)
        return np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces])

    return read


def load_tokenizer(features: Features, tokenizer: Any = None) -> Any:
    """``tokenizer`` (a transformers tokenizer, or a name or directory), else the store's own, as its
    ``tokenizer`` attribute names it."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    name = tokenizer or (features.attrs.get("tokenizer") or {}).get("name_or_path")
    if not name:
        raise ExtractError(f"{features.path} records no tokenizer; pass one (--tokenizer NAME_OR_DIR)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(name))
    except (OSError, ValueError) as e:
        raise ExtractError(
            f"the tokenizer '{name}' of {features.path} cannot be loaded ({type(e).__name__}); pass one with "
            "--tokenizer NAME_OR_DIR"
        ) from None


def _chosen(codes: LatentCodes, latents: Sequence[int] | None) -> np.ndarray | None:
    if latents is None:
        return None
    chosen = np.asarray(list(latents), dtype=np.int64)
    if len(chosen) and (chosen.min() < 0 or chosen.max() >= codes.d_sae):
        bad = int(chosen[(chosen < 0) | (chosen >= codes.d_sae)][0])
        raise InvalidRequestError(
            f"latent {bad} is out of range: layer '{codes.layer}' has {codes.d_sae} latents (0-{codes.d_sae - 1})"
        )
    return chosen


def _check_out(out: Path) -> None:
    """``out`` is a directory, or can be made one: neither it nor a folder above it is a file."""
    for place in (out, *out.parents):
        if place.exists():
            if place.is_dir():
                return
            where = f"--out {out}" if place == out else f"--out {out}: {place}"
            raise ExtractError(
                f"{where} is a file, not a directory; name a directory for top.parquet, saedashboard.json, "
                "delphi.json and top.html (it is made if missing)"
            )


def top_latents(
    features: Features,
    layer: str,
    latents: Sequence[int] | None = None,
    k: int = 20,
    context: int = 16,
    out: str | Path = "top",
    html_latents: Sequence[int] | None = None,
    tokenizer: Any = None,
) -> TopSummary:
    """Every latent's (or ``latents``') ``k`` top tokens with ``context`` tokens each side, written to
    ``out`` (see the module's docstring)."""
    if k < 1 or context < 0:
        raise InvalidRequestError(f"k must be positive and context 0 or more; got k={k}, context={context}")
    out = Path(out)
    _check_out(out)  # said before the codes are ranked, not as mkdir's traceback after them
    codes = codes_of(features, layer)
    chosen = _chosen(codes, latents)
    decode = load_tokenizer(features, tokenizer).decode
    windows = StoreWindows(features)
    top = tops.top_contexts(codes.chunks(), codes.d_sae, k)
    active = top.active_latents() if chosen is None else chosen[top.counts[chosen] > 0]
    out.mkdir(parents=True, exist_ok=True)
    batches = list(tops.contexts(top, windows, decode, context, latents=active, codes=_codes(codes)))
    written = tops.write_parquet(out / "top.parquet", batches)
    attrs = codes.attrs
    number = re.search(r"\d+", layer)
    tops.write_json(
        out / "saedashboard.json",
        tops.saedashboard_json(
            top,
            batches,
            model_id=str((features.attrs.get("tokenizer") or {}).get("name_or_path", "")),
            layer=int(number.group()) if number else 0,
            sae_set=str(attrs.get("sae_path", "")),
        ),
    )
    tops.write_json(out / "delphi.json", tops.delphi_json(top, batches, module=str(attrs.get("hook_name") or layer)))
    if html_latents is None:
        html_latents = active[np.argsort(-top.counts[active], kind="stable")][:HTML_LATENTS].tolist()
    shown = set(_chosen(codes, html_latents).tolist())
    page = [c for batch in batches for c in batch if c.latent in shown]
    tops.write_html(out / "top.html", top, page, title=f"Top contexts of {layer} ({features.path})")
    files = [out / name for name in ("top.parquet", "saedashboard.json", "delphi.json", "top.html")]
    return TopSummary(out, files, len(active), written, top.total_rows)
