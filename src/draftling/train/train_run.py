"""A training run's live state (``TrainRun``): its steps, validations, smoke checks and
checkpoints, then ``finish``. train/trainer.py builds it (``build_run``) and drives it."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from draftling.config import RunConfig
from draftling.draft.model import Eagle3Draft
from draftling.draft.store import save_draft
from draftling.faults import fault_point
from draftling.io import atomic_dir, read_metrics, write_json
from draftling.progress import Progress
from draftling.target import Target
from draftling.train.batches import BatchSource, evaluate, train_step
from draftling.train.checkpoint import KeepPolicy, load_train_state, save_checkpoint, set_rng_state
from draftling.train.convergence import ConvergenceDetector, SmokeBench, SmokeMonitor, verdict_line
from draftling.train.dataset import EpochBatches
from draftling.train.distributed import (
    DistContext,
    any_rank,
    barrier,
    full_optimizer_state,
    load_optimizer_state,
)
from draftling.train.draft_setup import host_draft, param_counts, params_line
from draftling.train.inputs import RunInputs
from draftling.train.metrics import MetricsLog, StepWindow, format_line
from draftling.train.schedules import CosineSchedule, FitToTime
from draftling.train.settings import compile_teacher, pad_multiple, recorded_compute_dtype
from draftling.train.teacher import TeacherCache
from draftling.train.ttt import UnrollOptions


@dataclasses.dataclass
class TrainRun:
    """One run's live state. Set up by ``build_run`` (and ``restore`` on a resume), then driven by
    ``loop``: ``train_step`` per step, ``validate``, the smoke checks (``start_smoke``,
    ``smoke_check``, ``pace_smoke``) and ``checkpoint`` on the way; ``finish`` writes the head
    and train_result.json."""

    cfg: RunConfig
    target: Target
    ctx: DistContext
    run_dir: Path
    inputs: RunInputs
    draft: Eagle3Draft
    objective: torch.nn.Module
    optimizer: object
    scheduled: object  # the optimizer the scheduler drives (the inner AdamW under offload)
    scheduler: object
    schedule: CosineSchedule
    batches: EpochBatches
    unroll: UnrollOptions  # as resolved for training (a batch resolves its own: see unroll_batch)
    offload: bool
    param_dtype: torch.dtype
    total_steps: int
    ceiling: int
    say: object
    memory_policy: str = "as configured"  # resolve_memory_policy's reason
    step: int = 0
    cache: TeacherCache | None = None
    metrics_log: MetricsLog | None = None
    smoke: SmokeMonitor | None = None  # train.smoke_every: the smoke bench and convergence detector
    progress: Progress | None = None  # the loop's bar and its elapsed / time-left meter
    smoke_every: int = 0  # steps between smoke checks: train.smoke_every, or fewer checks (pace_smoke)
    smoke_seconds: float = 0.0  # this segment's time in smoke checks
    smoke_checks: int = 0  # this segment's smoke checks so far
    stop_reason: str = "completed"  # or "max_minutes", "converged"
    # Segments: each process (the start, each resume) is one. Train records carry the step it
    # started from and the seconds since, which `draftling report` times segments by.
    segment_step: int = 0
    segment_start: float = 0.0  # perf_counter at the segment's first step

    @property
    def source(self) -> BatchSource:
        """Where the training batches come from."""
        return BatchSource(
            self.cfg, self.target, self.inputs.examples, self.target.device, self.ctx, self.inputs.teacher, self.cache
        )

    def train_step(self, keys: list[int] | None = None, phase_end=None) -> tuple:
        """One optimizer step (see ``train_step``) on the global batch ``keys`` of the run's
        examples, by default the schedule's next one: (loss, counts, tokens)."""
        if keys is None:
            keys = self.batches.indices(*self.batches.position(self.step))
        out = train_step(self.objective, self.optimizer, self.scheduler, self.source, keys, phase_end)
        self.step += 1
        return out

    def validate(self, prefix: str, final: bool = False) -> dict:
        tc = self.cfg.train
        vm = evaluate(
            self.objective,
            self.target,
            self.inputs.val_examples,
            self.cfg,
            self.target.device,
            tc.max_val_batches,
            self.inputs.val_teacher,
            self.ctx,
        )
        vm.update(step=self.step, split="val", **({"final": True} if final else {}))
        if self.metrics_log:
            self.metrics_log.write(vm, format_line(prefix, vm))
        return vm

    def stop(self, reason: str) -> None:
        """End the run after this step (its checkpoint, head and result are still written)."""
        self.total_steps, self.stop_reason = self.step, reason

    def checkpoint(self) -> None:
        tc = self.cfg.train
        weights = host_draft(self.objective, self.draft.config)
        opt_state = full_optimizer_state(self.objective, self.optimizer)
        if self.ctx.is_main:
            save_checkpoint(
                self.run_dir,
                weights,
                opt_state,
                self.scheduler,
                self.step,
                self.batches.position(self.step),
                KeepPolicy(tc.keep_checkpoints, tc.ckpt_every_epoch, tc.keep_every_steps),
                {"total_steps": self.total_steps, "compute_dtype": recorded_compute_dtype(self.unroll)},
            )
        barrier(self.ctx)

    def restore(self, ckpt: Path, changes: dict) -> None:
        """The optimizer, scheduler, RNG and step of ``ckpt``; a ``train.lr`` change applied."""
        tc, state = self.cfg.train, load_train_state(ckpt)
        opt_state = dict(state["optimizer"])
        if not self.offload or (self.ctx.active and tc.parallel == "fsdp"):  # an offloaded run's also has fp32 masters
            opt_state.pop("master_params", None)
        load_optimizer_state(self.objective, self.optimizer, opt_state)
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        if tc.fit_schedule:  # the schedule as the interrupted run had fitted it
            self.total_steps = self.schedule.total = json.loads((ckpt / "meta.json").read_text()).get(
                "total_steps", self.total_steps
            )
        if "train.lr" in changes:  # the scheduler's state holds the old base lr
            self.scheduler.base_lrs = [tc.lr] * len(self.scheduler.base_lrs)
            for group in self.scheduled.param_groups:
                group["initial_lr"], group["lr"] = tc.lr, tc.lr * self.schedule(self.step)
        self.say(
            f"resumed from {ckpt} at step {self.step}"
            + (f", with {', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in changes.items())}" if changes else "")
        )

    def describe(self) -> None:
        tc, ctx, inputs = self.cfg.train, self.ctx, self.inputs
        parallel = (
            f", {ctx.world_size} ranks ({tc.parallel}), {tc.batch_size // ctx.world_size}+ sequences per rank"
            if ctx.active
            else ""
        )
        m = self.unroll
        self.say(
            f"training draft: {params_line(param_counts(self.draft, self.target))}, {len(inputs.examples)} train / "
            f"{len(inputs.val_examples)} val sequences, {self.total_steps} steps of {tc.batch_size}, "
            f"TTT {tc.ttt_steps}, device {self.target.device}{parallel}"
        )
        self.say(
            f"memory: loss_chunk_tokens {m.loss_chunk_tokens}, grad_checkpoint {m.grad_checkpoint}, "
            f"attention {m.attention}, optimizer_offload {self.offload}, draft_dtype "
            f"{str(self.param_dtype).replace('torch.', '')}, embedding_on_host {tc.embedding_on_host}, compile "
            f"{m.compile} (layer {m.compile_layer}, teacher "
            f"{compile_teacher(tc, self.target.device, self.target.model)}), autocast {m.autocast or 'off'}, "
            f"pad_to_multiple {pad_multiple(tc, m.attention)}"
        )

    def loop(self) -> float:
        """Steps to ``self.total_steps``, logging, validating and checkpointing on the way. Returns
        the loop's start time."""
        tc, ctx, device = self.cfg.train, self.ctx, self.target.device
        # Steps are its units; its lines are the log lines (StepWindow.log appends its timing).
        progress = self.progress = Progress(self.total_steps, "train", enabled=ctx.is_main, initial=self.step)
        window = StepWindow(tc.ttt_steps, device)
        t_start = self.segment_start = time.perf_counter()
        self.segment_step = self.step
        fit = FitToTime(tc, self.total_steps, t_start, self.step, ctx, device) if tc.fit_schedule else None
        while self.step < self.total_steps:
            loss, counts, tokens = self.train_step()
            fault_point("train.step")
            if fit is not None and fit.due(self.step, self.batches.position(self.step)[1] == 0):
                self.total_steps = self.schedule.total = fit.refit(self.step)
                progress.set_total(self.total_steps)
            window.add(counts, loss, tokens)  # stays on the device until the log line
            progress.update(1)
            if self.step % tc.log_every == 0 or self.step == self.total_steps:
                window.log(self)
            if tc.val_every and self.step % tc.val_every == 0 and self.inputs.val_examples:
                self.validate(f"val @ {self.step}")
            if self.smoke is not None and self.step % self.smoke_every == 0:
                seconds = self.smoke_check()
                window.t0 += seconds  # the smoke bench's time is not training throughput
                self.pace_smoke(seconds)
            out_of_time = tc.max_minutes > 0 and time.perf_counter() - t_start > 60 * tc.max_minutes
            if tc.max_minutes > 0 and any_rank(out_of_time, ctx, device) and self.step < self.total_steps:
                self.say(f"stopping at step {self.step}/{self.total_steps}: train.max_minutes={tc.max_minutes} reached")
                self.stop("max_minutes")
            epoch_end = tc.ckpt_every_epoch and self.batches.position(self.step)[1] == 0
            if self.step % tc.ckpt_every == 0 or self.step == self.total_steps or epoch_end:
                self.checkpoint()
        progress.close()
        return t_start

    def start_smoke(self, bench: SmokeBench | None, resumed: bool) -> SmokeMonitor | None:
        """The run's smoke monitor (train.smoke_every), None when off. A resumed run replays the
        checks metrics.jsonl holds up to its checkpoint, so it decides as the uninterrupted run
        would; one that had converged there with train.stop_on_convergence stops at once."""
        if bench is None:
            return None
        tc = self.cfg.train
        self.smoke_every = tc.smoke_every
        monitor = SmokeMonitor(
            bench,
            ConvergenceDetector(tc.convergence_checks, tc.warmup_steps),
            self.metrics_log.write if self.metrics_log else None,
        )
        log = self.run_dir / "metrics.jsonl"
        if resumed and log.is_file():
            records = read_metrics(log)
            monitor.replay(records, self.step)
            for r in records:  # the interval the interrupted run had come to, so it checks at the same steps
                if r.get("split") == "smoke_interval" and r["step"] <= self.step:
                    self.smoke_every = r["every"]
        verdict = monitor.detector.verdict
        if verdict and tc.stop_on_convergence and self.step < self.total_steps:
            self.say(f"{verdict_line(verdict)}, before this resume: stopping at step {self.step}")
            self.stop("converged")
        return monitor

    def smoke_check(self) -> float:
        """The smoke bench at this step, on every rank (the same weights give the same verdict); with
        train.stop_on_convergence a convergence ends the run here. Returns the seconds it took."""
        t0 = time.perf_counter()
        verdict = self.smoke.check(
            host_draft(self.objective, self.draft.config),
            self.step,
            self.step / self.batches.batches_per_epoch,
            self.batches.position(self.step - 1)[0],
        )
        converged = any_rank(verdict is not None, self.ctx, self.target.device)
        if converged and self.cfg.train.stop_on_convergence and self.step < self.total_steps:
            self.say(
                f"stopping at step {self.step}/{self.total_steps}: the smoke tau converged (train.stop_on_convergence)"
            )
            self.stop("converged")
        return time.perf_counter() - t0

    def pace_smoke(self, seconds: float) -> None:
        """train.smoke_max_share: where a check of ``seconds`` costs more than that share of the
        training time between checks, check every multiple of train.smoke_every that keeps within it
        (the slowest rank's numbers, so every rank checks at the same steps), and log the numbers.
        A segment's first check is not judged: it also pays one-off costs (compiling and capturing
        the decode) that later checks do not."""
        tc = self.cfg.train
        self.smoke_seconds += seconds
        self.smoke_checks += 1
        steps = self.step - self.segment_step
        train_s = time.perf_counter() - self.segment_start - self.smoke_seconds
        if tc.smoke_max_share <= 0 or steps <= 0 or train_s <= 0 or self.smoke_checks == 1:
            return
        step_s, cap = train_s / steps, tc.smoke_max_share
        need = seconds * (1 - cap) / (cap * step_s)  # steps between checks for c / (c + N s) <= cap
        every = max(self.smoke_every, tc.smoke_every * math.ceil(need / tc.smoke_every))
        if self.ctx.active:
            t = torch.tensor([every], dtype=torch.int64, device=self.target.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            every = int(t.item())
        if every == self.smoke_every:
            return
        share = seconds / (seconds + self.smoke_every * step_s)
        self.say(
            f"smoke bench: a check took {seconds:.1f} s against {step_s:.3f} s a training step, {share:.0%} of the "
            f"time at every {self.smoke_every} steps, over train.smoke_max_share={tc.smoke_max_share:g}: checking "
            f"every {every} steps from here"
        )
        if self.metrics_log:
            self.metrics_log.write(
                {
                    "split": "smoke_interval",
                    "step": self.step,
                    "every": every,
                    "check_s": seconds,
                    "step_s": step_s,
                    "share": share,
                    "max_share": tc.smoke_max_share,
                }
            )
        self.smoke_every = every

    def data_used(self) -> dict:
        """The training sequences this run drew from (train.data_fraction) and their loss tokens."""
        pool = self.batches.pool
        return {
            "fraction": self.cfg.train.data_fraction,
            "sequences": len(pool),
            "loss_tokens": sum(sum(self.inputs.examples[i].loss_mask) for i in pool),
        }

    def finish(self, t_start: float) -> dict:
        """The final validation, the head in ``<run>/draft`` and ``train_result.json``."""
        ctx, device = self.ctx, self.target.device
        # train_wall_s is this segment's: a resumed run started at segment_from_step (the earlier
        # segments' times are in metrics.jsonl; `draftling report` lists them).
        result = {
            "steps": self.total_steps,
            "steps_ceiling": self.ceiling,
            "train_wall_s": time.perf_counter() - t_start,
            "segment_from_step": self.segment_step,
            "stop_reason": self.stop_reason,
            "world_size": ctx.world_size,
            "data": self.data_used(),
            "compute_dtype": recorded_compute_dtype(self.unroll, self.param_dtype),
            "params": param_counts(self.draft, self.target),
        }
        if self.smoke is not None:
            result["convergence"] = self.smoke.detector.summary()
        if torch.cuda.is_available() and device.type == "cuda":
            result["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if self.inputs.val_examples:
            result["val"] = self.validate("validation", final=True)
        final = host_draft(self.objective, self.draft.config)
        if ctx.is_main:
            self.metrics_log.close()
            with atomic_dir(self.run_dir / "draft") as tmp:
                save_draft(final, tmp)
                fault_point("draft.written")
            write_json(self.run_dir / "train_result.json", result)
        barrier(ctx)
        return result
