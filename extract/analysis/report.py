"""One self-contained HTML page about a store, with its figures embedded as PNGs.

    build_report(store, ReportConfig(layers=["layer*"], max_samples=5000)).html()

(``python -m extract.report``, in ``extract.cli.report``, is the command over ``build_report``.)

- probe accuracy per layer in model order (k-NN and linear, on a seeded split of up to
  ``max_samples`` samples; or read from ``python -m extract.probe --json`` files);
- the linear CKA heatmap between the layers;
- a 2-D PCA of one layer (``pca_layer``, default the deepest) coloured by class;
- for a few query samples whose image files can be found from the store's keys, their nearest
  neighbours as thumbnails (skipped, with a note, when the store has no keys or the files moved).

Needs matplotlib: ``pip install 'extract[report]'``.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..errors import ExtractError
from ..read.features import Features, open_features
from . import figures
from .cka import Side, keys_and_classes, minibatch_cka
from .probe import ProbeOptions, probe_rows, resolve_device, split
from .samples import Samples, default_pool, labelled_rows, select_layers

THUMBNAIL = 96  # pixels, the longer side


@dataclass(frozen=True)
class ReportConfig:
    """What the report shows and from how many samples (the flags of ``python -m extract.report``);
    checked when made."""

    layers: Sequence[str] | None = None  # names or globs; None: every stored layer
    pca_layer: str | None = None  # the layer of the PCA and neighbour figures; None: the deepest
    probe_json: Sequence[str | Path] = ()  # accuracies from ``extract.probe --json`` instead of probing here
    max_samples: int = 5000  # drawn at random, for the probes and CKA
    pca_samples: int = 2000
    queries: int = 4  # query samples with neighbour thumbnails
    neighbours: int = 6  # shown per query
    seed: int = 0
    device: str | torch.device | None = None  # None: a GPU if there is one

    def __post_init__(self) -> None:
        if min(self.max_samples, self.pca_samples) < 10 or self.queries < 1 or self.neighbours < 1:
            raise ExtractError(
                "--max-samples and --pca-samples must be at least 10, --queries and --neighbours positive"
            )


@dataclass
class Report:
    title: str
    summary: list[tuple[str, str]]
    figures: list[figures.Png] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    table: list[list[str]] = field(default_factory=list)

    def html(self) -> str:
        rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in self.summary)
        parts = [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{html.escape(self.title)}</title>",
            "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
            "figure{margin:2em 0}img{max-width:100%}figcaption{color:#555}</style></head><body>",
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
                f'alt="{html.escape(png.title)}"><figcaption>{html.escape(png.title)}</figcaption></figure>'
            )
        if self.notes:
            parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in self.notes) + "</ul>")
        parts.append("</body></html>")
        return "\n".join(parts) + "\n"


def image_root(attrs: Mapping[str, Any]) -> Path | None:
    """The folder the store's keys are relative to, for data sources whose keys are file paths: as
    the source said at extraction (``attrs["image_root"]``), or for a store written before it was
    recorded, as its ``--data`` says."""
    if "image_root" in attrs:
        return Path(attrs["image_root"])
    return legacy_image_root(attrs.get("dataset"))


def legacy_image_root(dataset: str | None) -> Path | None:
    """For stores without ``image_root`` (written before the sources recorded it): the folder of an
    ``imagefolder:`` or ``filelist:`` spec, relative to the current directory. The one place that
    reads a ``--data`` string after extraction; newer stores never come here."""
    kind, _, rest = (dataset or "").partition(":")
    if kind == "imagefolder":
        return Path(rest)
    if kind == "filelist":
        return Path(rest).parent
    return None


def thumbnail(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        image = image.convert("RGB")
        image.thumbnail((THUMBNAIL, THUMBNAIL))
        return np.asarray(image)


def _class_name(label: int, classes: list[str] | None) -> str:
    if label < 0:
        return "no label"
    return classes[label] if classes and label < len(classes) else f"class {label}"


def _accuracy_figures(
    report: Report, features: Features, layers: list[str], rows: np.ndarray, config: ReportConfig
) -> None:
    accuracies: dict[str, dict[str, float]] = {}
    for path in config.probe_json:
        try:
            record = json.loads(Path(path).read_text())
            accuracies.setdefault(record["layers"][0]["method"], {}).update(
                {r["layer"]: r["test_accuracy"] for r in record["layers"]}
            )
        except (OSError, ValueError, KeyError, IndexError) as e:
            raise ExtractError(f"--probe-json {path}: not a file written by extract.probe --json ({e})") from None
    num_classes = int(features.labels.max()) + 1
    if not config.probe_json:
        labelled = np.intersect1d(rows, labelled_rows(features))
        if len(labelled) < 10:
            report.notes.append("probe accuracy skipped: fewer than 10 labelled samples")
            return
        train, test = split(labelled, 0.2, config.seed)
        how = f"{len(train)} train / {len(test)} test samples, seed {config.seed}"
        for method in ("knn", "linear"):
            options = ProbeOptions(method=method, seed=config.seed, device=config.device)
            records = probe_rows(features, train, features, test, layers, options, how=how, log=lambda line: None)
            accuracies[method if method == "linear" else "k-NN (k 20, T 0.07)"] = {
                layer: r["test_accuracy"] for layer, r in records.items()
            }
        report.notes.append(f"probes on a seeded split of the store: {how}")
    report.table = [["layer", *accuracies]] + [
        [layer, *(f"{values[layer]:.3f}" if layer in values else "" for values in accuracies.values())]
        for layer in layers
    ]
    report.figures.append(figures.accuracy_curve(accuracies, layers, 1 / max(1, num_classes)))


def _cka_figure(report: Report, features: Features, layers: list[str], rows: np.ndarray, config: ReportConfig) -> None:
    if len(layers) < 2:
        report.notes.append("CKA heatmap skipped: one layer only")
        return
    pools = {layer: default_pool(features, layer) for layer in layers}
    cka = minibatch_cka(Side(features, layers, pools, rows), seed=config.seed, device=config.device)
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
    root = image_root(samples.features.attrs)
    if keys is None:
        report.notes.append(
            "nearest-neighbour thumbnails skipped: the store has no keys (an older store or synthetic data)"
        )
        return
    if root is None:
        report.notes.append(
            f"nearest-neighbour thumbnails skipped: the keys of '{samples.features.attrs.get('dataset')}' are not file paths"
        )
        return
    files = [root / str(keys[row]) for row in samples.rows]
    found = np.array([f.is_file() for f in files])
    if found.sum() < 2:
        report.notes.append(f"nearest-neighbour thumbnails skipped: the image files are not under {root} any more")
        return
    values = torch.nn.functional.normalize(samples.load(), dim=1)
    rng = np.random.default_rng((config.seed, 4))
    queries = rng.choice(np.flatnonzero(found), min(config.queries, int(found.sum())), replace=False)
    grid = []
    for query in queries:
        similarity = values @ values[query]
        similarity[query] = -np.inf
        similarity[torch.from_numpy(~found)] = -np.inf
        order = similarity.argsort(descending=True)[: config.neighbours].tolist()
        label = int(samples.labels[query])
        row = [(thumbnail(files[query]), f"query: {_class_name(label, classes)}")]
        row += [
            (thumbnail(files[i]), f"{_class_name(int(samples.labels[i]), classes)} ({float(similarity[i]):.2f})")
            for i in order
            if similarity[i] > -np.inf
        ]
        grid.append(row)
    report.figures.append(figures.neighbour_grid(grid, samples.layer))
    report.notes.append(f"neighbour queries (under {root}): {', '.join(str(keys[samples.rows[q]]) for q in queries)}")


def build_report(store: str | Path, config: ReportConfig | None = None) -> Report:
    """The report on ``store``: its figures and notes, ready for ``Report.html()``."""
    config = config or ReportConfig()
    config = dataclasses.replace(config, device=resolve_device(config.device))
    figures.require_matplotlib()  # a missing matplotlib stops here, before any work
    features = open_features(store)
    layers = select_layers(features.layers, config.layers, store=features.path)
    pca_layer = config.pca_layer or layers[-1]
    select_layers(features.layers, [pca_layer], store=features.path)
    valid = np.flatnonzero(features.valid)
    rows = valid
    if len(valid) > config.max_samples:
        rows = np.sort(np.random.default_rng((config.seed, 5)).choice(valid, config.max_samples, replace=False))
    attrs = features.attrs
    report = Report(
        f"extract report: {Path(store).name}",
        [("store", str(store)), ("model", str(attrs.get("model"))), ("weights", str(attrs.get("weights"))),
         ("dataset", str(attrs.get("dataset"))), ("samples", f"{features.num_samples} ({len(rows)} used here)"),
         ("layers", ", ".join(layers))],
    )  # fmt: skip
    _accuracy_figures(report, features, layers, rows, config)
    _cka_figure(report, features, layers, rows, config)
    _, classes = keys_and_classes(features)
    pca_rows = rows
    if len(rows) > config.pca_samples:
        pca_rows = np.sort(np.random.default_rng((config.seed, 6)).choice(rows, config.pca_samples, replace=False))
    pca_samples = Samples(features, pca_layer, default_pool(features, pca_layer), pca_rows)
    _pca_figure(report, pca_samples, classes)
    _neighbour_figure(report, pca_samples, config)
    return report
