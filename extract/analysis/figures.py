"""The report's figures, drawn with matplotlib (the optional extra ``extract[report]``) into PNG bytes.

Every figure is as wide as the report's page (``PAGE_WIDTH`` inches at ``DPI``: shown 1:1, never
scaled up or cut), its height fixed by what it holds, and uses constrained layout, so labels never
overlap and the PNG's pixel size is known in advance. Each carries a caption saying how to read it,
which the page shows under it (the title is drawn in the figure).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ExtractError

if TYPE_CHECKING:
    from .cka import CKA

DPI = 100
PAGE_WIDTH = 10.0  # inches: the report's column is PAGE_WIDTH * DPI pixels wide
Z_95 = 1.959964  # the normal quantile of a two-sided 95% interval


@dataclass(frozen=True)
class Png:
    data: bytes
    width: int  # pixels
    height: int
    title: str
    caption: str = ""  # how to read the figure; not its title again


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


def _render(fig: Any, title: str, caption: str = "") -> Png:
    plt = _pyplot()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)  # no bbox_inches="tight": the size stays as declared
    width, height = (int(round(v * DPI)) for v in fig.get_size_inches())
    plt.close(fig)
    return Png(buffer.getvalue(), width, height, title, caption)


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
    return PAGE_WIDTH, 4.5 if num_layers <= 24 else 5.5  # many layers: room for rotated tick labels


def wilson_interval(accuracy: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion: unlike the normal one it stays in [0, 1]
    and is not empty at accuracy 0 or 1, which small test sets often give."""
    if n <= 0:
        return 0.0, 1.0
    centre = (accuracy + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Score:
    """One probe's result on one layer: its test accuracy (None for a constant layer) on ``num_test`` samples."""

    accuracy: float | None
    num_test: int


def _points(values: Mapping[str, Score], layers: Sequence[str]) -> tuple[np.ndarray, np.ndarray, str]:
    """One method's accuracies per layer (NaN where none), their interval half-widths (2, layers) and
    the test set's size for the legend."""
    got = [values.get(layer) for layer in layers]
    y = np.array([np.nan if s is None or s.accuracy is None else s.accuracy for s in got], dtype=float)
    bounds = [
        wilson_interval(v, s.num_test) if s is not None and np.isfinite(v) else (v, v)
        for v, s in zip(y, got, strict=True)
    ]
    errors = np.abs(np.array(bounds, dtype=float).reshape(len(y), 2).T - y)
    sizes = sorted({s.num_test for s in got if s is not None}) or [0]
    return y, errors, f"n {sizes[0]}" if len(sizes) == 1 else f"n {sizes[0]}-{sizes[-1]}"


def accuracy_curve(scores: Mapping[str, Mapping[str, Score]], layers: Sequence[str], chance: float) -> Png:
    """Test accuracy per layer in model order (the probing-depth curve), one line per method, each
    point with its 95% binomial (Wilson) interval; constant layers are marked, not plotted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=accuracy_size(len(layers)), layout="constrained")
    x = np.arange(len(layers))
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]  # lines that coincide stay visible
    offsets = np.linspace(-0.08, 0.08, len(scores)) if len(scores) > 1 else [0.0]  # error bars side by side
    for (method, values), (marker, line), offset in zip(scores.items(), styles * len(scores), offsets, strict=False):
        y, errors, n = _points(values, layers)
        ax.errorbar(x + offset, y, yerr=errors, marker=marker, linestyle=line, capsize=3, label=f"{method} ({n})")
    constant = [i for i, layer in enumerate(layers) if any(
        (s := v.get(layer)) is not None and s.accuracy is None for v in scores.values())]  # fmt: skip
    for i in constant:
        ax.annotate("constant", (i, chance), xytext=(0, 8), textcoords="offset points", ha="center", fontsize=8)
    ax.axhline(chance, color="grey", linestyle="--", linewidth=1, label=f"chance ({chance:.3f})")
    prefix, ticks = short_names(layers)
    ax.set_xticks(x, ticks, rotation=45 if len(layers) > 3 else 0, ha="right" if len(layers) > 3 else "center")
    ax.set_xlabel(_layer_label(prefix, "layer, in model order"))
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")  # beside the axes: never on a curve
    title = "Probe accuracy per layer"
    ax.set_title(title)
    caption = (
        "Bars: 95% Wilson intervals of each accuracy, from the number of test samples (n, in the legend); "
        "dashed line: chance, one over the number of classes"
    )
    if constant:
        caption += "; 'constant': a layer whose features are the same for every sample, so no probe can score"
    return _render(fig, title, caption + ".")


HEATMAP_MARGIN = 2.2  # inches of the page's width the heatmap's grid leaves to its axis label and colour bar
HEATMAP_CELL = (0.3, 0.8)  # inches: the least and the most height of a cell


def heatmap_size(num_rows: int, num_cols: int, label_chars: int) -> tuple[float, float]:
    """The heatmap's size: the page's width, which its grid spans (beside the row labels, axis label and
    colour bar), and the height of its rows, each as tall as a cell is wide within ``HEATMAP_CELL``.
    Square cells sized by the height alone left a few layers' grid in a corner of the page-wide canvas,
    most of it blank; so the cells take the width and are only as square as those bounds allow."""
    label = 0.08 * min(label_chars, 40)  # inches of tick labels
    across = (PAGE_WIDTH - HEATMAP_MARGIN - label) / max(num_cols, 1)
    cell = min(HEATMAP_CELL[1], max(HEATMAP_CELL[0], across))
    return PAGE_WIDTH, 1.6 + label + cell * num_rows


def colour_floor(matrix: np.ndarray) -> float:
    """The low end of the CKA colour scale: the smallest value rounded down to 0.05, at most 0.9, so
    layers that all agree above 0.9 still differ in colour (the range is written on the colour bar)."""
    finite = matrix[np.isfinite(matrix)]
    low = float(finite.min()) if finite.size else 0.0
    return min(0.9, math.floor(low * 20) / 20)


def cka_heatmap(cka: CKA, title: str = "Linear CKA between layers") -> Png:
    plt = _pyplot()
    row_prefix, rows = short_names(cka.rows)
    col_prefix, cols = short_names(cka.cols)
    chars = max(len(name) for name in [*rows, *cols])
    fig, ax = plt.subplots(figsize=heatmap_size(len(rows), len(cols), chars), layout="constrained")
    low = colour_floor(cka.matrix)
    colours = plt.get_cmap("magma").with_extremes(bad="#d9d9d9")  # NaN: a constant layer
    # "auto": the grid fills the axes heatmap_size made for it (an equal aspect left most of it blank)
    image = ax.imshow(np.ma.masked_invalid(cka.matrix), vmin=low, vmax=1, cmap=colours, aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=90)
    ax.set_yticks(range(len(rows)), rows)
    two = cka.row_store != cka.col_store
    ax.set_xlabel(_layer_label(col_prefix, f"layer of {cka.col_store} (columns)" if two else "layer"))
    ax.set_ylabel(_layer_label(row_prefix, f"layer of {cka.row_store} (rows)" if two else "layer"))
    if max(len(cka.rows), len(cka.cols)) <= 12:
        for (i, j), value in np.ndenumerate(cka.matrix):
            text = "const." if np.isnan(value) else f"{value:.2f}"
            dark = np.isfinite(value) and (value - low) / (1 - low) < 0.6
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    fig.colorbar(image, ax=ax, label=f"linear CKA (colour scale {low:.2f} to 1.00)", shrink=0.8)
    fig.suptitle(title)
    caption = (
        "Each cell compares two layers over the same samples: 1 means their features are the same up to a "
        f"rotation and scaling. The colours span {low:.2f} to 1.00"
        + (", lower values share the darkest colour" if low > 0 and np.nanmin(cka.matrix) < low else "")
        + (f"; grey 'const.' cells: a constant layer ({', '.join(cka.constant)}), whose CKA is undefined"
           if cka.constant else "")
    )  # fmt: skip
    return _render(fig, title, caption + ".")


PCA_SIZE = (PAGE_WIDTH, 5.5)


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
    caption = (
        f"Each point is one sample's {layer} features, projected on their two directions of largest variance "
        "and coloured by class: classes apart here are apart in the features."
    )
    return _render(fig, title, caption)


THUMBNAIL_CELL = 2.0  # inches, the most a thumbnail's cell takes when there are few columns
CAPTION_HEIGHT = 0.45  # inches under each thumbnail: class, similarity and file name


def neighbours_size(rows: int, cols: int) -> tuple[float, float]:
    return PAGE_WIDTH, rows * (min(THUMBNAIL_CELL, PAGE_WIDTH / cols) + CAPTION_HEIGHT) + 0.5


def short_file_name(key: str, limit: int = 24) -> str:
    """A sample's key (``cat/001.png``, ``train-000.tar/sample00017``, ``part-0.parquet/3``) in at most
    ``limit`` characters: whole when it fits, else its file name, else the end of that."""
    if len(key) <= limit:
        return key
    name = key.rstrip("/").rpartition("/")[2] or key
    return "…/" + name if len(name) <= limit - 2 else "…" + name[-(limit - 1) :]


def neighbour_grid(rows: Sequence[Sequence[tuple[np.ndarray, str]]], layer: str) -> Png:
    """One row per query: its thumbnail, then its nearest neighbours', each with a caption under it."""
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
            ax.set_xlabel(caption, fontsize=7)
            if j == 0:
                for spine in ax.spines.values():
                    spine.set_edgecolor("tab:red")
                    spine.set_linewidth(2)
    title = f"Nearest neighbours by cosine similarity of {layer}"
    fig.suptitle(title, fontsize=9)
    caption = (
        "Each row: a query sample (red frame, first column), then the samples whose features are closest to it; "
        "under each, its class, its cosine similarity to the query and its file name."
    )
    return _render(fig, title, caption)
