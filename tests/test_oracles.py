"""Independent oracles for what the project computes itself: the L-BFGS probe against scikit-learn's
logistic regression, and ImageFolder's order against torchvision's own ``make_dataset``."""

import numpy as np
import pytest
import torch
from helpers.cli import RESNET18
from helpers.data_files import make_png_tree
from PIL import Image
from skimage import data as photographs
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from extract import open_features
from extract.analysis.probe import ProbeOptions, fit_logistic_regression, probe_layers, split
from extract.analysis.samples import Samples, labelled_rows

SMALL = [*RESNET18, "--num-workers", "0", "--batch-size", "16"]


@pytest.fixture(scope="module")
def photo_store(tmp_path_factory):
    """resnet18 layer2 and layer3, average-pooled, over crops of scikit-image's photographs in 4 classes."""
    from extract.cli.extract import main

    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        image = getattr(photographs, name)()
        (root / name).mkdir()
        for i in range(20):
            top, left = rng.integers(0, image.shape[0] - 96), rng.integers(0, image.shape[1] - 96)
            Image.fromarray(image[top : top + 96, left : left + 96]).save(root / name / f"{i:02d}.png")
    out = root.parent / "photos.zarr"
    args = [*SMALL, "--layers", "layer2", "layer3", "--pool", "avg", "--data", f"imagefolder:{root}", "--out", str(out)]
    assert main(args) == 0
    return out


def test_lbfgs_probe_agrees_with_scikit_learn(photo_store):
    sklearn_linear = pytest.importorskip("sklearn.linear_model")
    features = open_features(photo_store)
    train_rows, test_rows = split(labelled_rows(features), 0.25, seed=0)
    weight_decay = 1e-2
    options = ProbeOptions(solver="lbfgs", epochs=500, weight_decay=weight_decay)
    records = probe_layers(photo_store, ["layer2", "layer3"], options, test_fraction=0.25, log=lambda line: None)
    for layer in ("layer2", "layer3"):
        x_train = Samples(features, layer, None, train_rows).load()
        x_test = Samples(features, layer, None, test_rows).load()
        y_train, y_test = features.labels[train_rows], features.labels[test_rows]
        mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-6)
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
        ours = fit_logistic_regression(
            x_train, torch.from_numpy(y_train), 4, epochs=500, lr=1.0, weight_decay=weight_decay
        )
        # sklearn minimizes ||w||^2 / 2 + C * sum(CE); ours mean(CE) + weight_decay / 2 * ||w||^2: C = 1 / (n wd)
        theirs = sklearn_linear.LogisticRegression(C=1 / (len(y_train) * weight_decay), max_iter=5000, tol=1e-10)
        theirs.fit(x_train.double().numpy(), y_train)
        with torch.no_grad():
            predicted = ours(x_test).argmax(1).numpy()
            np.testing.assert_allclose(ours.weight.numpy(), theirs.coef_, atol=2e-3, rtol=2e-2)
        assert (predicted == theirs.predict(x_test.double().numpy())).mean() >= 0.95
        sklearn_accuracy = theirs.score(x_test.double().numpy(), y_test)
        assert abs(records[layer]["test_accuracy"] - sklearn_accuracy) <= 1 / len(y_test) + 1e-9
        assert records[layer]["test_accuracy"] > 0.35  # chance is 0.25: random weights still tell the photographs apart


def test_imagefolder_order_and_classes_are_torchvisions(tmp_path):
    from extract.cli.extract import main

    root = tmp_path / "tree"
    make_png_tree(root, {"b_dog": 3, "a_cat": 4, "C_upper": 2})
    (root / "a_cat" / "notes.txt").write_text("not an image")
    out = tmp_path / "tree.zarr"
    assert (
        main([*SMALL, "--layers", "layer3", "--pool", "avg", "--data", f"imagefolder:{root}", "--out", str(out)]) == 0
    )
    classes, class_to_idx = find_classes(str(root))
    expected = make_dataset(str(root), class_to_idx, extensions=IMG_EXTENSIONS)
    features = open_features(out)
    assert features.classes == classes
    assert features.keys.tolist() == [str(__import__("pathlib").Path(path).relative_to(root)) for path, _ in expected]
    assert features.labels.tolist() == [label for _, label in expected]
