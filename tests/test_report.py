"""The HTML report: figures embedded as PNGs that decode at their declared sizes, thumbnails found from keys."""

import base64
import io
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from extract import ExtractError, open_features
from extract.analysis import figures
from extract.analysis.cka import CKA
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
    head = (
        "<th>layer</th><th>k-NN (k 20, T 0.07) [95% interval]</th><th>linear [95% interval]</th><th>test samples</th>"
    )
    assert head in html and html.count("<tr><td>layer") == 3
    assert re.search(r"<td>layer2</td><td>\d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\]</td>.*?<td>3</td></tr>", html)
    assert "probe accuracies are measured on 3 test samples" in html  # 13 samples, 20% held out
    # figures span the page, and their captions say how to read them rather than repeating the title
    assert (
        "figure img{width:100%;height:auto}" in html and f"max-width:{figures.PAGE_WIDTH * figures.DPI:.0f}px" in html
    )
    assert all(width == figures.PAGE_WIDTH * figures.DPI for _, _, width, _ in found)
    captions = re.findall(r"<figcaption>([^<]*)</figcaption>", html)
    assert len(captions) == 4 and not any(title in caption for title in titles for caption in captions)
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
    assert "<th>layer</th><th>knn [95% interval]</th><th>test samples</th>" in out.read_text()
    capsys.readouterr()
    # the library takes the same settings as a typed config
    report = build_report(folder_store, ReportConfig(layers=["layer3", "layer4"], probe_json=[accuracies], queries=2))
    assert report.table[0] == ["layer", "knn [95% interval]", "test samples"] and [
        row[0] for row in report.table[1:]
    ] == ["layer3", "layer4"]
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


def test_file_names_are_shortened_from_the_front():
    assert figures.short_file_name("cat/001.png") == "cat/001.png"
    assert figures.short_file_name("imagenet/n01440764/n01440764_10026.JPEG") == "…/n01440764_10026.JPEG"
    assert figures.short_file_name("x/" + "a" * 40 + ".png") == "…" + ("a" * 40 + ".png")[-23:]


def test_the_cka_colour_scale_spans_the_values_and_says_so():
    agreeing = np.array([[1.0, 0.93], [0.93, 1.0]])
    assert figures.colour_floor(agreeing) == 0.9  # 0.90-1.00 fills the whole scale
    assert figures.colour_floor(np.array([[1.0, 0.42], [0.42, np.nan]])) == 0.4
    assert figures.colour_floor(np.array([[1.0, -0.07]])) == -0.1  # the unbiased estimator dips below 0
    cka = CKA(["a", "b"], ["a", "b"], agreeing, 50, "")
    png = figures.cka_heatmap(cka)
    assert "The colours span 0.90 to 1.00" in png.caption and png.title not in png.caption


def test_accuracy_points_carry_wilson_intervals():
    low, high = figures.wilson_interval(0.8, 50)
    assert (round(low, 4), round(high, 4)) == (0.6696, 0.8876)  # the Wilson score interval, z = 1.96
    assert figures.wilson_interval(1.0, 10)[1] == pytest.approx(1.0) and figures.wilson_interval(1.0, 10)[0] < 0.75
    assert figures.wilson_interval(0.5, 10_000)[1] - 0.5 == pytest.approx(1.96 * 0.005, rel=1e-3)


def write_source(kind, root):
    """Ten images in the given source format; returns the --data spec (absolute paths)."""
    from helpers.data_files import encoded_image, write_shards

    if kind == "wds":
        write_shards(root / "shards", [6, 4])
        return f"wds:{root / 'shards'}"
    images, labels = [encoded_image(i) for i in range(10)], [i % 2 for i in range(10)]
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    data = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in images], "label": labels}, features=features
    )
    if kind == "parquet":
        (root / "pq").mkdir()
        data.to_parquet(str(root / "pq" / "part-0.parquet"))
        return f"parquet:{root / 'pq' / 'part-0.parquet'}"
    data.save_to_disk(str(root / "ds"))
    return f"hf:{root / 'ds'}"


@pytest.mark.parametrize("kind", ["wds", "parquet", "hf"])
def test_thumbnails_are_read_by_key_from_shards_parquet_and_hf(kind, tmp_path, monkeypatch):
    from extract.cli.extract import main as extract_main

    spec = write_source(kind, tmp_path)
    store = tmp_path / "s.zarr"
    assert extract_main(["--model", "resnet18", "--weights", "none", "--image-size", "32", "--layers", "layer4",
                         "--pool", "avg", "--data", spec, "--chunk-size", "4", "--num-workers", "0",
                         "--out", str(store)]) == 0  # fmt: skip
    keys = open_features(store).keys.tolist()
    drawn = []
    original = figures.neighbour_grid
    monkeypatch.setattr(figures, "neighbour_grid", lambda rows, layer: drawn.append(rows) or original(rows, layer))
    monkeypatch.chdir(tmp_path / "..")  # the report need not run where the extraction did
    report = build_report(store, ReportConfig(queries=2, neighbours=2))
    assert not [note for note in report.notes if "thumbnails skipped" in note], report.notes
    assert any(note.startswith(f"neighbour queries (read from {spec}): ") for note in report.notes)
    grid = report.figures[-1]
    assert grid.title == "Nearest neighbours by cosine similarity of layer4"
    assert (grid.width, grid.height) == pixels(figures.neighbours_size(2, 3))
    (rows,) = drawn
    captions = [caption for row in rows for _, caption in row]
    names = {figures.short_file_name(key) for key in keys}
    assert len(captions) == 6 and all(caption.split("\n")[1] in names for caption in captions)  # each names its key
    assert all(len(np.unique(image)) > 8 for row in rows for image, _ in row)  # real images, no blank placeholder


def test_report_leaves_out_an_unusable_layer_and_marks_a_constant_one(tmp_path):
    from helpers.stores import array_store

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 60)
    x = (rng.normal(size=(60, 8)) + labels[:, None]).astype(np.float32)
    layers = {"a": x, "b": x[:, :4] * 2, "cls0": np.tile(np.float32([1, 2, 3]), (60, 1)), "broken": x}
    store = array_store(tmp_path / "s.zarr", layers, labels, chunk_size=16)
    (store / "features" / "broken" / "c" / "1" / "0").unlink()  # a lost object: that layer cannot be read
    report = build_report(store, ReportConfig(max_samples=60))
    notes = " | ".join(report.notes)
    assert "probe: broken: skipped (" in notes and "is missing" in notes
    assert f"CKA: skipped layer 'broken' of {store}: " in notes
    assert "CKA: layer 'cls0' is constant" in notes
    assert "PCA and neighbours: layer 'cls0' is constant" in notes
    assert [row[0] for row in report.table[1:]] == ["a", "b", "cls0", "broken"]
    assert report.table[3][1:3] == ["constant", "constant"] and report.table[4][1:3] == ["", ""]
    titles = [png.title for png in report.figures]
    assert titles[0] == "Probe accuracy per layer" and titles[2] == "PCA of b (60 samples)"
    assert "'constant': a layer whose features are the same" in report.figures[0].caption
    assert "grey 'const.' cells: a constant layer (cls0)" in report.figures[1].caption


def test_a_document_store_shows_its_neighbours_as_text_read_from_its_source(tmp_path, capsys):
    """A document store's neighbours are the first words of each document and its key, read back through
    the text source the store records (not thumbnails, not 'the keys are not file paths')."""
    import html as html_module

    from helpers.text_models import real_documents, save_text_model, write_jsonl

    from extract.cli.extract import main as extract_main

    documents = real_documents(24)
    write_jsonl(tmp_path / "docs.jsonl", documents, label=[i % 2 for i in range(len(documents))])
    model = save_text_model("gpt2", tmp_path / "gpt2")
    store = tmp_path / "docs.zarr"
    assert extract_main(["--model", f"hf:{model}", "--layers", "transformer.h.0", "hidden_states.2", "--data",
                         f"text:{tmp_path / 'docs.jsonl'}", "--label-key", "label", "--pool", "mean",
                         "--context-length", "64", "--out", str(store)]) == 0  # fmt: skip
    out = tmp_path / "r.html"
    assert main([str(store), "--out", str(out), "--queries", "2", "--neighbours", "3"]) == 0
    page = out.read_text()
    assert "not file paths" not in page and "Nearest neighbours by cosine similarity of hidden_states.2" in page
    assert "<th>documents</th><td>24 (24 used here)</td>" in page
    queries = re.search(r"neighbour queries \(read from text:[^)]*\): ([^<]*)</li>", page).group(1).split(", ")
    shown = re.findall(r"<code>(docs\.jsonl/(\d+))</code>(?:</h3><p>|<br>)([^<]*)", page)
    assert len(shown) == 2 * (1 + 3) and [key for key, _, _ in shown[::4]] == queries
    for key, line, text in shown:  # each document's own first words, by its key
        words = html_module.unescape(text).removesuffix(" …")
        assert len(words) > 20 and " ".join(documents[int(line)].split()).startswith(words), key
    assert len(embedded(page)) == 3  # accuracy, CKA, PCA: the neighbours are text, not a picture
    # the text must be the stored documents': edited data is not shown as theirs
    write_jsonl(tmp_path / "docs.jsonl", [d.upper() for d in documents], label=[0] * len(documents))
    assert main([str(store), "--out", str(out), "--queries", "2"]) == 0
    assert "nearest-neighbour documents skipped: --data text:" in out.read_text()
    assert "changed since the extraction" in out.read_text()


def _k_matters(path: Path) -> Path:
    """A store where k changes the k-NN probe's answer: 40 samples of two classes, 8 and 32, all close in
    cosine (0.97 across the classes, about 1 within), so that 20 voters outweigh a class of 6 training rows."""
    from helpers.stores import array_store

    rng = np.random.default_rng(0)
    a, b = np.zeros(16), np.zeros(16)
    a[0] = b[1] = 0.8
    x = np.concatenate([1 + a + 0.05 * rng.standard_normal((8, 16)), 1 + b + 0.05 * rng.standard_normal((32, 16))])
    order = rng.permutation(40)
    return array_store(path, {"l1": x[order].astype(np.float32)}, np.repeat([0, 1], [8, 32])[order], 8)


def test_report_k_defaults_to_probes_and_gives_what_probe_gives(tmp_path, capsys):
    """The report's k-NN had a fixed k of 20 and no --k: on this store 0.750, where probe --k 5 gives 1.000."""
    from extract.analysis.options import DEFAULT_K
    from extract.cli.probe import main as probe_main

    store = _k_matters(tmp_path / "k.zarr")
    accuracy = {}
    for k in (None, 5):
        out = tmp_path / f"report-{k}.html"
        assert main([str(store), "--out", str(out), *(["--k", str(k)] if k else [])]) == 0
        shown = k or DEFAULT_K
        html = out.read_text()
        assert f"<th>k-NN (k {shown}, T 0.07) [95% interval]</th>" in html
        accuracy[shown] = re.search(r"<td>l1</td><td>(\d\.\d{3}) ", html).group(1)
        capsys.readouterr()
        assert probe_main([str(store), "--method", "knn", *(["--k", str(k)] if k else [])]) == 0
        assert (
            f"l1: test accuracy {accuracy[shown]} (k-NN k {shown}, T 0.07; 32 train / 8 test" in capsys.readouterr().out
        )
    assert accuracy == {DEFAULT_K: "0.750", 5: "1.000"}
    assert main([str(store), "--out", str(tmp_path / "r.html"), "--k", "0"]) == 2
    assert "--k must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("num_layers", [2, 3, 8, 40])
def test_the_cka_heatmap_fills_its_canvas(num_layers):
    """Square cells sized by the figure's height left a few layers' grid in a corner of the page-wide
    canvas: 41-53% of its pixel columns blank for 2 to 8 layers, and 20% of its rows for 40."""
    names = [f"model.layers.{i}" for i in range(num_layers)]
    matrix = np.clip(1 - 0.03 * np.abs(np.subtract.outer(range(num_layers), range(num_layers))), 0, 1)
    png = figures.cka_heatmap(CKA(names, names, matrix, 100, "rows"))
    image = np.asarray(Image.open(io.BytesIO(png.data)).convert("L"))
    assert image.shape == (png.height, png.width) and png.width == figures.PAGE_WIDTH * figures.DPI
    blank = image > 250
    columns, rows = blank.all(axis=0).mean(), blank.all(axis=1).mean()  # the fraction wholly blank
    assert columns < 0.12 and rows < 0.12, (columns, rows)
