"""Adaptive speculation: whatever the policy picks, group by group, each request's tokens equal
plain greedy decoding's; the policy picks from measured rates and stays plain once rows have
decoded plain (their drafts are behind)."""

import pytest

from draftling.engine.adaptive import PLAIN, AdaptivePolicy, config_name
from draftling.engine.generate import batch_generate
from draftling.errors import ConfigError
from tests.helpers import TREES, oracle_draft, perm_target
from tests.helpers import batch_engines as engines
from tests.helpers import batch_prompts as prompts
from tests.helpers import decode_alone as alone

pytestmark = pytest.mark.usefixtures("one_thread")
BUDGETS = [40, 6, 25, 40, 2, 33, 11]


class Scripted(AdaptivePolicy):
    """Picks from a fixed script (cycling), as far as the rows allow; records what it was allowed."""

    def __init__(self, trees, script):
        super().__init__(trees)
        self.script, self.allowed = script, []

    def choose(self, can_speculate):
        self.allowed.append(can_speculate)
        pick = self.script[(len(self.allowed) - 1) % len(self.script)]
        choice = pick if can_speculate else None
        self.log.append({"choice": config_name(choice)})
        return choice


def test_switching_configs_mid_run_keeps_plain_tokens():
    model = perm_target()
    ps = prompts()
    want = alone(model, ps, BUDGETS)
    target, runner = engines(model, oracle_draft(model))
    trees = tuple(TREES)
    policy = Scripted(trees, [trees[0], trees[1], trees[2], trees[1], None])
    got = batch_generate(target, ps, BUDGETS, draft=runner, adaptive=policy)
    assert [r.tokens for r in got] == want
    choices = [d["choice"] for d in policy.log]
    assert {config_name(t) for t in trees} <= set(choices) and PLAIN in choices
    # Once plain, never speculative again while a row that decoded plain is active.
    first_plain = choices.index(PLAIN)
    assert not policy.allowed[first_plain + 1]


def test_the_policy_measures_each_tree_then_keeps_the_fastest():
    model = perm_target()
    ps = prompts()
    target, runner = engines(model, oracle_draft(model))
    policy = AdaptivePolicy(tuple(TREES))
    got = batch_generate(target, ps, BUDGETS, draft=runner, adaptive=policy)
    assert [r.tokens for r in got] == alone(model, ps, BUDGETS)
    whys = [d["why"] for d in policy.log]
    assert whys[: len(TREES)] == ["not measured yet"] * len(TREES)
    est = policy.estimates
    assert est[PLAIN].round_ms > 0 and all(est[config_name(t)].tau >= 1.0 for t in TREES)
    later = policy.log[len(TREES) :]
    assert later
    # Each later decision follows from the estimates logged with it (measured times vary from
    # run to run, so which config wins may too; the rule that picks it may not).
    for d in later:
        cost = {n: e["round_ms"] + e["admit_ms_per_round"] for n, e in d.items() if isinstance(e, dict)}
        rate = {n: d[n]["tau"] / c for n, c in cost.items()}
        trees = [config_name(t) for t in TREES]
        best = max(trees, key=rate.__getitem__)
        high = d[best]["tau_high"] / cost[best]
        if d["why"] == "highest measured rate":
            assert d["choice"] == best and rate[PLAIN] <= policy.leave_margin * high
        elif d["why"] == "retry":
            assert d["choice"] in trees
        else:
            assert d["choice"] == PLAIN
            assert d["why"] == "the rows decoded plain before" or rate[PLAIN] > policy.leave_margin * high


def _seeded(plain_ms, tree_ms, tree_tau):
    policy = AdaptivePolicy(tuple(TREES))
    policy.estimates[PLAIN].update(plain_ms, 1.0, 1.0)
    for t in TREES:
        policy.observe(t, tree_ms, tree_tau)
    return policy


def test_plain_wins_where_rounds_cost_more_than_they_emit():
    policy = _seeded(plain_ms=1.0, tree_ms=4.0, tree_tau=3.0)  # 0.75 tokens/ms against 1
    assert policy.choose(True) is None
    policy = _seeded(plain_ms=1.0, tree_ms=2.0, tree_tau=3.0)  # 1.5 against 1
    assert policy.choose(True) is not None
    assert policy.choose(False) is None  # rows whose drafts are behind decode plain
    assert policy.log[-1]["why"] == "the rows decoded plain before"


def test_a_tree_that_cannot_win_even_accepting_everything_is_not_retried():
    policy = _seeded(plain_ms=1.0, tree_ms=50.0, tree_tau=1.0)
    policy.groups = policy.retry + 10  # past the retry interval
    assert policy.choose(True) is None


def test_adaptive_refuses_sampling_and_a_fixed_tree():
    model = perm_target()
    target, runner = engines(model, oracle_draft(model))
    with pytest.raises(ConfigError, match="adaptive"):
        batch_generate(target, prompts(), 4, draft=runner, adaptive=AdaptivePolicy(tuple(TREES)), temperature=1.0)
    with pytest.raises(ConfigError, match="adaptive"):
        batch_generate(target, prompts(), 4, draft=runner, tree=TREES[0], adaptive=AdaptivePolicy(tuple(TREES)))


def test_a_round_after_plain_steps_keeps_idle_rows_inside_the_cache():
    """Plain steps move a row without a request on to the cache's last slot; the next round
    must not write past the cache there."""
    from draftling.engine import generate as gen
    from draftling.engine.accept import SpecOptions

    model = perm_target()
    target, runner = engines(model, oracle_draft(model), slots=2)
    ps = prompts()[:1]
    run = gen._Run(target, runner, None, SpecOptions(), ps, [20], Scripted(tuple(TREES), [TREES[2]]))
    run.admit()
    run.n[1] = target.max_seq_len - 1  # row 1 holds no request: where plain steps leave it
    while any(r is not None for r in run.row_req):
        run.step()
    assert run.outs[0].tokens == alone(model, ps, [20])[0]


def test_admissions_are_charged_to_the_config_whose_rows_finished(monkeypatch):
    """Prefills of requests admitted between two groups are charged to the config of the group
    before them (its rows finishing made them), never to the next group's round time."""
    import time

    from draftling.engine import generate as gen

    model = perm_target()
    target, runner = engines(model, oracle_draft(model), slots=2)
    trees = (TREES[1], TREES[2])
    real = gen._Run._prefill

    def slow(self, rows, reqs):
        time.sleep(0.2 if self.group_end is not None else 0.0)  # only admissions after the first group
        return real(self, rows, reqs)

    monkeypatch.setattr(gen._Run, "_prefill", slow)
    policy = Scripted(trees, [trees[0], trees[1]])
    charged: list[tuple[str, float]] = []
    seen: list[float] = []
    policy.observe = lambda t, ms, tau, count, spread=None: seen.append(ms)  # type: ignore[method-assign]
    policy.charge = lambda t, ms: charged.append((config_name(t), ms))  # type: ignore[method-assign]
    batch_generate(target, prompts()[:4], [3, 3, 3, 3], draft=runner, adaptive=policy)
    assert max(seen) < 200.0  # no group holds a prefill
    dear = [name for name, ms in charged if ms >= 200.0]
    assert dear and set(dear) <= {config_name(t) for t in trees}
    # Each prefill lands on the config of the group just before it (the script alternates).
    ran = [d["choice"] for d in policy.log]
    assert all(name == ran[i] for i, (name, ms) in enumerate(charged) if ms >= 200.0)


def test_one_prefill_spreads_over_the_rounds_around_it():
    """At one row each request's prefill follows its last group; spread over the config's recent
    rounds it adds a little to each, and a config that wins by its rounds keeps winning. A
    config whose rounds are each followed by a prefill (rows finishing one at a time) pays it."""
    tree = TREES[1]
    policy = AdaptivePolicy((tree,))
    policy.estimates[PLAIN].update(2.0, 1.0, 1.0)  # 0.625 tokens/ms against 0.5 below
    for _ in range(30):
        policy.observe(tree, 4.0, 2.5, count=4)
    policy.charge(tree, 15.0)  # one request's prefill
    assert policy.choose(True) == tree
    for _ in range(30):
        policy.observe(tree, 4.0, 2.5, count=4)
        policy.charge(tree, 8.0)  # 2 ms a round of admissions
    assert policy.rate(tree) < policy.rate(None)


def test_a_long_serving_policy_keeps_a_bounded_log_and_full_counts():
    policy = AdaptivePolicy(TREES[:1])
    policy.LOG_KEEP = 4
    for _ in range(50):
        policy.choose(True)
    assert len(policy.log) <= 8 and policy.log[-1]["group"] == policy.groups
    report = policy.report()
    assert sum(report["groups_by_choice"].values()) == 50 and len(report["first_decisions"]) == 8
    assert report["settings"]["tau_rounds"] == 64 and report["settings"]["leave_margin"] == 1.05


def _serve(policy, taus, round_ms=2.0, count=4):
    """Groups of ``count`` rounds at ``round_ms`` with the given mean acceptance each, as the
    decode loop runs them: once a group goes plain, its rows stay plain. The choices made."""
    can, choices = True, []
    for tau in taus:
        tree = policy.choose(can)
        choices.append(config_name(tree))
        if tree is None:
            can = False
            policy.observe(None, 1.0, 1.0, count)
        else:
            policy.observe(tree, round_ms, tau, count)
    return choices


def test_a_hard_stretch_of_text_does_not_send_a_winning_config_plain():
    """Rounds of 2 ms against 1 ms plain steps: speculation pays above tau 2. The text alternates
    stretches of 1.6 and 3.0 (mean 2.3): speculation wins overall, and its rows would stay plain
    for good after one switch, so one hard stretch must not make it. Text that stays hard does."""
    tree = TREES[1]
    policy = AdaptivePolicy((tree,))
    policy.estimates[PLAIN].update(1.0, 1.0, 1.0)
    stretches = ([3.0] * 3 + [1.6] * 3 + [3.0] * 3 + [1.6] * 4) * 6
    assert PLAIN not in _serve(policy, stretches)
    assert 2.0 < policy.estimates[config_name(tree)].tau < 2.6
    policy = AdaptivePolicy((tree,))
    policy.estimates[PLAIN].update(1.0, 1.0, 1.0)
    choices = _serve(policy, [3.0] * 3 + [1.6] * 60)
    assert PLAIN in choices[:40] and set(choices[choices.index(PLAIN) :]) == {PLAIN}


def test_the_acceptance_estimate_is_the_mean_of_the_last_rounds():
    policy = AdaptivePolicy(TREES[:1], tau_rounds=8)
    for tau in (2.0, 4.0):
        policy.observe(TREES[0], 1.0, tau, count=4)
    assert policy.estimates[config_name(TREES[0])].tau == pytest.approx(3.0)  # the mean of 8 rounds
    for _ in range(20):
        policy.observe(TREES[0], 1.0, 1.5, count=4)
    assert policy.estimates[config_name(TREES[0])].tau == pytest.approx(1.5, abs=1e-3)  # the old rounds are gone


def test_a_few_row_rounds_of_low_acceptance_do_not_send_rows_plain():
    """Going plain cannot be undone while the rows decode, so it waits until the acceptance is
    known: the best config's mean plus two standard errors must still lose. One group of 4
    rounds of 2 rows at tau 1.6 (spread 1) may still be a 2.3; 64 rounds of them cannot."""
    tree = TREES[0]
    policy = AdaptivePolicy((tree,))
    policy.estimates[PLAIN].update(1.0, 1.0, 1.0)
    policy.observe(tree, 2.0, 1.6, count=4, spread=(1.0, 8))  # 0.8 tokens/ms against plain's 1
    assert policy.choose(True) == tree
    assert policy.estimates[config_name(tree)].tau_high(2.0) == pytest.approx(1.6 + 2 * (1 / 8) ** 0.5)
    for _ in range(16):
        policy.observe(tree, 2.0, 1.6, count=4, spread=(1.0, 8))
    assert policy.estimates[config_name(tree)].samples == 128  # the last 64 rounds of 2 rows
    assert policy.choose(True) is None
    assert "high bound" in policy.log[-1]["why"]
    # Without a measured spread the mean alone decides, as before.
    assert _seeded(plain_ms=1.0, tree_ms=2.0, tree_tau=1.6).choose(True) is None
