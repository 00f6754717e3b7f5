"""Wall-clock timing of device work: the one place that decides when a clock read must wait
for the device (CUDA queues work and returns at once; the CPU runs it before returning)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def sync(device) -> None:
    """Wait until ``device``'s queued work is done (nothing to wait for off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device) -> tuple[T, float]:
    """(fn(), its seconds), the device's queue drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0
