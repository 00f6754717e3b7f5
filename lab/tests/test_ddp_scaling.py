"""lab/benches/ddp_scaling.py and lab/gpu/train_fixed_cost.py on finished runs' metrics (no training)."""

import json

import pytest


def test_scaling_summary_skips_warmup_window_and_computes_efficiency(tmp_path):
    from lab.benches.ddp_scaling import summarize

    for world, rates in ((1, [10.0, 100.0, 100.0]), (2, [5.0, 180.0, 160.0])):
        run = tmp_path / f"run{world}"
        run.mkdir()
        (run / "metrics.jsonl").write_text(
            "".join(json.dumps({"split": "train", "tok_s": r, "step": i}) + "\n" for i, r in enumerate(rates))
            + json.dumps({"split": "val", "sim_tau": 1.5, "step": 3})
            + "\n"
        )
        (run / "train_result.json").write_text(json.dumps({"steps": 3, "train_wall_s": 1.0}))
    out = summarize({1: tmp_path / "run1", 2: tmp_path / "run2"}, "test-gpu")
    two = out["per_world_size"]["2"]
    assert out["per_world_size"]["1"]["tok_s"] == 100.0 and two["tok_s"] == 170.0
    assert two["speedup_vs_1"] == pytest.approx(1.7) and two["scaling_efficiency"] == pytest.approx(0.85)


def test_train_fixed_cost_fits_the_line_through_each_codes_step_times(tmp_path):
    """Four finished runs (before/after x 32/16 sequences): step_s = batch * mean length / tok_s,
    and the fit recovers the fixed cost and the per-sequence cost each code was built with."""
    import importlib.util

    from tests.conftest import CHECKOUT

    spec = importlib.util.spec_from_file_location("train_fixed_cost", CHECKOUT / "lab/gpu/train_fixed_cost.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    data = tmp_path / "data"
    data.mkdir()
    (data / "summary.json").write_text(json.dumps({"train_tokens": 5000, "train_sequences": 10}))  # 500 tok/seq
    truth = {"before": (0.26, 0.01), "after": (0.02, 0.01)}  # (fixed s, s per sequence)
    args = []
    for code, (fixed, per_seq) in truth.items():
        for batch in (32, 16):
            tok_s = batch * 500 / (fixed + per_seq * batch)
            run = tmp_path / f"{code}-{batch}"
            run.mkdir()
            (run / "metrics.jsonl").write_text(
                "".join(
                    json.dumps({"split": "train", "tok_s": r, "step": i}) + "\n"
                    for i, r in enumerate([1.0, tok_s, tok_s])
                )
            )
            (run / "train_result.json").write_text(json.dumps({"steps": 30, "train_wall_s": 9.0}))
            args += ["--run", f"{code}:{batch}={run}"]
    assert script.main(["--data", str(data), "--out", str(tmp_path / "out"), "--gpu", "test-gpu", *args]) == 0
    out = json.loads((tmp_path / "out" / "fixed-cost.json").read_text())
    assert out["gpu"] == "test-gpu" and out["mean_seq_tokens"] == 500.0
    assert out["fixed_cost_s_before"] == pytest.approx(0.26, abs=1e-4)
    assert out["fixed_cost_s_after"] == pytest.approx(0.02, abs=1e-4)
    assert out["per_seq_s_after"] == pytest.approx(0.01, abs=1e-5)
    ratio = (0.26 + 0.32) / (0.02 + 0.32)  # same work per sequence: the step-time ratio at 32
    assert out["tok_s_after_over_before"]["32"] == pytest.approx(ratio, abs=2e-3)
    assert len(out["points"]) == 4 and all(p["windows"] == 2 for p in out["points"])
    bound = out["two_gpu_efficiency_bound"]  # step(32) / (2 step(16)): (fixed + 32 c) / (2 fixed + 32 c)
    assert bound["before"]["32"] == pytest.approx(0.58 / 0.84, abs=2e-3)
    assert bound["after"]["32"] == pytest.approx(0.34 / 0.36, abs=2e-3) and "16" not in bound["after"]
    with pytest.raises(SystemExit, match="CODE:BATCH=DIR"):
        script.parse_run("middle:32=/x")


def test_two_gpu_results_carry_the_contract_keys_and_the_loss_differences(tmp_path):
    """1 and 2 GPUs, the 2-GPU run under FSDP and a split teacher: the top-level keys of the two-GPU
    results, the FSDP loss difference taken against DDP at every shared point, the split's
    against 1 GPU."""
    from lab.benches.ddp_scaling import main

    def run(name, rates, losses, val_loss, peak, tau):
        d = tmp_path / name
        d.mkdir()
        rows = [
            {"split": "train", "tok_s": r, "step": 10 * (i + 1), "loss": l}
            for i, (r, l) in enumerate(zip(rates, losses))
        ]
        rows.append({"split": "val", "step": 30, "loss": val_loss, "sim_tau": tau})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "train_result.json").write_text(
            json.dumps(
                {
                    "steps": 30,
                    "train_wall_s": 1.0,
                    "peak_gpu_gib": peak,
                    "val": {"sim_tau": tau, "chain_tau": tau - 0.01},
                }
            )
        )
        return d

    one = run("one", [1, 100, 100], [9.0, 8.0, 7.0], 7.5, 8.0, 1.5)
    two = run("two", [1, 190, 190], [9.0, 8.0, 7.0], 7.5, 4.5, 1.5)
    fsdp = run("fsdp", [1, 170, 170], [9.0, 8.002, 7.0], 7.505, 3.0, 1.5)
    split = run("split", [1, 80, 80], [9.0, 8.0, 7.1], 7.5, 2.0, 1.49)
    fixed = tmp_path / "fixed-cost.json"
    fixed.write_text(json.dumps({"fixed_cost_s_before": 0.138, "fixed_cost_s_after": 0.055}))
    out = tmp_path / "x2.json"
    main(
        [
            "--run",
            f"1={one}",
            "--run",
            f"2={two}",
            "--fsdp",
            str(fsdp),
            "--split",
            str(split),
            "--fixed-cost",
            str(fixed),
            "--out",
            str(out),
            "--gpu",
            "test-gpu",
        ]
    )
    res = json.loads(out.read_text())
    assert {
        "date",
        "gpu",
        "tok_s_1gpu",
        "tok_s_2gpu",
        "scaling_efficiency",
        "fixed_cost_s_before",
        "fixed_cost_s_after",
        "fsdp",
    } <= set(res)
    assert res["tok_s_2gpu"] == 190 and res["scaling_efficiency"] == pytest.approx(0.95)
    assert res["fixed_cost_s_after"] == 0.055
    f = res["fsdp"]
    assert f["tok_s_2gpu"] == 170 and f["peak_gib"] == 3.0 and f["ddp_peak_gib"] == 4.5
    assert f["max_loss_diff_vs_ddp"] == pytest.approx(0.005) and f["points_compared"] == 4
    s = res["teacher_split"]
    assert s["max_loss_diff_vs_1gpu"] == pytest.approx(0.1) and s["val_sim_tau"] == 1.49
    assert s["one_gpu_val_sim_tau"] == 1.5
    with pytest.raises(SystemExit, match="not found"):
        main(["--run", f"1={one}", "--run", f"2={two}", "--fsdp", str(tmp_path / "nope"), "--out", str(out)])
    with pytest.raises(SystemExit, match="--run 2=DIR"):
        main(["--run", f"1={one}", "--fsdp", str(fsdp), "--out", str(out)])
