"""The online trainer: the teacher stays resident and its states are recomputed per batch.

``train`` claims the run directory, builds a ``TrainRun`` (train_run.py; ``build_run``) and drives it:
its steps, validations, smoke checks and checkpoints, then ``finish``. The pieces it is built from: the LR
schedule (schedules.py), the metrics log (metrics.py), the batch pipeline (batches.py), the draft
and its memory policy (draft_setup.py), the inputs (inputs.py) and the run directory with the
resume policy (rundir.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftling.config import RunConfig, TrainConfig, save_config
from draftling.draft.block import BlockDraft
from draftling.draft.model import Eagle3Draft, draft_window
from draftling.draft.store import WEIGHTS_FILE
from draftling.dynamo import allow_recompiles
from draftling.errors import ConfigError
from draftling.target import Target
from draftling.trackers import open_trackers, tracker_names
from draftling.train.checkpoint import latest_checkpoint
from draftling.train.convergence import SmokeBench
from draftling.train.dataset import EpochBatches
from draftling.train.distributed import (
    DistContext,
    TTTObjective,
    current,
    is_sharded,
    wrap,
)
from draftling.train.draft_setup import prepare_draft, resolve_memory_policy
from draftling.train.inputs import RunInputs, load_run_inputs
from draftling.train.memory import DraftShape
from draftling.train.memory_fit import BLOCK_POLICY
from draftling.train.metrics import MetricsLog
from draftling.train.optim import build_optimizer
from draftling.train.rundir import RunDirClaim, check_run_dir, claim_run_dir, resume_config_changes
from draftling.train.schedules import CosineSchedule
from draftling.train.settings import unroll_options
from draftling.train.teacher import TeacherCache, TeacherSource
from draftling.train.train_run import TrainRun
from draftling.train.warmstart import InitDraft

log = logging.getLogger(__name__)


def build_run(
    cfg: RunConfig, target: Target, inputs: RunInputs, run_dir: Path, ckpt: Path | None, ctx: DistContext, say
) -> TrainRun:
    """The draft (with the checkpoint's weights, before wrapping: DDP broadcasts them, FSDP
    shards them), its wrapper, optimizer and schedule, with the memory policy resolved."""
    tc, device = cfg.train, target.device
    sharded = ctx.active and tc.parallel == "fsdp"
    draft, offload, param_dtype = prepare_draft(cfg, target, inputs.vocab, device, sharded, inputs.warm)
    tc, policy = run_memory_policy(tc, target, inputs, draft, ctx, param_dtype, offload)
    say(f"memory policy: {policy}")
    if ckpt is not None:
        draft.load_state_dict(load_file(str(ckpt / WEIGHTS_FILE), device=str(device)), strict=False)
        tc = resumed_compute_dtype(tc, ckpt)
    cfg = dataclasses.replace(cfg, train=tc)
    objective = wrap(draft, ctx, tc.parallel, param_dtype, offload)
    if not ctx.active:  # one process: the bare module, no data-parallel wrapper
        assert type(objective) is TTTObjective and not is_sharded(objective)
    objective.train()
    params = [p for p in objective.parameters() if p.requires_grad]
    # With offload the scheduler drives the inner torch AdamW over the host masters. Under
    # FSDP, offload is its CPUOffloadPolicy and the plain optimizer steps the host shards.
    optimizer, scheduled = build_optimizer(params, tc.lr, tc.betas, tc.weight_decay, offload and not sharded)
    batches = EpochBatches(inputs.examples, tc.batch_size, tc.seed, tc.group_by_length, tc.data_fraction)
    if tc.data_fraction < 1:
        say(
            f"data: training on {len(batches.pool)} of {len(inputs.examples)} sequences (train.data_fraction="
            f"{tc.data_fraction:g})"
        )
    total_steps = tc.max_steps or max(1, math.ceil(tc.epochs * batches.batches_per_epoch))
    schedule = CosineSchedule(tc.warmup_steps, total_steps, tc.min_lr_ratio)
    # Through a lambda: LambdaLR would save a callable object's fields in its state and a resume
    # would restore them over the config's; the fitted length is restored from meta.json instead.
    scheduler = torch.optim.lr_scheduler.LambdaLR(scheduled, lambda step: schedule(step))
    return TrainRun(
        cfg,
        target,
        ctx,
        run_dir,
        inputs,
        draft,
        objective,
        optimizer,
        scheduled,
        scheduler,
        schedule,
        batches,
        unroll_options(tc, device, param_dtype=param_dtype),
        offload,
        param_dtype,
        total_steps,
        total_steps,
        say,
        policy,
    )


def run_memory_policy(
    tc: TrainConfig,
    target: Target,
    inputs: RunInputs,
    draft: Eagle3Draft,
    ctx: DistContext,
    param_dtype: torch.dtype,
    offload: bool,
) -> tuple[TrainConfig, str]:
    """resolve_memory_policy for the built draft, this process's share of a batch and the longest
    sequence of either split. A dflash head trains as configured: its block loss has none of the
    options the policy picks (memory_fit.BLOCK_POLICY)."""
    if isinstance(draft, BlockDraft):
        return tc, BLOCK_POLICY
    longest = max((len(e.input_ids) for e in inputs.examples + inputs.val_examples), default=1)
    shape = DraftShape.from_config(draft.config, inputs.vocab.size, draft_window(draft.config))  # the built draft's
    return resolve_memory_policy(
        tc,
        target.device,
        shape,
        -(-tc.batch_size // ctx.world_size),
        longest,
        param_dtype,
        offload,
        target.input_embeddings().weight.dtype,
    )


def resumed_compute_dtype(tc: TrainConfig, ckpt: Path) -> TrainConfig:
    """``tc`` with the train.compute_dtype the checkpoint recorded (settings.recorded_compute_dtype):
    a timed probe (bfloat16_if_fast) could decide otherwise on a busy machine, so keep the run's."""
    resolved = json.loads((ckpt / "meta.json").read_text()).get("compute_dtype")
    return dataclasses.replace(tc, compute_dtype=resolved) if resolved else tc


def train(
    cfg: RunConfig,
    target: Target,
    run_dir: str | Path,
    train_path: str | Path,
    val_path: str | Path | None,
    vocab_path: str | Path,
    teacher_source: TeacherSource | None = None,
    init: InitDraft | None = None,
    **claim,
) -> dict:
    """``teacher_source``: a TeacherSource (e.g. an offline_teacher.OfflineTeacher) used instead of running
    the teacher; its ``for_split("val", hash)``, when not None, serves validation. ``claim``:
    RunDirClaim's fields (resume, overwrite, allow_change). ``init``: the head to start from
    (``train --init-from``, loaded by the caller in whatever format it came; see warmstart.py).

    Under torchrun (``distributed.init_distributed`` called first) every rank runs this
    with its own resident teacher and its share of each global batch; rank 0 writes."""
    ctx, run_dir, tc = current(), Path(run_dir), cfg.train
    claim = RunDirClaim(**claim)
    resume = claim.resume
    check_run_dir(run_dir, resume, claim.overwrite)
    torch.manual_seed(tc.seed)
    torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 draft trains against a bf16 teacher
    allow_recompiles()  # batches of many lengths: flex and the loss chunks must stay compiled
    _check_batch_and_init(cfg, ctx, init)
    say = log.info  # info lines: rank 0 only, by logs.RankZeroFilter (warnings come from every rank)
    trackers = tracker_names(tc.trackers)  # an unknown or uninstalled one fails before any work
    inputs = load_run_inputs(target, train_path, val_path, vocab_path, teacher_source, say, init)
    smoke_bench = SmokeBench.load(tc, target) if tc.smoke_every else None  # a bad set fails here
    claim_run_dir(run_dir, resume, claim.overwrite, ctx)
    changes = resume_config_changes(run_dir, cfg, claim.allow_change) if resume else {}
    if ctx.is_main:
        save_config(cfg, run_dir / "config.yaml")
    ckpt = latest_checkpoint(run_dir, warn=say) if resume else None
    if resume and ckpt is None:
        log.warning("--resume: no checkpoint in %s, starting from scratch", run_dir)
    run = build_run(cfg, target, inputs, run_dir, ckpt, ctx, say)
    if ckpt is not None:
        run.restore(ckpt, changes)
    run.metrics_log = _open_metrics_log(run, cfg, run_dir, trackers, ckpt is not None, changes)
    run.smoke = run.start_smoke(smoke_bench, ckpt is not None)
    run.describe()
    run.cache = TeacherCache(int(tc.teacher_cache_gb * 2**30)) if tc.teacher_cache_gb > 0 else None
    return run.finish(run.loop())


def _check_batch_and_init(cfg: RunConfig, ctx: DistContext, init: InitDraft | None) -> None:
    """Refuse a global batch smaller than the world, and draft.init_from without its loaded head."""
    tc = cfg.train
    if tc.batch_size < ctx.world_size:
        raise ConfigError(
            f"train.batch_size={tc.batch_size} is the global batch; it must be at least "
            f"the world size ({ctx.world_size})"
        )
    if cfg.draft.init_from and init is None:
        raise ConfigError(
            f"draft.init_from={cfg.draft.init_from}: load that draft and pass it as init= (the `train` command does)"
        )


def _open_metrics_log(
    run: TrainRun, cfg: RunConfig, run_dir: Path, trackers, resumed: bool, changes: dict
) -> MetricsLog | None:
    """Rank 0's metrics log (continued at the checkpoint's step on a resume; the trackers get
    ``cfg`` as given to ``train``), with the config changes a resume allowed as its first record."""
    if not run.ctx.is_main:
        return None
    metrics_log = MetricsLog(
        run_dir / "metrics.jsonl",
        run.step if resumed else None,
        open_trackers(trackers, str(run_dir), dataclasses.asdict(cfg)),
    )
    if changes and resumed:
        metrics_log.write(
            {
                "step": run.step,
                "split": "config_change",
                "changes": {k: {"from": a, "to": b} for k, (a, b) in changes.items()},
            }
        )
    return metrics_log
