"""The quickstart's time budget (recipes/budget.py), the fitted LR schedule and budgeted
regeneration it relies on, and the shipped profiles."""

import pytest
import torch

from draftling.config import load_config
from draftling.errors import ConfigError
from draftling.recipes.budget import DATA_SHARE, MIN_TRAIN_STEPS, RESERVE_S, VAL_STEP_RATIO, plan_budget, plan_smoke


def test_plan_sets_measured_costs_aside_and_splits_the_rest():
    plan = plan_budget(13.5, elapsed_s=20, step_s=1.0, decode_token_s=0.05, bench_s=100, val_batches=20)
    assert plan.val_s == pytest.approx(20 * VAL_STEP_RATIO)
    left = 810 - 20 - 100 - plan.val_s - RESERVE_S
    assert plan.data_s == pytest.approx(DATA_SHARE * left)
    assert plan.data_s + plan.train_s == pytest.approx(left)
    # Data that finishes early hands its time to training; late data takes it from training.
    assert plan.train_seconds(20 + plan.data_s) == pytest.approx(plan.train_s)
    assert plan.train_seconds(20 + plan.data_s - 30) == pytest.approx(plan.train_s + 30)
    assert plan.train_seconds(800) == MIN_TRAIN_STEPS * 1.0  # data overran: still a trained head
    # A slower machine (twice the step and decode cost) gets a smaller share, not a longer run.
    slow = plan_budget(13.5, elapsed_s=20, step_s=2.0, decode_token_s=0.1, bench_s=200, val_batches=20)
    assert slow.data_s < plan.data_s and slow.train_s < plan.train_s
    assert slow.total_s == plan.total_s == 810


def test_a_budget_below_what_training_needs_is_refused_with_the_measured_step_time():
    with pytest.raises(ConfigError) as e:
        plan_budget(3, elapsed_s=20, step_s=2.5, decode_token_s=0.05, bench_s=100, val_batches=20)
    msg = str(e.value)
    assert "2.50 s (measured)" in msg and "--minutes 3" in msg and "at least" in msg
    # The minutes it names are enough.
    enough = float(msg.rsplit("at least ", 1)[1].split()[0])
    plan = plan_budget(enough, elapsed_s=20, step_s=2.5, decode_token_s=0.05, bench_s=100, val_batches=20)
    assert plan.train_s >= MIN_TRAIN_STEPS * 2.5


def test_smoke_checks_run_where_their_verdict_fits_the_training_share():
    tc = load_config("quickstart_cpu").train  # convergence_checks 3, 32 tokens, 5% share
    plan = plan_budget(13.5, elapsed_s=20, step_s=1.0, decode_token_s=0.04, bench_s=100, val_batches=20)
    # 4 checks of 14 x 32 x 0.04 = 17.9 s: 72 s, 19% of 380 s of training: none, and why.
    every, info = plan_smoke(plan, 380.0, tc, prompts=14)
    assert every == 0 and info["checks_needed"] == 4 and info["check_s_estimate"] == pytest.approx(17.9)
    assert info["share"] == pytest.approx(4 * 17.92 / 380, abs=1e-3)
    assert "4 smoke checks of ~18 s each" in info["why"] and "over train.smoke_max_share=0.05" in info["why"]
    # The minutes it names afford the checks: their training share holds 4 checks within 5%.
    minutes = int(info["why"].rsplit("--minutes ", 1)[1].split()[0])
    big = plan_budget(minutes, elapsed_s=20, step_s=1.0, decode_token_s=0.04, bench_s=100, val_batches=20)
    every, info = plan_smoke(big, big.train_s, tc, prompts=14)
    assert every == int(big.train_s) // 4 and info["share"] <= 0.05 and "why" not in info
    # A step ceiling below the checks a verdict needs plans none; above, it spaces them.
    assert plan_smoke(big, big.train_s, tc, prompts=14, ceiling=3)[0] == 0
    every, info = plan_smoke(big, big.train_s, tc, prompts=14, ceiling=40)
    assert every == 0 and info["train_s"] == 40.0  # 40 steps of 1 s: 72 s of checks is too much
    assert "(40 steps, its ceiling)" in info["why"] and "more steps (train.max_steps" in info["why"]
    assert plan_smoke(big, big.train_s, tc, prompts=14, ceiling=1450)[0] == 1450 // 4
    # A share of 0 never plans checks.
    tc.smoke_max_share = 0
    assert plan_smoke(big, big.train_s, tc, prompts=14)[0] == 0


def test_cli_refuses_a_negative_budget():
    from tests.conftest import run_draftling

    r = run_draftling("quickstart", "--minutes", "-1", "--out", "unused")
    assert r.returncode != 0 and "--minutes -1" in r.stderr and "Traceback" not in r.stderr


def test_fitted_schedule_ends_inside_the_budget_and_respects_the_ceiling():
    from draftling.train.distributed import current
    from draftling.train.schedules import FitToTime, fitted_total

    assert fitted_total(10, cap=1000, seconds_left=50, step_s=0.5) == 110
    assert fitted_total(10, cap=60, seconds_left=50, step_s=0.5) == 60  # epochs stay the ceiling
    assert fitted_total(10, cap=1000, seconds_left=-5, step_s=0.5) == 11  # over time: end now
    assert fitted_total(60, cap=60, seconds_left=50, step_s=0.5) == 60  # at the ceiling: not one past it
    now = [0.0]
    tc = load_config(None, ["train.max_minutes=1", "train.fit_schedule=true"]).train
    fit = FitToTime(tc, cap=500, t_start=0.0, step=0, ctx=current(), device="cpu", clock=lambda: now[0])
    assert not fit.due(5, epoch_start=True)  # too few steps to measure
    now[0] = 10.0
    assert fit.due(10, epoch_start=False)
    assert fit.refit(10) == 10 + int(50 / 1.0)  # 1 s a step, 50 s left of 60
    assert not fit.due(15, epoch_start=False)
    now[0] = 20.0  # a later epoch runs faster (the teacher cache): 0.5 s a step
    assert fit.due(30, epoch_start=True)
    assert fit.refit(30) == 30 + int(40 / 0.5)
    with pytest.raises(ConfigError, match="train.max_minutes"):
        FitToTime(load_config(None, ["train.fit_schedule=true"]).train, 10, 0.0, 0, current(), "cpu")


def test_fitted_schedule_in_a_run_keeps_the_ceiling_and_checkpoints_its_length(tmp_path, tiny_target):
    import json

    from draftling.train.checkpoint import list_checkpoints
    from draftling.train.trainer import train
    from tests.conftest import setup_data

    setup_data(tmp_path)
    over = [
        "train.max_steps=14",
        "train.batch_size=4",
        "train.ttt_steps=2",
        "train.ckpt_every=7",
        "train.warmup_steps=2",
        "train.max_minutes=30",
        "train.fit_schedule=true",
        "train.log_every=7",
    ]
    result = train(
        load_config(None, over),
        tiny_target,
        tmp_path / "run",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
    )
    assert result["steps"] == result["steps_ceiling"] == 14  # 30 minutes fit far more than 14 steps
    metas = [json.loads((c / "meta.json").read_text()) for c in list_checkpoints(tmp_path / "run")]
    assert [m["total_steps"] for m in metas] == [14, 14]


def _convs(n):
    from draftling.data.prompts import Conversation

    return [Conversation(f"c{i}", "s", "chat", [{"role": "user", "content": "x" * (i + 1)}]) for i in range(n)]


def test_regeneration_within_a_deadline_runs_random_rounds_until_the_time_is_spent(monkeypatch):
    from draftling.data import regen as regen_mod

    now = [0.0]
    monkeypatch.setattr(regen_mod.time, "perf_counter", lambda: now[0])
    calls = []

    def fake_regen(convs, deadline=None, pace=None):
        calls.append((list(convs), deadline))
        now[0] += 0.5 * len(convs)  # 2 s per batch of 4
        pace["slowest_batch_s"] = 2.0
        return [{"id": c.id} for c in convs]

    report = {}
    convs = _convs(40)
    out = list(
        regen_mod.regenerate_within(
            fake_regen, convs, batch_size=4, deadline=9.0, seed=0, report=report, round_batches=2
        )
    )
    # Rounds of 8 end at 4 s and 8 s; a third would need its first batch (2 s) past 9 s.
    assert [len(c) for c, _ in calls] == [8, 8] and all(d == 9.0 for _, d in calls)
    assert report == {
        "available": 40,
        "regenerated": 16,
        "skipped_long": 0,
        "seconds": 8.0,
        "rate_prompts_s": 2.0,
        "stopped_by_budget": True,
    }
    ids = [r["id"] for r in out]
    assert len(set(ids)) == 16 and set(ids) <= {c.id for c in convs}
    # A random sample, not the head of the list (which the caller may have sorted).
    assert ids != [c.id for c in convs[:16]]


def test_regenerate_starts_no_batch_past_its_deadline(tiny_target_dir):
    from draftling.config import RegenConfig
    from draftling.data.regen import regenerate
    from draftling.target import load_target

    target = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    cfg = RegenConfig(max_new_tokens=3, batch_size=2)
    convs = _convs(6)
    assert len(list(regenerate(target, convs, cfg, progress=False))) == 6
    # A deadline already passed: the first batch still runs (it measures), no later one.
    pace = {}
    done = list(regenerate(target, convs, cfg, progress=False, deadline=0.0, pace=pace))
    assert len(done) == 2 and pace["slowest_batch_s"] > 0
    # A later call that shares the pace starts nothing past the deadline.
    assert list(regenerate(target, convs, cfg, progress=False, deadline=0.0, pace=pace)) == []


def test_step_probe_times_a_real_step_and_leaves_the_rng_alone(tiny_target):
    from draftling.train.probe import measure_step_seconds

    cfg = load_config(
        None, ["train.batch_size=2", "train.ttt_steps=2", "vocab.size=64", "data.keep_teacher_states=true"]
    )
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    seconds = measure_step_seconds(cfg, tiny_target, seq_len=16)
    assert 0 < seconds < 60
    assert torch.equal(torch.rand(3), expected)


def test_bench_cost_estimate_scales_with_what_the_bench_decodes(tiny_target):
    from draftling.bench.simple import SPEC_TIME_RATIO, WARMUP_TOKENS, estimate_bench_seconds

    cfg = load_config(None, ["bench.num_prompts=4", "bench.max_new_tokens=8"])
    est = estimate_bench_seconds(cfg, tiny_target, prompt_tokens=8, tokens=4)
    decoded = (4 * 8 + WARMUP_TOKENS) * (1 + SPEC_TIME_RATIO)
    assert est["per_token_s"] > 0
    # Equal up to the two roundings: seconds to 0.01, per_token_s to 1e-4 (times what is decoded).
    assert est["seconds"] == pytest.approx(decoded * est["per_token_s"], abs=0.005 + decoded * 5e-5)


def test_every_shipped_profile_loads():
    # A typo in a profile would surface only on a GPU call or a user's first run.
    from importlib import resources

    names = sorted(
        p.name[:-5] for p in (resources.files("draftling") / "configs").iterdir() if p.name.endswith(".yaml")
    )
    # Only what a user can run ships: the lab's GPU recipe (lab/configs) reads the development corpus.
    assert set(names) == {"default", "quickstart_cpu"}
    configs = {n: load_config(n) for n in names}
    # The default GPU config: the smoke bench, its verdict and per-epoch candidates on, the stop opt-in,
    # checks over 5% of the training time made rarer.
    default = configs["default"].train
    assert default.smoke_every > 0 and default.ckpt_every_epoch and not default.stop_on_convergence
    assert default.smoke_max_share == 0.05 and configs["default"].data.split_key == "auto"
    quick = configs["quickstart_cpu"]
    assert quick.device == "cpu" and quick.wall_minutes > 0
    # The default path needs nothing outside the package.
    assert quick.data.prompts and all(p.startswith("starter:") for p in quick.data.prompts)
