"""layer_skip's first-start calibration: a skip set from one influence forward and a short prefix
search on the model's own text, logged as it goes, deterministic, and cached on disk."""
import dataclasses
import json

import pytest
import torch

from specserve.spec_phases import loader
from specserve.spec_phases.proposers import layer_skip
from specserve.spec_phases.proposers.layer_skip import _cache_file, default_skip_layers


@pytest.fixture
def six_layers():
    cfg = dataclasses.replace(loader.tiny_config(vocab_size=512), num_layers=6)
    return loader.build_random_model(cfg, seed=3)


def test_calibrates_logs_caches_and_is_deterministic(six_layers, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    with caplog.at_level("INFO"):
        skip = default_skip_layers("tiny-random", six_layers, 4)
    assert skip and set(skip) <= set(range(1, 5))                 # first and last layers kept
    assert "the model's own text" in caplog.text
    assert "layer_skip calibration: 1 layers skipped" in caplog.text
    file = _cache_file("tiny-random")
    report = json.loads(file.read_text())
    assert report["skip_layers"] == list(skip) and len(report["layer_influence"]) == 6
    assert report["trace"][0]["num_skip"] == 1

    def no_text(*args, **kwargs):
        raise AssertionError("calibrated again instead of reading the cache")
    monkeypatch.setattr(layer_skip, "own_text", no_text)
    assert default_skip_layers("tiny-random", six_layers, 4) == skip
    monkeypatch.undo()
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "again"))
    assert default_skip_layers("tiny-random", six_layers, 4) == skip


def test_influence_orders_layers_by_how_much_they_turn_the_stream(six_layers):
    """A layer whose weights are zeroed adds nothing to the residual stream: influence 0, and it is
    the first to be skipped."""
    with torch.no_grad():
        six_layers.layers[2].o_proj.weight.zero_()
        six_layers.layers[2].down_proj.weight.zero_()
    ids = torch.arange(3, 40)
    influence, ref = layer_skip.layer_influence(six_layers, ids, torch.arange(len(ids)))
    assert influence[2] == pytest.approx(0.0, abs=1e-6) and min(influence[1:5]) == influence[2]
    assert all(x > 1e-4 for i, x in enumerate(influence) if i != 2)
    assert ref.shape == ids.shape
    skip, report = layer_skip.calibrate(six_layers, ids.tolist(), 4)
    assert report["trace"][0]["agreement"] == pytest.approx(0.999)     # skipping it changes nothing
