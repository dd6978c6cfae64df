"""STAND-IN until the model-sources issue lands (its ``LoadedModel.preprocessing`` replaces this):
the model's transform described as a dict, for ``--decode draft`` (the resize target) and
``--decode nvjpeg`` (a GPU re-implementation). Reads torchvision's ``ImageClassification`` preset;
anything else is described by its repr only, which those decoders refuse."""

from __future__ import annotations

from typing import Any


def describe_preprocessing(preprocess: Any) -> dict[str, Any]:
    """{"source", "repr", "mean", "std", "interpolation", "resize", "crop"} of ``preprocess``."""
    described: dict[str, Any] = {"source": "unknown", "repr": repr(preprocess), "mean": None, "std": None,
                                  "interpolation": None, "resize": None, "crop": None}  # fmt: skip
    if all(hasattr(preprocess, a) for a in ("resize_size", "crop_size", "mean", "std", "interpolation")):
        resize = list(preprocess.resize_size)
        described.update(
            source="torchvision",
            mean=[float(m) for m in preprocess.mean],
            std=[float(s) for s in preprocess.std],
            interpolation=preprocess.interpolation.value,
            resize=resize[0] if len(resize) == 1 else resize,
            crop=list(preprocess.crop_size) * (2 if len(preprocess.crop_size) == 1 else 1),
        )
    return described
