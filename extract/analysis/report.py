"""One self-contained HTML page about a store, with its figures embedded as PNGs.

    build_report(store, ReportConfig(layers=["layer*"], max_samples=5000)).html()

(``python -m extract.report``, in ``extract.cli.report``, is the command over ``build_report``.)

- probe accuracy per layer in model order (k-NN with ``k`` neighbours, probe's default unless given,
  and linear, on a seeded split of up to ``max_samples`` samples; or read from ``python -m
  extract.probe --json`` files), with the test set's size and a 95% binomial interval on each point;
- the linear CKA heatmap between the layers, its colour scale fitted to the values (and stated);
- a 2-D PCA of one layer (``pca_layer``, default the deepest usable one) coloured by class;
- for a few query samples, their nearest neighbours as thumbnails with their file names: from the
  image files, or read by key from the shards, Parquet files or data set the store was extracted
  from (``extract.analysis.images``); skipped, with a note, when the store has no keys or the
  images cannot be found. For a document store, the first words of each neighbouring document and
  its key, read from the text source the store was extracted from (``extract.analysis.texts``).

A layer that cannot be used is left out of each figure with a note; a constant one is marked.

Needs matplotlib: ``pip install 'extract[report]'``.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..errors import ExtractError
from ..names import Kind
from ..read.features import Features
from ..store.location import parse
from . import figures
from .cka import Side, keys_and_classes, usable_cka
from .images import SampleImages, sample_images
from .options import ReportConfig
from .probe import ProbeOptions, named, probe_rows, resolve_device, split
from .samples import Samples, UnusableLayerError, default_pool, labelled_rows, open_rows, select_layers
from .texts import SampleTexts, sample_texts

THUMBNAIL = 96  # pixels, the longer side
PAGE_PIXELS = round(figures.PAGE_WIDTH * figures.DPI)  # the page's column, as wide as every figure
CLASSES_SHOWN = 20  # class names listed in the summary (the PCA legend shows as many)


@dataclass(frozen=True)
class Passage:
    """One document in the text neighbours: what it is to the query (its class, its similarity), its key
    and its first words."""

    caption: str
    key: str
    text: str


@dataclass
class Report:
    title: str
    summary: list[tuple[str, str]]
    figures: list[figures.Png] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    table: list[list[str]] = field(default_factory=list)
    # a document store's neighbours, as text (a picture of text would be neither searchable nor readable)
    passages_title: str = ""
    passages: list[list[Passage]] = field(default_factory=list)  # per query: the query, then its neighbours

    def html(self) -> str:
        rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in self.summary)
        parts = [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{html.escape(self.title)}</title>",
            f"<style>body{{font-family:sans-serif;max-width:{PAGE_PIXELS}px;margin:2em auto;padding:0 1em}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
            # a figure is drawn at the page's width: 1:1 there, scaled down (keeping its shape) on a narrower one
            "figure{margin:2em 0}figure img{width:100%;height:auto}figcaption{color:#555}"
            ".passages li{margin:.3em 0}.passages code{color:#555}</style></head><body>",
            f"<h1>{html.escape(self.title)}</h1>",
            f"<table>{rows}</table>",
        ]
        if self.table:
            head, *body = self.table
            parts.append("<h2>Probe accuracy</h2><table>")
            parts.append("<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>")
            parts.extend("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
            parts.append("</table>")
        for png in self.figures:
            data = base64.b64encode(png.data).decode("ascii")
            parts.append(
                f'<figure><img src="data:image/png;base64,{data}" width="{png.width}" height="{png.height}" '
                f'alt="{html.escape(png.title)}">'
                + (f"<figcaption>{html.escape(png.caption)}</figcaption>" if png.caption else "")
                + "</figure>"
            )
        if self.passages:
            parts.append(f"<h2>{html.escape(self.passages_title)}</h2>")
            parts.extend(_passages_html(query, neighbours) for query, *neighbours in self.passages)
        if self.notes:
            parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in self.notes) + "</ul>")
        parts.append("</body></html>")
        return "\n".join(parts) + "\n"


def _passages_html(query: Passage, neighbours: Sequence[Passage]) -> str:
    def line(passage: Passage) -> str:
        return (
            f"<b>{html.escape(passage.caption)}</b> <code>{html.escape(passage.key)}</code><br>"
            f"{html.escape(passage.text)}"
        )

    items = "".join(f"<li>{line(passage)}</li>" for passage in neighbours)
    head = f"{html.escape(query.caption)} <code>{html.escape(query.key)}</code>"
    return f'<div class="passages"><h3>{head}</h3><p>{html.escape(query.text)}</p><ol>{items}</ol></div>'


def thumbnail(image: Image.Image) -> np.ndarray:
    image = image.convert("RGB")
    image.thumbnail((THUMBNAIL, THUMBNAIL))
    return np.asarray(image)


def _class_name(label: int, classes: list[str] | None) -> str:
    if label < 0:
        return "no label"
    return classes[label] if classes and label < len(classes) else f"class {label}"


def _read_probe_json(paths: Sequence[str | Path]) -> dict[str, dict[str, figures.Score]]:
    scores: dict[str, dict[str, figures.Score]] = {}
    for path in paths:
        try:
            record = json.loads(Path(path).read_text())
            scores.setdefault(record["layers"][0]["method"], {}).update(
                {r["layer"]: figures.Score(r["test_accuracy"], int(r.get("num_test", 0))) for r in record["layers"]}
            )
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise ExtractError(f"--probe-json {path}: not a file written by extract.probe --json ({e})") from None
    return scores


def _cell(score: figures.Score | None) -> str:
    if score is None:
        return ""
    if score.accuracy is None:
        return "constant"
    low, high = figures.wilson_interval(score.accuracy, score.num_test)
    return f"{score.accuracy:.3f} [{low:.3f}, {high:.3f}]"


def _accuracy_figures(
    report: Report, features: Features, layers: list[str], rows: np.ndarray, config: ReportConfig
) -> None:
    scores = _read_probe_json(config.probe_json)
    num_classes = int(features.labels.max()) + 1
    if not config.probe_json:
        labelled = np.intersect1d(rows, labelled_rows(features))
        if len(labelled) < 10:
            report.notes.append("probe accuracy skipped: fewer than 10 labelled samples")
            return
        train, test = split(labelled, 0.2, config.seed)
        how = f"{len(train)} train / {len(test)} test samples, seed {config.seed}"
        for method in ("knn", "linear"):
            options = ProbeOptions(method=method, seed=config.seed, device=config.device, k=config.k)
            lines: list[str] = []
            records = probe_rows(features, train, features, test, layers, options, how=how, log=lines.append)
            if method == "knn":  # the same layers are skipped for both methods: say it once
                report.notes += [f"probe: {line}" for line in lines if line.partition(": ")[0] not in records]
            scores[method if method == "linear" else f"k-NN (k {options.k}, T {options.temperature:g})"] = {
                layer: figures.Score(r["test_accuracy"], r["num_test"]) for layer, r in records.items()
            }
        report.notes.append(f"probes on a seeded split of the store: {how}")
    sizes = sorted({s.num_test for values in scores.values() for s in values.values()})
    report.table = [["layer", *(f"{method} [95% interval]" for method in scores), "test samples"]] + [
        [layer, *(_cell(values.get(layer)) for values in scores.values()),
         "/".join(str(n) for n in sorted({v[layer].num_test for v in scores.values() if layer in v}))]
        for layer in layers
    ]  # fmt: skip
    if len(sizes) == 1:
        report.notes.append(f"probe accuracies are measured on {sizes[0]} test samples")
    report.figures.append(figures.accuracy_curve(scores, layers, 1 / max(1, num_classes)))


def _cka_figure(report: Report, features: Features, layers: list[str], rows: np.ndarray, config: ReportConfig) -> None:
    if len(layers) < 2:
        report.notes.append("CKA heatmap skipped: one layer only")
        return
    pools = {layer: default_pool(features, layer) for layer in layers}
    cka = usable_cka(Side(features, layers, pools, rows), seed=config.seed, device=config.device)
    report.notes += [f"CKA: {note}" for note in cka.notes]
    report.figures.append(figures.cka_heatmap(cka, f"Linear CKA between layers ({cka.num_samples} samples)"))


def _pca_figure(report: Report, samples: Samples, classes: list[str] | None) -> None:
    values = samples.load().double()
    values -= values.mean(0)
    _, singular, basis = torch.linalg.svd(values, full_matrices=False)
    points = (values @ basis[:2].T).numpy()
    variance = (singular.square() / singular.square().sum())[:2].tolist()
    names = [_class_name(label, classes) for label in range(int(samples.labels.max()) + 1)]
    report.figures.append(figures.pca_scatter(points, samples.labels, names, variance, samples.layer))


def _neighbour_figure(report: Report, samples: Samples, config: ReportConfig) -> None:
    keys, classes = keys_and_classes(samples.features)
    if keys is not None and samples.features.kind is Kind.DOCUMENTS:
        _neighbour_texts(report, samples, [str(keys[row]) for row in samples.rows], classes, config)
        return
    if keys is None:
        report.notes.append(
            "nearest-neighbour thumbnails skipped: the store has no keys (an older store or synthetic data)"
        )
        return
    images = sample_images(samples.features, [str(keys[row]) for row in samples.rows])
    if isinstance(images, str):
        report.notes.append(f"nearest-neighbour thumbnails skipped: {images}")
        return
    grid, queries = _neighbour_rows(samples, images, classes, config)
    if len(queries) == 0:
        report.notes.append(f"nearest-neighbour thumbnails skipped: fewer than 2 images could be read ({images.where})")
        return
    report.figures.append(figures.neighbour_grid(grid, samples.layer))
    report.notes.append(f"neighbour queries ({images.where}): {', '.join(images.keys[q] for q in queries)}")


def _neighbour_texts(
    report: Report, samples: Samples, keys: list[str], classes: list[str] | None, config: ReportConfig
) -> None:
    """A document store's neighbours: per query, the first words of it and of its nearest documents."""
    texts = sample_texts(samples.features, keys)
    if isinstance(texts, str):
        report.notes.append(f"nearest-neighbour documents skipped: {texts}")
        return
    found = np.array([texts.has(key) for key in keys])
    queries, order = _nearest(samples, found, config)
    if len(queries) == 0:
        report.notes.append(
            f"nearest-neighbour documents skipped: fewer than 2 documents could be read ({texts.where})"
        )
        return
    report.passages_title = f"Nearest neighbours by cosine similarity of {samples.layer}"
    for query, (neighbours, similarity) in zip(queries, order, strict=True):
        label = _class_name(int(samples.labels[query]), classes)
        row = [_passage(texts, keys[query], f"query: {label}")]
        row += [
            _passage(texts, keys[i], f"{_class_name(int(samples.labels[i]), classes)} ({similarity[i]:.2f})")
            for i in neighbours
        ]
        report.passages.append(row)
    report.notes.append(f"neighbour queries ({texts.where}): {', '.join(keys[q] for q in queries)}")


def _passage(texts: SampleTexts, key: str, caption: str) -> Passage:
    return Passage(caption, key, texts.text(key) or "(the document cannot be read)")


def _nearest(
    samples: Samples, found: np.ndarray, config: ReportConfig
) -> tuple[np.ndarray, list[tuple[list[int], np.ndarray]]]:
    """The query positions (seeded, among those ``found``) and, per query, its nearest ``found`` neighbours
    by cosine similarity (positions in ``samples``) with every sample's similarity to it."""
    if found.sum() < 2:
        return np.array([], dtype=int), []
    values = torch.nn.functional.normalize(samples.load(), dim=1)
    rng = np.random.default_rng((config.seed, 4))
    queries = rng.choice(np.flatnonzero(found), min(config.queries, int(found.sum())), replace=False)
    nearest = []
    for query in queries:
        similarity = values @ values[query]
        similarity[query] = -np.inf
        similarity[torch.from_numpy(~found)] = -np.inf
        order = similarity.argsort(descending=True)[: config.neighbours].tolist()
        nearest.append(([i for i in order if similarity[i] > -np.inf], similarity.numpy()))
    return queries, nearest


def _neighbour_rows(
    samples: Samples, images: SampleImages, classes: list[str] | None, config: ReportConfig
) -> tuple[list[list[tuple[np.ndarray, str]]], np.ndarray]:
    """One row of (thumbnail, caption) per query: the query, then its nearest neighbours among the
    samples whose image can be read; and the queries' positions in ``samples``."""
    found = np.array([images.has(i) for i in range(len(images.keys))])
    queries, nearest = _nearest(samples, found, config)
    if len(queries) == 0:
        return [], queries

    def cell(i: int, what: str) -> tuple[np.ndarray, str]:
        image = images.image(i)
        pixels = thumbnail(image) if image is not None else np.full((THUMBNAIL, THUMBNAIL, 3), 220, np.uint8)
        return pixels, f"{what}\n{figures.short_file_name(images.keys[i])}"

    grid = []
    for query, (order, similarity) in zip(queries, nearest, strict=True):
        row = [cell(query, f"query: {_class_name(int(samples.labels[query]), classes)}")]
        row += [cell(i, f"{_class_name(int(samples.labels[i]), classes)} ({float(similarity[i]):.2f})") for i in order]
        grid.append(row)
    return grid, queries


def _pca_samples(
    report: Report, features: Features, layers: list[str], rows: np.ndarray, config: ReportConfig
) -> Samples | None:
    """The samples of the PCA and neighbour figures: ``pca_layer``, or the deepest layer that can be
    read and is not constant; None (with a note) when there is none."""
    pca_rows = rows
    if len(rows) > config.pca_samples:
        pca_rows = np.sort(np.random.default_rng((config.seed, 6)).choice(rows, config.pca_samples, replace=False))
    for layer in [config.pca_layer] if config.pca_layer else reversed(layers):
        samples = Samples(features, layer, default_pool(features, layer), pca_rows)
        try:
            if not samples.constant:
                return samples
            report.notes.append(f"PCA and neighbours: layer '{layer}' is constant (the same for every sample)")
        except UnusableLayerError as e:
            report.notes.append(f"PCA and neighbours: {e.note}")
    report.notes.append("PCA and nearest-neighbour figures skipped: no layer for them")
    return None


def build_report(store: str | Path, config: ReportConfig | None = None) -> Report:
    """The report on ``store``: its figures and notes, ready for ``Report.html()``."""
    config = config or ReportConfig()
    config = dataclasses.replace(config, device=resolve_device(config.device))
    figures.require_matplotlib()  # a missing matplotlib stops here, before any work
    features = open_rows(store, "extract.report")
    layers = select_layers(features.layers, config.layers, store=features.path)
    if config.pca_layer:
        select_layers(features.layers, [config.pca_layer], store=features.path)
    valid = np.flatnonzero(features.valid)
    rows = valid
    if len(valid) > config.max_samples:
        rows = np.sort(np.random.default_rng((config.seed, 5)).choice(valid, config.max_samples, replace=False))
    attrs = features.attrs
    _, classes = keys_and_classes(features)
    report = Report(
        f"extract report: {parse(store).name}",
        [("store", str(store)), ("model", str(attrs.get("model"))), ("weights", str(attrs.get("weights"))),
         ("dataset", str(attrs.get("dataset"))), (features.kind.rows, f"{features.num_samples} ({len(rows)} used here)"),
         ("layers", ", ".join(layers))],
    )  # fmt: skip
    if classes:  # the names the labels index (a ClassLabel, a dictionary column, the strings of a jsonl field)
        report.summary.append(("classes", f"{len(classes)}{named(classes, CLASSES_SHOWN)}"))
    _accuracy_figures(report, features, layers, rows, config)
    _cka_figure(report, features, layers, rows, config)
    pca_samples = _pca_samples(report, features, layers, rows, config)
    if pca_samples is not None:
        _pca_figure(report, pca_samples, classes)
        _neighbour_figure(report, pca_samples, config)
    return report
