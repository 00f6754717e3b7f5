"""Speculation that adapts to load: before each group of rounds the decode loop asks which
draft shape to run for the whole batch (a tree, a chain, or none) from what it has measured.

The expected rate of a config is its acceptance (tokens per round, bonus included, the mean
of the active rows' recent values) over its cost per round at this engine's row count; plain
decoding emits one token per step. Costs are measured, never assumed: a plain step by
replaying the engine's own step on the current state (its outputs are dropped, and the cache
slots it writes are rewritten before any pass reads them), then by its groups; a config's
round by timing the rounds it runs. A config's acceptance is its mean over its last
``tau_rounds`` rounds (all of them until there are that many): a group's few rounds follow the
text's difficulty from sentence to sentence, and an estimate that followed them would drop a
config after a hard stretch and keep it at that low until its retry. The admissions that
follow a group are charged to the config that ran it, spread over its recent rounds:
speculation's rows finish one at a time and admit their successors in small prefills, plain
rows that started together finish together and share one. (Charged to the group after them
instead, one prefill doubles that group's time and, at one row, turns every request plain
after its first.) Each config is tried once; one that lost is tried again every ``retry``
groups, so its estimates follow the text, unless even an ideal acceptance (every draft
accepted) could not beat plain at the measured times.

Plain steps do not advance the draft's cache, so once a batch decodes plain its rows stay
plain until they finish; a row admitted later starts with a fresh draft (the prefill extends
it) and joins speculation only when every active row can. Since that switch cannot be undone,
speculating rows go plain only when plain's rate beats the best config's by ``leave_margin``
even at that config's acceptance ``leave_z`` standard errors above its mean (per row and round,
over the rounds its mean covers): a few rounds of a few rows are too noisy to leave on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from draftling.timing import sync

Tree = tuple[int, int, int]  # (steps, topk, num_draft_tokens)
PLAIN = "plain"
TAU_ROUNDS = 64  # rounds an acceptance estimate averages (AdaptivePolicy.tau_rounds)


def config_name(tree: Tree | None) -> str:
    if tree is None:
        return PLAIN
    steps, topk, q = tree
    return f"{'chain' if topk == 1 else 'tree'}-{steps}-{topk}-{q}"


@dataclass
class Estimate:
    """What one config has shown: mean ms per round (or plain step) and mean tokens per round,
    and the admission ms charged to it over its recent rounds (sums that decay by ``keep`` per
    group, so one prefill spreads over the rounds around it instead of one group)."""

    round_ms: float | None = None
    tau: float | None = None
    runs: int = 0  # groups of rounds measured
    last_group: int = 0  # the decision group it last ran in
    admit_ms: float = 0.0
    rounds: float = 0.0
    tau_seen: int = 0  # rounds in the acceptance mean, up to the policy's tau_rounds
    tau_var: float = 0.0  # the variance of one row's tokens in one round, over the same rounds
    samples: float = 0.0  # row-rounds behind the mean (0: no spread measured)

    def update(
        self,
        ms: float,
        tau: float | None,
        weight: float,
        count: int = 1,
        keep: float = 0.95,
        tau_rounds: int = TAU_ROUNDS,
        spread: tuple[float, int] | None = None,
    ) -> None:
        self.round_ms = ms if self.round_ms is None else (1 - weight) * self.round_ms + weight * ms
        if tau is not None:
            # The mean of the rounds so far, then a moving mean over the last tau_rounds (a
            # first measurement of no rounds, plain's timing replay, sets it).
            self.tau_seen = min(self.tau_seen + count, tau_rounds)
            w = count / self.tau_seen if self.tau_seen else 1.0
            self.tau = tau if self.tau is None else (1 - w) * self.tau + w * tau
            if spread is not None and count:
                var, n = spread
                self.tau_var = (1 - w) * self.tau_var + w * var
                self.samples = min(self.samples + n, tau_rounds * n / count)
        self.rounds = keep * self.rounds + count
        self.admit_ms *= keep
        self.runs += 1

    def tau_high(self, z: float) -> float | None:
        """The acceptance z standard errors above its mean: what it may still be."""
        if self.tau is None or not self.samples:
            return self.tau
        return self.tau + z * (self.tau_var / self.samples) ** 0.5

    def cost_ms(self) -> float | None:
        """ms per round with its share of admissions."""
        if self.round_ms is None:
            return None
        return self.round_ms + (self.admit_ms / self.rounds if self.rounds else 0.0)


@dataclass
class AdaptivePolicy:
    """The choice among ``trees`` and plain decoding, made per group of rounds. ``weight``:
    how fast the cost estimates follow new measurements; ``tau_rounds``: the rounds an
    acceptance estimate averages; ``retry``: groups between retries of a config that lost;
    ``leave_margin``: how much faster plain must look before speculating rows go plain, than
    the best config at its acceptance ``leave_z`` standard errors above its mean (a few rounds
    of a few rows say little, and going plain cannot be undone while those rows decode).
    ``log``: the latest decisions with their inputs (at most 2 * LOG_KEEP, so a long-serving
    engine does not grow); ``counts`` and ``first``: what ``report`` sums up."""

    LOG_KEEP = 256
    trees: tuple[Tree, ...]
    weight: float = 0.3
    tau_rounds: int = TAU_ROUNDS
    retry: int = 64
    leave_margin: float = 1.05
    leave_z: float = 2.0
    estimates: dict = field(default_factory=dict)
    log: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)  # groups per choice, since the start
    first: list = field(default_factory=list)  # the first 8 decisions
    groups: int = 0

    def __post_init__(self):
        self.trees = tuple(tuple(t) for t in self.trees)  # type: ignore[misc]
        for t in (None, *self.trees):
            self.estimates.setdefault(config_name(t), Estimate())

    def measure_plain(self, step, device, reps: int = 3) -> None:
        """Time ``step()`` (one plain step of the whole batch, outputs dropped) if not yet known."""
        est = self.estimates[PLAIN]
        if est.round_ms is not None:
            return
        step()  # a first call may capture a graph or compile
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        sync(device)
        est.update((time.perf_counter() - t0) * 1e3 / reps, 1.0, 1.0, count=0)

    def rate(self, tree: Tree | None, z: float = 0.0) -> float | None:
        """Expected tokens per ms per row, or None where the config has no measurement; with
        ``z``, at its acceptance z standard errors above the mean."""
        est = self.estimates[config_name(tree)]
        cost, tau = est.cost_ms(), est.tau_high(z)
        if cost is None or tau is None:
            return None
        return tau / cost

    def choose(self, can_speculate: bool) -> Tree | None:
        """The config for the next group: an untried one that could still win, else the best
        measured one (plain when nothing beats it)."""
        self.groups += 1
        plain_ms = self.estimates[PLAIN].round_ms
        choice: Tree | None = None
        why = "the rows decoded plain before" if not can_speculate else ""
        if can_speculate:
            untried = [t for t in self.trees if self._worth_trying(t, plain_ms)]
            if untried:
                choice = untried[0]
                why = "retry" if self.estimates[config_name(choice)].runs else "not measured yet"
            else:
                best = max(self.trees, key=lambda t: self.rate(t) or 0.0)
                if (self.rate(None) or 0.0) > self.leave_margin * (self.rate(best, self.leave_z) or 0.0):
                    choice, why = (
                        None,
                        f"plain's rate beats the best config's high bound by over {self.leave_margin:.2f}x",
                    )
                else:
                    choice, why = best, "highest measured rate"
        self._record({"group": self.groups, "choice": config_name(choice), "why": why, **self.snapshot()})
        return choice

    def _record(self, decision: dict) -> None:
        self.counts[decision["choice"]] = self.counts.get(decision["choice"], 0) + 1
        if len(self.first) < 8:
            self.first.append(decision)
        self.log.append(decision)
        if len(self.log) > 2 * self.LOG_KEEP:
            del self.log[: -self.LOG_KEEP]

    def _worth_trying(self, tree: Tree, plain_ms: float | None) -> bool:
        est = self.estimates[config_name(tree)]
        if est.runs == 0:
            return True
        if self.groups - est.last_group < self.retry:
            return False
        # Even with every draft accepted (tau = path length) it could not beat plain: skip.
        ideal = min(tree[0], tree[2] - 1) + 1
        return plain_ms is None or est.round_ms is None or ideal / est.round_ms > 1.0 / plain_ms

    def observe(
        self,
        tree: Tree | None,
        ms_per_round: float,
        tau: float | None,
        count: int = 1,
        spread: tuple[float, int] | None = None,
    ) -> None:
        """A group of ``count`` rounds (or plain steps) of ``tree`` took ``ms_per_round`` each
        and emitted ``tau`` tokens per row and round; ``spread``: (the variance of one row's
        tokens in one round, row-rounds measured)."""
        est = self.estimates[config_name(tree)]
        est.update(ms_per_round, tau, self.weight, count, tau_rounds=self.tau_rounds, spread=spread)
        est.last_group = self.groups

    def charge(self, tree: Tree | None, ms: float) -> None:
        """Admissions that followed a group of ``tree`` (its rows finished) took ``ms``."""
        self.estimates[config_name(tree)].admit_ms += ms

    def snapshot(self) -> dict:
        return {
            name: {
                "round_ms": e.round_ms,
                "tau": e.tau,
                "tau_high": e.tau_high(self.leave_z),
                "admit_ms_per_round": e.cost_ms() - e.round_ms,
            }
            for name, e in self.estimates.items()
            if e.round_ms is not None
        }

    def report(self) -> dict:
        """Its settings, groups per choice, the final estimates, and the first few decisions."""
        settings = {k: getattr(self, k) for k in ("weight", "tau_rounds", "retry", "leave_margin", "leave_z")}
        return {
            "settings": settings,
            "groups_by_choice": dict(self.counts),
            "estimates": self.snapshot(),
            "first_decisions": self.first,
        }
