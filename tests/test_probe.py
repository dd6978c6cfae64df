"""The linear probe end to end: extract learnable synthetic data, then probe every layer."""

import numpy as np
import pytest

from extract import ExtractError
from extract.probe import main, probe, split


def test_probe_learns_synthetic_classes(cli, capsys, tmp_path):
    out = tmp_path / "probe.zarr"
    code, _, err = cli(
        "--model", "resnet18", "--weights", "none", "--image-size", "32", "--pool", "avg",
        "--layers", "layer2", "layer4", "--data", "synthetic:200", "--num-workers", "0", "--out", out,
    )  # fmt: skip
    assert code == 0, err
    accuracies = probe(out, epochs=50, log=lambda line: None)
    assert set(accuracies) == {"layer2", "layer4"}
    assert max(accuracies.values()) >= 0.6  # chance is 0.1

    assert main([str(out), "--layers", "layer4", "--epochs", "50", "--test-fraction", "0.25"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("layer4: test accuracy ")
    assert "150 train / 50 test, 512 features" in lines[0]
    # deterministic for a seed
    assert probe(out, ["layer4"], epochs=50, log=lambda line: None)["layer4"] == accuracies["layer4"]

    assert main([str(out), "--test-fraction", "1.5"]) == 2
    assert "--test-fraction must be between 0 and 1" in capsys.readouterr().err


def test_split_is_seeded_and_disjoint():
    labelled = np.arange(3, 103)
    train, test = split(labelled, 0.2, seed=4)
    assert len(test) == 20 and sorted([*train, *test]) == labelled.tolist()
    assert np.array_equal(split(labelled, 0.2, seed=4)[1], test)
    assert not np.array_equal(split(labelled, 0.2, seed=5)[1], test)
    with pytest.raises(ExtractError, match="too few"):
        split(np.arange(1), 0.5, seed=0)
