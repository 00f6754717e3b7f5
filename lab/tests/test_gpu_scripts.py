"""The lab's device scripts (lab/gpu) run their --smoke mode on the CPU and write what they promise."""

import json

import pytest

from draftling.train import batches, ttt
from tests.helpers import load_script


def assert_manifest(folder):
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {"commit", "command", "config", "machine", "date"} <= set(manifest)


def test_the_device_map_check_smoke_splits_over_cpu_and_disk_and_passes(tmp_path, one_thread, monkeypatch):
    script = load_script("device_map_check", monkeypatch)
    assert script.main(["--smoke", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "device-map-check.json").read_text())
    assert {
        "date",
        "gpu",
        "target",
        "split",
        "aux_max_abs_diff",
        "logits_max_abs_diff",
        "argmax_agreement",
        "train",
        "tolerance",
        "pass",
    } <= set(out)
    assert {"steps", "loss_max_abs_diff", "weights_max_rel_diff", "tok_s_single", "tok_s_split"} <= set(out["train"])
    assert out["pass"] and out["split"]["modules_per_device"] == {"cpu": 5, "disk": 5}
    assert out["split"]["effective"]["streamed from disk, runs on cpu"] == 5
    assert out["argmax_agreement"] == 1.0 and out["train"]["steps"] == 4
    assert len(out["train"]["loss"]["split"]) == 4
    device_map = json.loads((tmp_path / "device_map.json").read_text())
    assert device_map["model.layers.2"] == "cpu" and device_map["model.layers.3"] == "disk"
    assert not (tmp_path / "runs" / "split" / "draft").exists()  # compared, then dropped
    assert_manifest(tmp_path)


def test_the_second_arch_bench_smoke_runs_gemma3_and_both_llama_paths(tmp_path, one_thread, monkeypatch):
    script = load_script("second_arch_bench", monkeypatch)
    assert script.main(["--smoke", "--arch", "gemma3,llama,llama-general", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "second-arch-bench.json").read_text())
    archs = out["archs"]
    assert [archs[a]["engine_used"][0]["class"] for a in script.ARCHS] == [
        "GeneralCachedTarget",
        "CachedTarget",
        "GeneralCachedTarget",
    ]
    assert "forced by second_arch_bench" in archs["llama-general"]["engine_log"][0]
    assert set(archs["gemma3"]["hf_tok_s"]) == {"hf_static", "hf_prompt_lookup", "hf_eager"}
    for arch in script.ARCHS:
        assert all(c["identical_fraction"] == 1.0 for c in archs[arch]["configs"].values())
        assert (tmp_path / archs[arch]["release_json"]).is_file()
    assert set(out["ratios"]["llama_general_over_llama_fast"]) == {
        "engine_plain_tok_s",
        "chain-3-1-4_tok_s",
        "tree-3-4-8_tok_s",
    }
    assert out["model_configs"]["gemma3"]["layer_types"] == "SSSSSF"
    assert any("random weights: speed only" in c for c in out["caveats"])
    assert not list(tmp_path.rglob("draft.safetensors"))
    assert_manifest(tmp_path)


def test_the_second_arch_bench_leaves_out_a_failing_hf_baseline(tmp_path, one_thread, monkeypatch):
    from draftling.bench import release

    script = load_script("second_arch_bench", monkeypatch)
    hf_kwargs = release._hf_kwargs

    def broken_static(name, *args):
        if name == "hf_static":
            raise RuntimeError("static cache unsupported here\nsecond line")
        return hf_kwargs(name, *args)

    monkeypatch.setattr(release, "_hf_kwargs", broken_static)
    timing = release._time_hf_baselines  # the script swaps in its tolerant timing for the run
    assert script.main(["--smoke", "--arch", "llama", "--out", str(tmp_path)]) == 0
    llama = json.loads((tmp_path / "second-arch-bench.json").read_text())["archs"]["llama"]
    assert llama["baselines_failed"] == {"hf_static": "RuntimeError: static cache unsupported here second line"}
    assert llama["hf_tok_s"]["hf_static"] is None and llama["hf_tok_s"]["hf_eager"] > 0
    assert release._time_hf_baselines is timing  # and puts the original back


def test_the_fixed_cost_script_runs_its_smoke_on_the_cpu(tmp_path, one_thread, monkeypatch):
    script = load_script("step_fixed_cost", monkeypatch)
    patched = (batches.to_device, ttt.ttt_unroll)
    assert script.main(["--smoke", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "step-fixed-cost.json").read_text())
    assert {"date", "gpu", "fixed_cost_s_before", "fixed_cost_s_after", "points"} <= set(out)
    assert [(p["mode"], p["batch"], p["pad_to_multiple"]) for p in out["points"]] == [
        ("before", 2, 1),
        ("before", 4, 1),
        ("after", 2, 16),
        ("after", 4, 16),
    ]
    assert_manifest(tmp_path)
    assert (batches.to_device, ttt.ttt_unroll) == patched  # the old reads undone


def test_the_fixed_cost_script_fits_a_line_through_more_batch_sizes(tmp_path, one_thread, monkeypatch):
    """--batches 2,3,4 --modes after: three points of one mode, and the least-squares line
    through them (here checked against the points it was fitted to)."""
    script = load_script("step_fixed_cost", monkeypatch)
    assert script.main(["--smoke", "--out", str(tmp_path), "--batches", "2,3,4", "--modes", "after"]) == 0
    out = json.loads((tmp_path / "step-fixed-cost.json").read_text())
    assert [(p["mode"], p["batch"]) for p in out["points"]] == [("after", 2), ("after", 3), ("after", 4)]
    assert "fixed_cost_s_before" not in out
    line = [{"mode": "after", "batch": n, "step_s": 0.5 + 0.25 * n} for n in (2, 3, 5)]
    assert script.fit(line, "after") == pytest.approx((0.5, 0.25))


def test_the_scale_dry_run_writes_the_issue_47_schema(tmp_path, one_thread, monkeypatch):
    """lab/gpu/scale.py --dry-run, its two cheaper sections in this process (about 6 s; the peer
    needs speculators installed): scale.json's contract keys."""
    script = load_script("scale", monkeypatch)
    argv = ["--dry-run", "--in-process", "--sections", "teacher_36b_4bit,target_8b", "--out", str(tmp_path)]
    assert script.main(argv) == 0
    out = json.loads((tmp_path / "scale.json").read_text())
    assert out["dry_run"] is True
    teacher, t8b = out["teacher_36b_4bit"], out["target_8b"]
    assert set(teacher) == {"peak_gib", "cap_gib", "tok_s", "plan_gib", "steps", "quant"}
    assert teacher["quant"] == "skipped: needs CUDA" and teacher["tok_s"] > 0 and teacher["plan_gib"] > 0
    assert teacher["steps"] >= 3 and teacher["peak_gib"] is None  # no CUDA: no peak
    assert {"plain_tok_s", "roofline_tok_s", "roofline_fraction", "draft_level_ms"} <= set(t8b)
    assert set(t8b["verify_over_plain"]) == set(t8b["projected_speedup"]) == set(script.CONFIGS)
    assert t8b["plain_tok_s"] > 0 and t8b["draft_level_ms"] > 0
    assert t8b["roofline_tok_s"] is None  # no GPU: no published or measured bandwidth
    assert script.published_tb_s("NVIDIA H100 80GB HBM3") == 3.35 and script.published_tb_s("NVIDIA H200") == 4.8
    assert set(out["peer"]) == {
        "draftling_tok_s",
        "speculators_tok_s",
        "draftling_peak_gib",
        "speculators_peak_gib",
        "val_acc",
    }
    section = out["sections"]["target_8b"]
    assert section["projection"]["label"].startswith("PROJECTION") and "regen" in section and "training" in section
    assert "error" not in section["regen"] and "error" not in section["training"]
    assert_manifest(tmp_path)
