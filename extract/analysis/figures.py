"""The report's figures, drawn with matplotlib (the optional extra ``extract[report]``) into PNG bytes.

Every figure has a fixed size (``size`` inches at ``DPI``, growing with the number of layers where
names must stay readable) and uses constrained layout, so labels never overlap and the PNG's pixel
size is known in advance.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ExtractError

if TYPE_CHECKING:
    from .cka import CKA

DPI = 100


@dataclass(frozen=True)
class Png:
    data: bytes
    width: int  # pixels
    height: int
    title: str


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ExtractError("figures need matplotlib, which is not installed: pip install 'extract[report]'") from None
    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def require_matplotlib() -> None:
    """Fail now, naming the extra to install, when matplotlib is missing: before the work, not after it."""
    _pyplot()


def _render(fig: Any, title: str) -> Png:
    plt = _pyplot()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)  # no bbox_inches="tight": the size stays as declared
    width, height = (int(round(v * DPI)) for v in fig.get_size_inches())
    plt.close(fig)
    return Png(buffer.getvalue(), width, height, title)


def save(png: Png, path: str | Path) -> None:
    try:
        Path(path).write_bytes(png.data)
    except OSError as e:
        raise ExtractError(f"cannot write the figure to {path} ({e.strerror})") from None


def short_names(names: Sequence[str]) -> tuple[str, list[str]]:
    """The dotted prefix every name shares (``encoder.layers.``) and the names without it, so tick
    labels stay short; no prefix when there is one name or stripping would leave an empty name."""
    if len(names) < 2:
        return "", list(names)
    parts = [name.split(".") for name in names]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    prefix = ".".join(parts[0][:common]) + "." if common else ""
    return prefix, [name[len(prefix) :] for name in names]


def _layer_label(prefix: str, what: str = "layer") -> str:
    return f"{what}: {prefix}*" if prefix else what


def accuracy_size(num_layers: int) -> tuple[float, float]:
    return max(7.5, 2.5 + 0.45 * num_layers), 4.5


def accuracy_curve(accuracies: Mapping[str, Mapping[str, float]], layers: Sequence[str], chance: float) -> Png:
    """Test accuracy per layer in model order (the probing-depth curve), one line per method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=accuracy_size(len(layers)), layout="constrained")
    x = np.arange(len(layers))
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]  # lines that coincide stay visible
    for (method, values), (marker, line) in zip(accuracies.items(), styles * len(accuracies), strict=False):
        ax.plot(x, [values.get(layer, np.nan) for layer in layers], marker=marker, linestyle=line, label=method)
    ax.axhline(chance, color="grey", linestyle="--", linewidth=1, label=f"chance ({chance:.3f})")
    prefix, ticks = short_names(layers)
    ax.set_xticks(x, ticks, rotation=45 if len(layers) > 3 else 0, ha="right" if len(layers) > 3 else "center")
    ax.set_xlabel(_layer_label(prefix, "layer, in model order"))
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")  # beside the axes: never on a curve
    ax.set_title("Probe accuracy per layer")
    return _render(fig, "Probe accuracy per layer")


def heatmap_size(num_rows: int, num_cols: int, label_chars: int) -> tuple[float, float]:
    label = 0.08 * min(label_chars, 40)  # inches of tick labels
    cell = 0.5 if max(num_rows, num_cols) <= 12 else 0.3
    return 2.4 + label + cell * num_cols, 1.6 + label + cell * num_rows


def cka_heatmap(cka: CKA, title: str = "Linear CKA between layers") -> Png:
    plt = _pyplot()
    row_prefix, rows = short_names(cka.rows)
    col_prefix, cols = short_names(cka.cols)
    chars = max(len(name) for name in [*rows, *cols])
    fig, ax = plt.subplots(figsize=heatmap_size(len(rows), len(cols), chars), layout="constrained")
    image = ax.imshow(cka.matrix, vmin=0, vmax=1, cmap="magma", aspect="equal")
    ax.set_xticks(range(len(cols)), cols, rotation=90)
    ax.set_yticks(range(len(rows)), rows)
    same = cka.rows == cka.cols
    ax.set_xlabel(_layer_label(col_prefix, "layer" if same else "layer of the second store"))
    ax.set_ylabel(_layer_label(row_prefix, "layer" if same else "layer of the first store"))
    if max(len(cka.rows), len(cka.cols)) <= 12:
        for (i, j), value in np.ndenumerate(cka.matrix):
            ax.text(
                j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color="white" if value < 0.6 else "black"
            )
    fig.colorbar(image, ax=ax, label="linear CKA", shrink=0.8)
    fig.suptitle(title)  # constrained layout keeps room for a suptitle above an equal-aspect image
    return _render(fig, title)


PCA_SIZE = (7.5, 5.5)


def pca_scatter(
    points: np.ndarray, labels: np.ndarray, class_names: Sequence[str], variance: Sequence[float], layer: str
) -> Png:
    """2-D PCA coordinates coloured by class; the legend (up to 20 classes) sits beside the axes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=PCA_SIZE, layout="constrained")
    classes = np.unique(labels)
    colours = plt.get_cmap("tab10" if len(classes) <= 10 else "tab20")
    for i, label in enumerate(classes):
        at = labels == label
        name = class_names[label] if 0 <= label < len(class_names) else ("no label" if label < 0 else str(label))
        colour = colours(i % colours.N) if len(classes) <= 20 else plt.get_cmap("viridis")(i / len(classes))
        size = 16 if len(points) <= 500 else 6  # few points: bigger markers
        ax.scatter(points[at, 0], points[at, 1], s=size, color=colour, label=name, alpha=0.8, linewidths=0)
    ax.set_xlabel(f"PC 1 ({100 * variance[0]:.1f}% of variance)")
    ax.set_ylabel(f"PC 2 ({100 * variance[1]:.1f}% of variance)")
    title = f"PCA of {layer} ({len(points)} samples)"
    ax.set_title(title)
    if len(classes) <= 20:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", markerscale=2, title="class")
    return _render(fig, title)


def neighbours_size(rows: int, cols: int) -> tuple[float, float]:
    return 1.6 * cols, 1.75 * rows + 0.5


def neighbour_grid(rows: Sequence[Sequence[tuple[np.ndarray, str]]], layer: str) -> Png:
    """One row per query: its thumbnail, then its nearest neighbours', each with a caption."""
    plt = _pyplot()
    cols = max(len(r) for r in rows)
    fig, axes = plt.subplots(
        len(rows), cols, figsize=neighbours_size(len(rows), cols), layout="constrained", squeeze=False
    )
    for row_axes, row in zip(axes, rows, strict=True):
        for j, ax in enumerate(row_axes):
            ax.set_xticks([])
            ax.set_yticks([])
            if j >= len(row):
                ax.axis("off")
                continue
            image, caption = row[j]
            ax.imshow(image)
            ax.set_title(caption, fontsize=7)
            if j == 0:
                for spine in ax.spines.values():
                    spine.set_edgecolor("tab:red")
                    spine.set_linewidth(2)
    title = f"Nearest neighbours by cosine similarity of {layer} (query in red, first column)"
    fig.suptitle(title, fontsize=9)
    return _render(fig, title)
