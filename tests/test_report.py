"""The HTML report: figures embedded as PNGs that decode at their declared sizes, thumbnails found from keys."""

import base64
import io
import re
import sys
from pathlib import Path

import pytest
from PIL import Image

from extract import ExtractError, open_features
from extract.analysis import figures
from extract.analysis.report import ReportConfig, build_report
from extract.cli.report import main

IMAGES = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" width="(\d+)" height="(\d+)" alt="([^"]*)"')


def embedded(html):
    """(title, decoded PIL image, declared width, declared height) per figure."""
    found = []
    for data, width, height, title in IMAGES.findall(html):
        image = Image.open(io.BytesIO(base64.b64decode(data)))
        image.load()  # decodes the whole PNG
        found.append((title, image, int(width), int(height)))
    return found


def pixels(inches):
    return tuple(round(v * figures.DPI) for v in inches)


@pytest.fixture(scope="module")
def folder_store(tmp_path_factory, png_tree):
    from extract.cli.extract import main as extract_main

    root, files = png_tree
    out = tmp_path_factory.mktemp("report") / "folder.zarr"
    assert extract_main(["--model", "resnet18", "--weights", "none", "--image-size", "32", "--layers", "layer2",
                         "layer3", "layer4", "--pool", "avg", "--data", f"imagefolder:{root}", "--chunk-size", "4",
                         "--num-workers", "0", "--out", str(out)]) == 0  # fmt: skip
    features = open_features(out)  # the extraction records where each row came from, and the class names
    assert features.keys.tolist() == [str(path.relative_to(root)) for path, _ in files]
    assert features.classes == ["cat", "dog"]
    return out


def test_report_embeds_every_figure_at_its_size(folder_store, png_tree, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main([str(folder_store), "--out", str(out), "--queries", "3", "--neighbours", "4"]) == 0
    assert capsys.readouterr().out.startswith(f"{out}: 4 figures")
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>") and 'src="http' not in html  # self-contained
    found = embedded(html)
    titles = [title for title, *_ in found]
    assert titles[0] == "Probe accuracy per layer"
    assert titles[1].startswith("Linear CKA between layers (13 samples)")
    assert titles[2] == "PCA of layer4 (13 samples)"
    assert titles[3].startswith("Nearest neighbours by cosine similarity of layer4")
    expected = [
        pixels(figures.accuracy_size(3)),
        pixels(figures.heatmap_size(3, 3, len("layer2"))),
        pixels(figures.PCA_SIZE),
        pixels(figures.neighbours_size(3, 5)),  # 3 queries, each with 4 neighbours
    ]
    for (title, image, width, height), size in zip(found, expected, strict=True):
        assert image.format == "PNG" and image.size == (width, height) == size, title
        assert len(image.getcolors(2**16) or range(2**16)) > 8, f"{title} is blank"
    # the probe table lists every layer with both methods
    assert "<th>layer</th><th>k-NN (k 20, T 0.07)</th><th>linear</th>" in html
    assert html.count("<tr><td>layer") == 3
    # thumbnails come from the images on disk, found from the keys
    queries = re.search(r"neighbour queries \(under [^)]*\): ([^<]*)</li>", html).group(1).split(", ")
    assert len(queries) == 3 and all((png_tree[0] / key).is_file() for key in queries)
    assert "thumbnails skipped" not in html


def test_report_without_image_files_skips_thumbnails_with_a_note(cli, tmp_path, capsys):
    store = tmp_path / "synthetic.zarr"
    code, _, err = cli("--model", "resnet18", "--weights", "none", "--image-size", "32", "--layers", "layer3",
                       "layer4", "--pool", "avg", "--data", "synthetic:30", "--num-workers", "0", "--out", store)  # fmt: skip
    assert code == 0, err
    out = tmp_path / "r.html"
    assert main([str(store), "--out", str(out), "--layers", "layer*"]) == 0
    html = out.read_text()
    assert len(embedded(html)) == 3
    assert "nearest-neighbour thumbnails skipped: the keys of &#x27;synthetic:30&#x27; are not file paths" in html


def test_thumbnails_are_found_where_the_source_said_its_images_live(cli, png_tree, tmp_path, monkeypatch):
    import zarr

    root, _ = png_tree
    monkeypatch.chdir(root.parent)  # --data names the folder relative to where the extraction ran
    store = tmp_path / "relative.zarr"
    code, _, err = cli("--model", "resnet18", "--weights", "none", "--image-size", "32", "--layers", "layer4",
                       "--pool", "avg", "--data", f"imagefolder:{root.name}", "--num-workers", "0", "--out", store)  # fmt: skip
    assert code == 0, err

    def notes(where: Path) -> str:
        monkeypatch.chdir(where)
        out = tmp_path / "r.html"
        assert main([str(store), "--out", str(out), "--queries", "2", "--neighbours", "2"]) == 0
        return out.read_text()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert f"neighbour queries (under {root.resolve()}):" in notes(elsewhere)
    # a store written before the sources recorded image_root: its --data is read, relative to here
    group = zarr.open_group(store, mode="r+")
    group.attrs.put({key: value for key, value in group.attrs.asdict().items() if key != "image_root"})
    assert f"neighbour queries (under {root.name}):" in notes(root.parent)
    assert f"the image files are not under {root.name} any more" in notes(elsewhere)


def test_report_uses_probe_json_and_names_the_extra_without_matplotlib(folder_store, tmp_path, capsys, monkeypatch):
    from extract.cli.probe import main as probe_main

    accuracies = tmp_path / "knn.json"
    assert probe_main([str(folder_store), "--method", "knn", "--json", str(accuracies)]) == 0
    out = tmp_path / "r.html"
    assert main([str(folder_store), "--out", str(out), "--probe-json", str(accuracies)]) == 0
    assert "<th>layer</th><th>knn</th>" in out.read_text()
    capsys.readouterr()
    # the library takes the same settings as a typed config
    report = build_report(folder_store, ReportConfig(layers=["layer3", "layer4"], probe_json=[accuracies], queries=2))
    assert report.table[0] == ["layer", "knn"] and [row[0] for row in report.table[1:]] == ["layer3", "layer4"]
    assert report.figures[2].title == "PCA of layer4 (13 samples)"
    grid = report.figures[3]  # 2 queries, each with the default 6 neighbours
    assert (grid.width, grid.height) == pixels(figures.neighbours_size(2, 7))
    assert any(note.startswith("neighbour queries") and note.count(", ") == 1 for note in report.notes)

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main([str(folder_store), "--out", str(tmp_path / "none.html")]) == 2
    err = capsys.readouterr().err
    assert (
        err == "extract.report: error: figures need matplotlib, which is not installed: pip install 'extract[report]'\n"
    )
    assert not (tmp_path / "none.html").exists()


def test_report_config_is_checked_when_made():
    message = "--max-samples and --pca-samples must be at least 10, --queries and --neighbours positive"
    for settings in ({"max_samples": 9}, {"pca_samples": 5}, {"queries": 0}, {"neighbours": 0}):
        with pytest.raises(ExtractError, match=message):
            ReportConfig(**settings)
    assert ReportConfig().max_samples == 5000


def test_tick_labels_drop_the_prefix_every_layer_shares():
    assert figures.short_names(["encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_11"]) == (
        "encoder.layers.",
        ["encoder_layer_0", "encoder_layer_11"],
    )
    assert figures.short_names(["layer1.0", "layer1.1", "layer2.0"]) == ("", ["layer1.0", "layer1.1", "layer2.0"])
    assert figures.short_names(["blocks.0", "blocks"]) == ("", ["blocks.0", "blocks"])  # never an empty name
