"""``hf:PATH[:split]``: a Hugging Face ``datasets`` dataset saved with ``save_to_disk``, or a local
dataset directory that ``load_dataset`` reads offline. Images come from its ``Image`` feature (or
``--image-key``) as stored bytes, decoded here like every other source; labels and class names from
its ``ClassLabel`` feature (``label``, or ``--label-key``). Keys are ``split/row``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ExtractError
from .decode import RawImage, stored_image
from .source import DataRequest, DataSource, Source, resolved_path


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
    def __init__(self, path: str, split: str | None, image_key: str | None, label_key: str | None) -> None:
        import datasets

        dataset, self.split = _load(path, split)
        features = dataset.features
        if image_key is None:
            images = [name for name, f in features.items() if isinstance(f, datasets.Image)]
            if not images:
                raise ExtractError(
                    f"--data hf:{path}: no Image feature among {', '.join(features)}; name it with --image-key"
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


def open_hf(location: str, request: DataRequest) -> HFSource:
    path, _, split = location.partition(":")
    return HFSource(path, split or None, request.options.image_key, request.options.label_key)


def resolve_hf(location: str) -> str:
    path, colon, split = location.partition(":")
    return f"{resolved_path(path)}{colon}{split}"


SOURCE = DataSource(
    "hf", location="PATH[:split]", example="hf:/data/saved", open=open_hf, library="datasets", extra="datasets",
    resolve=resolve_hf,
)  # fmt: skip
