"""Where the report finds a document store's text, by key: the text source the store was extracted from,
opened again at the data its identity records, which reads a document by its place in the listing
(``TextSource.documents(start, stop)``) and names it by ``keys()``, as it did at extraction. The data
sources are imported only for those stores, and only when the report asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ExtractError
from ..read.features import Features

FIRST_WORDS = 40  # words of a document the report shows
FIRST_CHARACTERS = 320  # at most, for text with few spaces (code, CJK)


@dataclass
class SampleTexts:
    """The first words of some documents of a store, by key: ``has(key)``, ``text(key)`` (None when the
    document cannot be read); ``where`` says where they come from."""

    where: str
    source: object  # a TextSource, opened again
    position: dict[str, int]  # key -> index in the source's listing

    def has(self, key: str) -> bool:
        return key in self.position

    def text(self, key: str) -> str | None:
        if key not in self.position:
            return None
        at = self.position[key]
        try:
            document = next(iter(self.source.documents(at, at + 1)))  # type: ignore[attr-defined]
        except (ExtractError, OSError, ValueError, StopIteration):
            return None
        if document.error:
            return None
        if document.text is None:  # it came tokenized: its ids are what there is to show
            ids = document.input_ids or []
            return first_words(f"(token ids) {' '.join(map(str, ids))}")
        return first_words(document.text)


def first_words(text: str, words: int = FIRST_WORDS, characters: int = FIRST_CHARACTERS) -> str:
    """The start of ``text`` on one line: its first ``words`` words, at most ``characters``, with an
    ellipsis where it was cut."""
    parts = text.split()
    shown = " ".join(parts[:words])
    if len(shown) > characters:
        shown = shown[:characters].rstrip()
    return shown + (" …" if shown != " ".join(parts) else "") if parts else "(empty)"


def sample_texts(features: Features, keys: Sequence[str]) -> SampleTexts | str:
    """How to read the documents of ``keys`` (rows of the document store ``features``), or why they cannot
    be shown."""
    from ..data.registry import open_source
    from ..data.source import DataOptions, DataRequest, TextSource

    identity = features.attrs.get("identity") or {}
    tokenization = identity.get("tokenization") or {}
    data = tokenization.get("data") or identity.get("data") or features.attrs.get("dataset")
    if not data:
        return "the store records no data to read its documents from"
    job = features.attrs.get("job") or {}
    options = DataOptions(
        label_key=tokenization.get("label_key", job.get("label_key")),
        text_key=tokenization.get("text_key", job.get("text_key")),
    )
    try:
        source = open_source(DataRequest(str(data), options))
    except (ExtractError, OSError, ImportError, ValueError) as e:
        return f"cannot open --data {data} from here to read its documents ({e})"
    if not isinstance(source, TextSource):
        return f"--data {data} holds no documents"
    recorded = tokenization.get("data_listing_sha256") or identity.get("data_listing_sha256")
    if recorded is not None and source.listing_sha256() != recorded:
        return f"--data {data} changed since the extraction (its listing hash differs): its documents may not be the stored ones"
    position = {key: i for i, key in enumerate(source.keys())}
    if sum(key in position for key in keys) < 2:
        return f"--data {data} no longer holds the stored keys"
    return SampleTexts(f"read from {data}", source, position)
