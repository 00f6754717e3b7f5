"""The issue-26 device scripts run their --smoke mode on the CPU and write what they promise."""

import importlib.util
import json
import sys

from tests.conftest import CHECKOUT


def load_script(name, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, CHECKOUT / f"scripts/gpu/{name}.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, script)  # its dataclasses look themselves up there
    spec.loader.exec_module(script)
    return script


def assert_manifest(folder):
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {"commit", "command", "config", "machine", "date"} <= set(manifest)


def test_the_device_map_check_smoke_splits_over_cpu_and_disk_and_passes(tmp_path, one_thread, monkeypatch):
    script = load_script("device_map_check", monkeypatch)
    assert script.main(["--smoke", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "device-map-check.json").read_text())
    assert {"date", "gpu", "target", "split", "aux_max_abs_diff", "logits_max_abs_diff", "argmax_agreement",
            "train", "tolerance", "pass"} <= set(out)
    assert {"steps", "loss_max_abs_diff", "weights_max_rel_diff", "tok_s_single", "tok_s_split"} <= set(out["train"])
    assert out["pass"] and out["split"]["modules_per_device"] == {"cpu": 5, "disk": 5}
    assert out["split"]["effective"]["streamed from disk, runs on cpu"] == 5
    assert out["argmax_agreement"] == 1.0 and out["train"]["steps"] == 4
    assert len(out["train"]["loss"]["split"]) == 4
    device_map = json.loads((tmp_path / "device_map.json").read_text())
    assert device_map["model.layers.2"] == "cpu" and device_map["model.layers.3"] == "disk"
    assert not (tmp_path / "runs" / "split" / "draft").exists()  # compared, then dropped
    assert_manifest(tmp_path)
