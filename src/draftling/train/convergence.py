"""Convergence detection: a small fixed smoke bench while training, and the rule that reads it.

Every ``train.smoke_every`` steps the run decodes a small versioned prompt set
(``train.smoke_prompts``, by default ``set:smoke-v1``) greedily, chain-3-1-4, on the batched
decode engine (``train.smoke_rows`` prompts at once, each in its own cache row, as batch 1 would
decode it) with a frozen copy of the current draft, and logs tau (tokens per target pass,
bonus included) per prompt, per workload and overall to metrics.jsonl. It is a trend
instrument for this run, not a release number: few prompts, short completions, eager engine.

The noise band. The prompts are the same at every check, so two checks compare paired: each
prompt's own change d_p. The band is estimated from the data, as Z standard errors of the mean
change, from the per-prompt variance of d: ``band = Z * sd(d) / sqrt(P)``. A mean change inside
it is one the prompts' scatter can produce with no trend. (The unpaired standard error of the
mean tau would also count how prompts differ from each other, which cancels between checks; it
is several times wider and would call a still-rising tau flat.)

The rule. With M = ``train.convergence_checks``, the run has converged at check n when each of
the M checks after check n-M (the anchor) differs from the anchor by no more than its band.
Measuring against the anchor, not the previous check, makes a slow steady rise add up until it
leaves the band; a flat tau (every d_p = 0) stays inside. An anchor taken during LR warmup does
not count: tau that has not started to move is not a plateau. Nor does a plateau at the floor
(tau under FLOOR_TAU, next to the bonus token alone): that draft has not learned anything to
converge on, and calling it converged would stop a broken run as if it were done. The whole history is in
metrics.jsonl, so a resumed run replays it and decides exactly as an uninterrupted one.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass

import torch

from draftling.data.prompt_sets import BenchPrompt, UnknownPromptSet, read_prompt_set, tokenize_prompt_set
from draftling.draft.block import BlockDraft
from draftling.engine import CachedTarget, DraftRunner, UnsupportedArchitecture, build_target
from draftling.engine.block_round import BlockRunner
from draftling.engine.generate import batch_generate
from draftling.errors import ConfigError, DataError
from draftling.target.devmap import dispatched_devices

SMOKE_CONFIG = "chain-3-1-4"
SMOKE_TREE = (3, 1, 4)  # SMOKE_CONFIG as (steps, topk, draft tokens) in SGLang's naming (draft tokens count the root)
# Cache slots past the longest prompt and reply: a round's queries (a block drafter's whole
# block, up to this many) and the engine's padding.
SMOKE_HEADROOM = 40
BAND_Z = 2.0  # ~95% two-sided for a normal mean change
# 1 is the bonus token alone; below 1.1 a draft accepts less than one token in ten rounds, which
# chance matches can give an untrained one on a small vocab: not a plateau to stop on.
FLOOR_TAU = 1.1


def load_smoke_prompts(spec: str, tokenizer, vocab_size: int) -> list[BenchPrompt]:
    """The prompts of ``spec`` (a prompt set: "set:NAME" or a jsonl path; data/prompt_sets.py)
    as token ids, checked for the smoke bench."""
    where = f"train.smoke_prompts={spec}"
    try:
        _, records = read_prompt_set(spec)
    except UnknownPromptSet as e:  # a bad value of the key, not bad data
        raise ConfigError(f"train.smoke_prompts: {e}") from None
    prompts = tokenize_prompt_set(records, tokenizer)
    if len(prompts) < 2:  # one prompt has no variance to estimate the noise band from
        raise ConfigError(f"{where}: {len(prompts)} prompt(s); the noise band needs at least 2")
    for p in prompts:
        if max(p.input_ids) >= vocab_size or min(p.input_ids) < 0:
            raise DataError(f"{where}: prompt {p.id} has token ids outside the target's vocabulary of {vocab_size}")
    return prompts


class SmokeBench:
    """Chain-3-1-4 greedy decoding of fixed prompts with a copy of a draft (a block drafter
    decodes its one block chain instead): per-prompt tau."""

    def __init__(self, target, prompts: list[BenchPrompt], max_new_tokens: int, name: str, rows: int):
        self.target, self.prompts, self.max_new_tokens, self.name = target, prompts, max_new_tokens, name
        self.max_len = max(len(p.input_ids) for p in prompts) + max_new_tokens + SMOKE_HEADROOM
        self.rows = min(len(prompts), rows)
        self.eos = target.stop_token_ids()
        self._engine: tuple | None = None
        self.engine(target.aux_layer_ids)  # an unsupported target fails now, not at the first check

    @classmethod
    def load(cls, tc, target) -> SmokeBench:
        if dispatched_devices(target.model):  # found before training, not at the first check
            raise ConfigError(
                "train.smoke_every: the decode engine runs a target on one device, and this one is "
                "spread over devices by a device map; set train.smoke_every=0"
            )
        prompts = load_smoke_prompts(tc.smoke_prompts, target.tokenizer, target.config.vocab_size)
        return cls(target, prompts, tc.smoke_max_new_tokens, tc.smoke_prompts, tc.smoke_rows)

    def engine(self, aux_layer_ids) -> CachedTarget:
        """The target's engine for these aux layers (the draft's; built once, its cache reused)."""
        ids = tuple(int(i) for i in aux_layer_ids)
        if self._engine is None or self._engine[0] != ids:
            try:
                self._engine = ids, build_target(self.target.model, list(ids), self.max_len, batch_size=self.rows)
            except UnsupportedArchitecture as e:
                raise ConfigError(
                    f"train.smoke_every: the decode engine cannot run this target ({e}); set train.smoke_every=0"
                ) from None
        return self._engine[1]

    @torch.no_grad()
    def measure(self, draft) -> dict[str, float]:
        """{prompt id: tau}. ``draft`` is not touched: a frozen copy in the target's dtype decodes.
        The RNG state is restored after, so training draws the same numbers as without it."""
        device = self.target.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            frozen = copy.deepcopy(draft).to(device=device, dtype=self.target.input_embeddings().weight.dtype).eval()
            engine = self.engine(frozen.config.eagle_aux_hidden_state_layer_ids)
            tree = SMOKE_TREE
            if isinstance(frozen, BlockDraft):
                runner, k = (
                    BlockRunner(frozen, self.target.input_embeddings(), self.max_len, self.rows),
                    frozen.block_size - 1,
                )
                tree = (k, 1, k + 1)
            else:
                runner = DraftRunner(frozen, self.target.input_embeddings(), self.max_len, batch_size=self.rows)
            results = batch_generate(
                engine,
                [p.input_ids for p in self.prompts],
                self.max_new_tokens,
                draft=runner,
                tree=tree,
                eos_ids=self.eos,
            )
        # done at prefill: one token, one pass
        return {p.id: r.stats.tau if r.stats.verify_steps else 1.0 for p, r in zip(self.prompts, results)}

    def by_workload(self, taus: dict[str, float]) -> dict[str, float]:
        groups: dict[str, list[float]] = {}
        for p in self.prompts:
            groups.setdefault(p.workload, []).append(taus[p.id])
        return {w: statistics.fmean(v) for w, v in groups.items()}


@dataclass
class SmokeCheck:
    """One smoke bench result: per-prompt taus at a step."""

    step: int
    epoch_fraction: float  # epochs trained: step / batches per epoch
    taus: dict[str, float]  # prompt id -> tau
    by_workload: dict[str, float]
    seconds: float = 0.0

    @property
    def mean(self) -> float:
        return statistics.fmean(self.taus.values())

    @classmethod
    def from_record(cls, r: dict) -> SmokeCheck:
        return cls(r["step"], r["epoch_fraction"], r["per_prompt"], r["tau"], r.get("seconds", 0.0))


def paired_change(a: SmokeCheck, b: SmokeCheck, z: float = BAND_Z) -> tuple[float, float]:
    """(mean change of tau from ``a`` to ``b`` over their shared prompts, its noise band). With
    fewer than 2 shared prompts the band is unknown (nan): nothing is inside it."""
    d = [b.taus[k] - a.taus[k] for k in a.taus if k in b.taus]
    if len(d) < 2:
        return (statistics.fmean(d) if d else math.nan), math.nan
    return statistics.fmean(d), z * statistics.stdev(d) / math.sqrt(len(d))


class ConvergenceDetector:
    """The rule of the module docstring: ``checks`` (M) checks in a row inside the noise band of
    the check before them, that anchor taken at ``min_step`` or later (after LR warmup) and
    above the floor (FLOOR_TAU)."""

    def __init__(self, checks: int, min_step: int = 0, z: float = BAND_Z):
        self.checks, self.min_step, self.z = checks, min_step, z
        self.history: list[SmokeCheck] = []
        self.verdict: dict | None = None

    def add(self, check: SmokeCheck) -> dict | None:
        """Record a check. Returns the verdict when the run converges with this check (once)."""
        self.history.append(check)
        if self.verdict is not None or len(self.history) <= self.checks:
            return None
        anchor, later = self.history[-1 - self.checks], self.history[-self.checks :]
        changes = [paired_change(anchor, c, self.z) for c in later]
        if anchor.step < self.min_step or anchor.mean <= FLOOR_TAU or not all(abs(d) <= band for d, band in changes):
            return None
        self.verdict = {
            "converged": True,
            "step": check.step,
            "epoch_fraction": check.epoch_fraction,
            "since_step": anchor.step,
            "level": anchor.mean,
            "mean_tau": check.mean,
            "checks": self.checks,
            "max_change": max(abs(d) for d, _ in changes),
            "band": changes[-1][1],
        }
        return self.verdict

    def summary(self) -> dict:
        """The verdict, or what was seen without one."""
        return self.verdict or {"converged": False, "checks_run": len(self.history), "checks": self.checks}


def epoch_phrase(fraction: float) -> str:
    """2.667 epochs -> "67% of epoch 3". An epoch's end reads as 100% of it, not 0% of the next."""
    epoch = max(1, math.ceil(fraction - 1e-9))
    return f"{100 * (fraction - (epoch - 1)):.0f}% of epoch {epoch}"


def verdict_line(v: dict) -> str:
    return (
        f"converged at {epoch_phrase(v['epoch_fraction'])} (step {v['step']}): smoke tau "
        f"{v['mean_tau']:.2f} stayed within its noise band of step {v['since_step']}'s {v['level']:.2f} "
        f"for {v['checks']} checks (largest change {v['max_change']:.3f})"
    )


class SmokeMonitor:
    """One run's smoke bench and detector, and their records: ``write(record, line)`` (the
    run's MetricsLog.write; None where this rank does not log)."""

    def __init__(self, bench: SmokeBench, detector: ConvergenceDetector, write=None):
        self.bench, self.detector, self.write = bench, detector, write

    def replay(self, records: list[dict], upto_step: int) -> None:
        """The checks a resumed run had logged up to its checkpoint, fed to the detector again."""
        for r in records:
            if r.get("split") == "smoke" and r["step"] <= upto_step:
                self.detector.add(SmokeCheck.from_record(r))

    def check(self, draft, step: int, epoch_fraction: float, epoch: int) -> dict | None:
        """Run the smoke bench on ``draft``, log it; the verdict if the run converges here."""
        t0 = time.perf_counter()
        taus = self.bench.measure(draft)
        check = SmokeCheck(step, epoch_fraction, taus, self.bench.by_workload(taus), time.perf_counter() - t0)
        prev = self.detector.history[-1] if self.detector.history else None
        verdict = self.detector.add(check)
        if self.write is not None:
            self.write(*self._record(check, prev, epoch))
            if verdict is not None:
                self.write({"split": "convergence", "epoch": epoch, **verdict}, verdict_line(verdict))
        return verdict

    def _record(self, check: SmokeCheck, prev: SmokeCheck | None, epoch: int) -> tuple[dict, str]:
        delta, band = paired_change(prev, check, self.detector.z) if prev else (None, None)
        delta, band = (None if v is None or math.isnan(v) else v for v in (delta, band))  # JSON has no NaN
        record = {
            "split": "smoke",
            "step": check.step,
            "epoch": epoch,
            "epoch_fraction": check.epoch_fraction,
            "prompt_set": self.bench.name,
            "config": SMOKE_CONFIG,
            "mean_tau": check.mean,
            "tau": check.by_workload,
            "delta": delta,
            "band": band,
            "vs_step": prev and prev.step,
            "per_prompt": check.taus,
            "seconds": check.seconds,
        }
        workloads = " ".join(f"{w} {t:.2f}" for w, t in check.by_workload.items())
        change = f" | {delta:+.3f} ± {band:.3f} vs step {prev.step}" if band is not None else ""
        line = (
            f"smoke @ {check.step} ({epoch_phrase(check.epoch_fraction)}): tau {check.mean:.2f} "
            f"[{workloads}]{change} | {check.seconds:.1f}s"
        )
        return record, line
