"""The quickstart's whole-run budget: training gets what loading, data and the bench leave."""

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
