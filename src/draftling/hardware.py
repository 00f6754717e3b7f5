"""What this machine computes fastest, measured rather than guessed from CPU flags.

CPUs differ a lot in bf16: one with AVX512-BF16 or AMX multiplies bf16 two to four times
faster than fp32, one without emulates it and is several times slower (a 2-core Xeon here took
126 ms in bf16 against 30 ms in fp32 for the same matmul). A short timed probe tells them apart.
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import torch

from draftling.errors import ConfigError

# Config value for "bfloat16 where it is faster here, else the run's own dtype".
BF16_IF_FAST = "bfloat16_if_fast"


@functools.cache
def bf16_matmul_is_faster(device_type: str = "cpu") -> bool:
    """True on CUDA; on the CPU, whether a [256, 576] x [576, 1536] matmul (a small target's
    projection over a batch of rows) runs at least 1.3x faster in bf16 than in fp32. About 50 ms;
    measured once per process."""
    if device_type == "cuda":
        return True
    if device_type != "cpu":
        return False
    bf16, fp32 = _cpu_matmul_seconds((torch.bfloat16, torch.float32))
    return bf16 * 1.3 < fp32


def _cpu_matmul_seconds(dtypes: tuple[torch.dtype, ...], reps: int = 9) -> list[float]:
    """The best time of a [256, 576] x [576, 1536] matmul per dtype."""
    g = torch.Generator().manual_seed(0)  # the run's own random stream stays untouched
    a, b = torch.randn(256, 576, generator=g), torch.randn(576, 1536, generator=g)
    pairs = [(a.to(d), b.to(d)) for d in dtypes]
    return _best_seconds([lambda x=x, y=y: x @ y for x, y in pairs], reps)


def _best_seconds(calls, reps: int) -> list[float]:
    """The best time per call after a first untimed one (kernel selection and packing), the
    calls taking turns, so that a burst of load from other processes slows them alike instead
    of deciding the answer."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(reps):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


# Answers of column_major_linear_is_faster fixed by pin_column_major: the two layouts round
# differently, so a resumed run must keep its first run's pick (a busy machine may time otherwise).
_PINNED_LAYOUT: dict[torch.dtype, bool] = {}


def pin_column_major(dtype: torch.dtype, column: bool) -> None:
    """Make column_major_linear_is_faster(dtype) answer ``column`` in this process."""
    _PINNED_LAYOUT[dtype] = bool(column)


# row or column: skip the timing (two runs that must agree bit for bit, as the fault tests' are).
LAYOUT_ENV = "DRAFTLING_CPU_WEIGHT_LAYOUT"


def column_major_linear_is_faster(dtype: torch.dtype = torch.float32) -> bool:
    """The pinned answer for ``dtype`` (pin_column_major), else $DRAFTLING_CPU_WEIGHT_LAYOUT's,
    else the timed one."""
    if dtype in _PINNED_LAYOUT:
        return _PINNED_LAYOUT[dtype]
    forced = os.environ.get(LAYOUT_ENV)
    if forced:
        if forced not in ("row", "column"):
            raise ConfigError(f"${LAYOUT_ENV}={forced!r}: expected row or column")
        return forced == "column"
    return _time_column_major(dtype)


@functools.cache
def _time_column_major(dtype: torch.dtype) -> bool:
    """Whether F.linear on this CPU runs clearly faster (by 10% or more) with a column-major
    weight (the transpose of a contiguous [in, out] tensor) than with the usual row-major one,
    timed in ``dtype`` on a small target's projection for a decode-sized input (4 rows) and a
    teacher-sized one (256 rows). A 2-core Xeon ran SmolLM2's 4-token verify pass 168 -> 127 ms
    column-major in fp32; a 2-core EPYC without AVX512 ran the 4-row bf16 case 14x slower
    (6.4 against 0.46 ms). About 50 ms; measured once per process and dtype."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=g).to(dtype)
    xs = [torch.randn(n, 576, generator=g).to(dtype) for n in (4, 256)]
    layouts = (w, w.t().contiguous().t())
    times = _best_seconds([lambda x=x, v=v: torch.nn.functional.linear(x, v) for v in layouts for x in xs], 5)
    row_t, col_t = times[: len(xs)], times[len(xs) :]
    ratio = statistics.fmean(c / r for c, r in zip(col_t, row_t))  # a mean of ratios: each size counts alike
    return ratio < 0.9


def resolve_fast_dtype(name: str | None, device, own: torch.dtype, field: str) -> torch.dtype:
    """The config field ``field``'s dtype name -> torch dtype: null = ``own``;
    ``bfloat16_if_fast`` = bfloat16 where :func:`bf16_matmul_is_faster` on this device, else
    ``own``."""
    if name is None:
        return own
    if name == BF16_IF_FAST:
        return torch.bfloat16 if bf16_matmul_is_faster(torch.device(device).type) else own
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"{field}={name!r}: expected null, {BF16_IF_FAST} or a floating dtype name such as bfloat16")
    return dtype
