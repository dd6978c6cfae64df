"""``hf:PATH[:split]``: a Hugging Face ``datasets`` dataset saved with ``save_to_disk``, or a local
dataset directory that ``load_dataset`` reads offline. Images come from its ``Image`` feature (or
``--image-key``) as stored bytes, decoded here like every other source; labels and class names from
its ``ClassLabel`` feature (``label``, or ``--label-key``). Keys are ``split/row``.

A dataset is text where ``--text-key`` names a column, or where it has no ``Image`` feature (and no
``--image-key``) but a text column: ``text``, else ``input_ids`` (token ids), else its only string
column. Its documents are then streamed as a ``TextSource``, with the same keys and labels."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ExtractError
from .decode import RawImage, stored_image
from .source import DataOptions, DataRequest, Document, Source, TextSource, listing_hash
from .text import TOKENS, checked_label, text_document

ROWS_AT_A_TIME = 1024  # rows of a text dataset converted to Python at a time: memory stays bounded


def _load(path: str, split: str | None) -> tuple[Any, str]:
    import datasets

    if not Path(path).is_dir():
        raise ExtractError(f"--data hf:{path}: not a directory (a save_to_disk folder or a local dataset directory)")
    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError:
        try:
            loaded = datasets.load_dataset(path)
        except Exception as e:  # noqa: BLE001 - any failure here is the user's directory to fix
            raise ExtractError(f"--data hf:{path}: cannot load it offline ({e.__class__.__name__}: {e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split is None and len(loaded) == 1:
            split = next(iter(loaded))
        if split not in loaded:
            raise ExtractError(f"--data hf:{path}: choose a split with hf:{path}:SPLIT, one of {', '.join(loaded)}")
        return loaded[split], split
    if split is not None:
        raise ExtractError(f"--data hf:{path}: the dataset has no splits; drop ':{split}'")
    return loaded, "data"


class HFSource(Source):
    def __init__(self, path: str, loaded: tuple[Any, str], image_key: str | None, label_key: str | None) -> None:
        import datasets

        dataset, self.split = loaded
        features = dataset.features
        if image_key is None:
            images = [name for name, f in features.items() if isinstance(f, datasets.Image)]
            if not images:
                raise ExtractError(
                    f"--data hf:{path}: no Image feature and no text column among {', '.join(features)}; "
                    "name one with --image-key or --text-key"
                )
            image_key = images[0]
        elif image_key not in features:
            raise ExtractError(f"--data hf:{path}: no column '{image_key}' (--image-key); it has {', '.join(features)}")
        if label_key is not None and label_key not in features:
            raise ExtractError(f"--data hf:{path}: no column '{label_key}' (--label-key); it has {', '.join(features)}")
        label_key = label_key or ("label" if "label" in features else None)
        if isinstance(features[image_key], datasets.Image):
            dataset = dataset.cast_column(image_key, datasets.Image(decode=False))  # bytes: decoded like any source
        label_feature = features.get(label_key) if label_key else None
        self.classes = list(label_feature.names) if isinstance(label_feature, datasets.ClassLabel) else None
        self.dataset, self.image_key, self.label_key = dataset, image_key, label_key
        self.fingerprint = getattr(dataset, "_fingerprint", None)

    def __len__(self) -> int:
        return len(self.dataset)

    def key(self, index: int) -> str:
        return f"{self.split}/{index}"

    def load(self, index: int) -> tuple[RawImage, int]:
        row = self.dataset[index]
        value = stored_image(row[self.image_key])
        label = row[self.label_key] if self.label_key else None
        return value, int(label) if isinstance(label, int) else -1

    def listing_sha256(self) -> str | None:
        return self.fingerprint


def _is_string(feature: Any) -> bool:
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "string_view")


def _is_token_ids(feature: Any) -> bool:
    import datasets

    inner = feature.feature if isinstance(feature, datasets.List | datasets.LargeList) else None
    return isinstance(inner, datasets.Value) and inner.dtype.startswith(("int", "uint"))


def _text_column(path: str, features: Any, options: DataOptions) -> str | None:
    """The column of the documents where the dataset is text (see the module's docstring), else None."""
    import datasets

    names = ", ".join(features)
    if options.text_key is not None:
        feature = features.get(options.text_key)
        if feature is None:
            raise ExtractError(f"--data hf:{path}: no column '{options.text_key}' (--text-key); it has {names}")
        if not (_is_token_ids(feature) if options.text_key == TOKENS else _is_string(feature)):
            wanted = "a list of integer token ids" if options.text_key == TOKENS else "text (a string column)"
            raise ExtractError(
                f"--data hf:{path}: column '{options.text_key}' (--text-key) holds {feature}, not {wanted}"
            )
        return options.text_key
    if options.image_key is not None or any(isinstance(f, datasets.Image) for f in features.values()):
        return None
    if _is_string(features.get("text")):
        return "text"
    if _is_token_ids(features.get(TOKENS)):
        return TOKENS
    strings = [name for name, feature in features.items() if _is_string(feature) and name != TOKENS]
    if len(strings) > 1:
        raise ExtractError(f"--data hf:{path}: several text columns ({', '.join(strings)}); choose one with --text-key")
    return strings[0] if strings else None


class HFText(TextSource):
    """The documents of a ``datasets`` dataset with a text (or ``input_ids``) column."""

    def __init__(self, path: str, loaded: tuple[Any, str], column: str, label_key: str | None) -> None:
        import datasets

        dataset, self.split = loaded
        features = dataset.features
        if label_key is not None and label_key not in features:
            raise ExtractError(f"--data hf:{path}: no column '{label_key}' (--label-key); it has {', '.join(features)}")
        label = features.get(label_key or "label")
        integers = isinstance(label, datasets.Value) and label.dtype.startswith(("int", "uint"))
        if label is not None and not (integers or isinstance(label, datasets.ClassLabel)):
            if label_key is not None:
                raise ExtractError(
                    f"--data hf:{path}: column '{label_key}' (--label-key) holds {label}; labels are integers or a "
                    "ClassLabel (dataset.class_encode_column makes one)"
                )
            self.notice = (
                f"column 'label' holds {label}, not class ids: no labels are stored (--label-key names another)"
            )
            label = None
        self.label_key = (label_key or "label") if label is not None else None
        self.classes = list(label.names) if isinstance(label, datasets.ClassLabel) else None
        self.path, self.column = path, column
        self.fingerprint = getattr(dataset, "_fingerprint", None)
        self.dataset = dataset.select_columns([column, *([self.label_key] if self.label_key else [])])

    def __len__(self) -> int:
        return len(self.dataset)

    def key(self, index: int) -> str:
        return f"{self.split}/{index}"

    def describe(self, index: int) -> str:
        return f"{self.path} split {self.split} row {index}"

    def listing_sha256(self) -> str:
        return listing_hash(
            [f"hf\t{self.fingerprint}", f"text\t{self.column}\t{self.label_key}", f"classes\t{self.classes}"]
        )

    def documents(self, start: int, stop: int) -> Iterator[Document]:
        self._check_range(start, stop)
        for first in range(start, stop, ROWS_AT_A_TIME):
            rows = self.dataset[first : min(first + ROWS_AT_A_TIME, stop)]
            labels = rows[self.label_key] if self.label_key else [None] * len(rows[self.column])
            for at, (value, label) in enumerate(zip(rows[self.column], labels, strict=True), first):
                where = lambda at=at: self.describe(at)  # noqa: E731 - built only for a message
                label = checked_label(label, self.label_key or "", where)
                yield text_document(value, self.column, self.column == TOKENS, label, where)


def open_hf(location: str, request: DataRequest) -> HFSource | HFText:
    path, _, split = location.partition(":")
    loaded = _load(path, split or None)
    options = request.options
    column = _text_column(path, loaded[0].features, options)
    if column is not None:
        return HFText(path, loaded, column, options.label_key)
    return HFSource(path, loaded, options.image_key, options.label_key)
