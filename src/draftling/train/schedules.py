"""The LR schedule: linear warmup then cosine decay (``CosineSchedule``), and ``train.fit_schedule``
fitting its length to a time budget from the step time measured on this machine (``FitToTime``)."""

from __future__ import annotations

import math
import time

import torch

from draftling.config import TrainConfig
from draftling.errors import ConfigError
from draftling.train.distributed import DistContext


class CosineSchedule:
    """The LR factor at a step: linear warmup, then cosine decay to ``min_ratio`` at step
    ``total``. ``total`` may be changed while training (a schedule fitted to a time budget)."""

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def fitted_total(step: int, cap: int, seconds_left: float, step_s: float) -> int:
    """The schedule's length so that it ends inside a time budget: ``step`` plus the steps
    that fit into ``seconds_left`` at ``step_s`` each, at least one more, never past ``cap`` (a
    refit at the ceiling's own step, an epoch start there, ends the run at the ceiling)."""
    return min(cap, max(step + 1, step + int(seconds_left / max(step_s, 1e-9))))


class FitToTime:
    """``train.fit_schedule``: fit the LR schedule's length to ``train.max_minutes`` from the
    step time measured on this machine, so the decay ends inside the budget instead of being
    cut off. Refitted after the first steps and at each epoch start (later epochs read the
    teacher cache and run faster than the first), from the steps since the last fit."""

    FIRST_FIT = 10

    def __init__(
        self, tc: TrainConfig, cap: int, t_start: float, step: int, ctx: DistContext, device, clock=time.perf_counter
    ):
        if tc.max_minutes <= 0:
            raise ConfigError("train.fit_schedule needs a time budget: set train.max_minutes")
        self.budget_s, self.cap, self.t_start = 60 * tc.max_minutes, cap, t_start
        self.ctx, self.device, self.clock = ctx, device, clock
        self.mark = (step, clock())
        self.fitted = False

    def due(self, step: int, epoch_start: bool) -> bool:
        return step - self.mark[0] >= self.FIRST_FIT and (epoch_start or not self.fitted)

    def refit(self, step: int) -> int:
        now = self.clock()
        step_s = (now - self.mark[1]) / (step - self.mark[0])
        if self.ctx.active:  # every rank must agree on the schedule: the slowest rank's pace
            t = torch.tensor([step_s], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            step_s = t.item()
        self.mark, self.fitted = (step, now), True
        return fitted_total(step, self.cap, self.budget_s - (now - self.t_start), step_s)
