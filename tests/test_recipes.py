"""The quickstart's whole-run budget (training gets what loading, data and the bench leave), and
the shipped profiles."""

import pytest

from draftling.config import load_config
from draftling.errors import ConfigError
from draftling.recipes.quickstart import BENCH_RESERVE_MINUTES, training_budget_minutes


def test_training_budget_shrinks_on_a_slow_machine_and_keeps_the_cap_on_a_fast_one():
    assert load_config("quickstart_cpu", []).wall_minutes == 0  # off unless asked for
    cfg = load_config("quickstart_cpu", ["wall_minutes=14.5"])
    assert cfg.wall_minutes == 14.5 and cfg.train.max_minutes == 7.5
    # Fast machine: data done after 3 minutes, the 7.5-minute training cap still binds.
    assert training_budget_minutes(cfg, 180) == 7.5
    # Slow machine: 7 minutes of loading and data leave 14.5 - 7 - reserve.
    assert training_budget_minutes(cfg, 420) == pytest.approx(14.5 - 7 - BENCH_RESERVE_MINUTES)
    cfg.train.max_minutes = 0  # no training cap: the budget alone
    assert training_budget_minutes(cfg, 270) == pytest.approx(14.5 - 4.5 - BENCH_RESERVE_MINUTES)
    with pytest.raises(ConfigError, match="wall_minutes=14.5"):
        training_budget_minutes(cfg, 13 * 60)


def test_every_shipped_profile_loads():
    # A typo in a profile would surface only on a GPU call or a user's first run.
    from importlib import resources

    names = sorted(p.name[:-5] for p in (resources.files("draftling") / "configs").iterdir()
                   if p.name.endswith(".yaml"))
    assert {"default", "gpu_smollm2", "quickstart_cpu"} <= set(names)
    configs = {n: load_config(n) for n in names}
    gpu = configs["gpu_smollm2"]
    assert gpu.draft.intermediate_size == 4096 and gpu.device == "cuda"
    assert gpu.data.prompt_cap("shared:math_gsm8k_train.jsonl") == 2200
    assert gpu.data.prompt_cap("shared:sharegpt.jsonl") == 5000
    assert configs["quickstart_cpu"].device == "cpu"
