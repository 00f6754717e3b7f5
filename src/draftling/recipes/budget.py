"""The quickstart's time budget: how its stages share ``--minutes`` on the running machine.

Nothing here comes from a table of machines. After the target loads, two probes time this
machine: one training step of the configured draft on random data (train/probe.py
``measure_step_seconds``) and a plain decode on the bench's engine (bench/simple.py
``estimate_bench_seconds``). The bench, the final validation and a small reserve are set
aside; data and training split the rest. Regeneration then measures its own rate and stops at
its share (data/regen.py ``regenerate_within``); training gets whatever is left when the data
is done and fits its LR schedule to it (``train.fit_schedule``). The smoke bench's convergence
verdict runs where its checks fit ``train.smoke_max_share`` of that training (``plan_smoke``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from draftling.errors import ConfigError

# Of the time left for data and training, the share regeneration gets. The 2026-12-02 runs
# that reached val chain tau 1.54 spent 324 s on data and 325 s on training.
DATA_SHARE = 0.5
# A validation batch (forward only, plus the chain walk) against one training step.
VAL_STEP_RATIO = 0.6
# Vocab, export, checkpoints and the writes between stages.
RESERVE_S = 15.0
# Training needs at least its warm-up and a few steps of decay to be worth running.
MIN_TRAIN_STEPS = 30


@dataclass(frozen=True)
class BudgetPlan:
    total_s: float
    planned_at_s: float  # elapsed when the plan was made (loading and the probes)
    step_s: float  # one training step, measured
    decode_token_s: float  # one plain decode token on the bench's engine, measured
    bench_s: float
    val_s: float
    data_s: float
    train_s: float  # as planned up front; train_seconds() re-plans it once the data is done

    def as_dict(self) -> dict:
        return {k: round(v, 3 if k.endswith("token_s") or k == "step_s" else 1) for k, v in asdict(self).items()}

    def train_seconds(self, elapsed_s: float) -> float:
        """Training's share once the data is done: whatever the bench, validation and the
        reserve do not need, and never less than MIN_TRAIN_STEPS steps (data that overran
        makes the run a little late rather than leave a head untrained)."""
        left = self.total_s - elapsed_s - self.bench_s - self.val_s - RESERVE_S
        return max(left, MIN_TRAIN_STEPS * self.step_s)


def plan_budget(
    minutes: float, elapsed_s: float, step_s: float, decode_token_s: float, bench_s: float, val_batches: int
) -> BudgetPlan:
    """Split ``minutes`` from the measurements; a ConfigError if training would not get
    ``MIN_TRAIN_STEPS`` steps, naming the measured step time and the budget that would."""
    total = 60 * minutes
    val_s = val_batches * VAL_STEP_RATIO * step_s
    fixed = elapsed_s + bench_s + val_s + RESERVE_S
    left = total - fixed
    data_s, train_s = DATA_SHARE * left, (1 - DATA_SHARE) * left
    need = MIN_TRAIN_STEPS * step_s
    if train_s < need:
        enough = (fixed + need / (1 - DATA_SHARE)) / 60
        raise ConfigError(
            f"--minutes {minutes:g} is too little on this machine: one training step takes {step_s:.2f} s "
            f"(measured), so {MIN_TRAIN_STEPS} steps need {need:.0f} s, but after loading ({elapsed_s:.0f} s), "
            f"the bench (~{bench_s:.0f} s), validation (~{val_s:.0f} s) and data, training would get "
            f"{max(train_s, 0):.0f} s; ask for at least {math.ceil(enough * 2) / 2:g} minutes"
        )
    return BudgetPlan(total, elapsed_s, step_s, decode_token_s, bench_s, val_s, data_s, train_s)


def plan_smoke(plan: BudgetPlan, train_s: float, tc, prompts: int, ceiling: int = 0) -> tuple[int, dict]:
    """(train.smoke_every, what the summary says) for ``train_s`` seconds of training, or fewer
    steps where the run's step ceiling (``ceiling`` > 0) ends it first.

    A verdict needs ``tc.convergence_checks`` checks after an anchor check. One check is priced
    from the decode probe as every one of the ``prompts`` smoke prompts decoding
    ``tc.smoke_max_new_tokens`` tokens in turn; the check decodes them as one batch and is
    faster, so the price errs towards fewer checks. Where the checks cost more than
    ``tc.smoke_max_share`` of the training, there are none (0), and the reason names the numbers
    and the ``--minutes`` that would afford them."""
    checks = tc.convergence_checks + 1
    check_s = prompts * tc.smoke_max_new_tokens * plan.decode_token_s
    steps = int(train_s / plan.step_s)
    capped = 0 < ceiling < steps  # the run ends at its step ceiling, before its time is spent
    if capped:
        steps, train_s = ceiling, ceiling * plan.step_s
    need_s = checks * check_s
    info = {
        "checks_needed": checks,
        "check_s_estimate": round(check_s, 1),
        "train_s": round(train_s, 1),
        "share": round(need_s / train_s, 3),
        "max_share": tc.smoke_max_share,
    }
    if tc.smoke_max_share > 0 and need_s <= tc.smoke_max_share * train_s and steps >= checks:
        return steps // checks, {**info, "smoke_every": steps // checks}
    # Training's share of a larger budget grows with (1 - DATA_SHARE) of each added second.
    fixed = plan.planned_at_s + plan.bench_s + plan.val_s + RESERVE_S
    minutes = (fixed + need_s / max(tc.smoke_max_share, 1e-9) / (1 - DATA_SHARE)) / 60
    more = (
        "more steps (train.max_steps, train.epochs) would afford it"
        if capped
        else f"about --minutes {math.ceil(minutes)} would afford it"
    )
    info["why"] = (
        f"a convergence verdict needs {checks} smoke checks of ~{check_s:.0f} s each ({prompts} prompts x "
        f"{tc.smoke_max_new_tokens} tokens at {plan.decode_token_s * 1000:.0f} ms a token, measured here): "
        f"{need_s / train_s:.0%} of the {train_s:.0f} s of training"
        f"{f' ({steps} steps, its ceiling)' if capped else ''}, over train.smoke_max_share="
        f"{tc.smoke_max_share:g}; {more}"
    )
    return 0, info
