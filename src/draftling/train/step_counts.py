"""The TTT unroll's summed per-step counts and the metrics read from them (train/ttt.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class StepCounts:
    """Summed counts over batches, so metrics are exact over any number of batches.

    The per-step sums (FIELDS, one row each) are one float64 tensor ``sums`` [6, steps] on the
    device that counted them: adding counts stays there, and only reading a field or
    ``metrics()`` copies them to the host (one sync), so training reads them once per log line.
    Fields given by name (host lists) start a tally on the host."""

    # valid: positions with a loss (target argmax in the draft vocab); chain_valid: scored and
    # all earlier steps correct; scored: every loss-masked position, also where the target's
    # argmax is outside the draft vocab: decoding always misses there, so accuracies count those
    # as misses (all zero = use valid).
    FIELDS = ("loss_sum", "valid", "correct", "chain_valid", "chain_correct", "scored")
    # Without gradients (validation): the chain decode walked over each sequence (chain_walk).
    WALK_FIELDS = ("walk_rounds", "walk_accepted")

    def __init__(
        self,
        steps: int,
        sums: torch.Tensor | None = None,
        *,
        device=None,
        walk_rounds: int = 0,
        walk_accepted: int = 0,
        **per_step: Sequence[float],
    ):
        if sums is None:
            sums = torch.zeros(len(self.FIELDS), steps, dtype=torch.float64, device=device)
            for name, values in per_step.items():
                sums[self.FIELDS.index(name)] = torch.tensor(values, dtype=torch.float64)
        self.steps, self.sums = steps, sums
        self.walk_rounds, self.walk_accepted = walk_rounds, walk_accepted

    def __getattr__(self, name: str) -> list:
        if name not in StepCounts.FIELDS:
            raise AttributeError(name)
        return self.rows()[StepCounts.FIELDS.index(name)]

    def rows(self) -> list[list]:
        """The per-step sums on the host, in FIELDS order: floats for loss_sum, ints for counts."""
        loss_sum, *counts = self.sums.tolist()
        return [loss_sum, *([int(x) for x in row] for row in counts)]

    def add(self, other: StepCounts) -> None:
        self.sums = self.sums + other.sums
        for name in self.WALK_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def metrics(self) -> dict:
        loss_sum, valid, correct, chain_valid, chain_correct, scored = self.rows()
        scored = scored if any(scored) else valid
        acc = [c / v if v else 0.0 for c, v in zip(correct, scored)]
        cond = [c / v if v else 0.0 for c, v in zip(chain_correct, chain_valid)]
        tau, prod = 1.0, 1.0
        for c in cond:
            prod *= c
            tau += prod
        loss = [s / v if v else 0.0 for s, v in zip(loss_sum, valid)]
        # The share of step-0 positions whose target argmax the draft vocab holds: acc's ceiling.
        coverage = valid[0] / scored[0] if scored and scored[0] else 0.0
        out = {
            "loss_per_step": loss,
            "acc": acc,
            "cond_acc": cond,
            "sim_tau": tau,
            "vocab_coverage": coverage,
            "tokens": valid[0] if valid else 0,
        }
        if self.walk_rounds:
            # What a greedy chain-`steps` decode of these sequences measures (bonus counted).
            out["chain_tau"] = (self.walk_rounds + self.walk_accepted) / self.walk_rounds
        return out
