"""The online trainer: the teacher stays resident and its states are recomputed per batch."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import weakref
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file

from draftling.config import RunConfig, TrainConfig, save_config
from draftling.data.runs import check_one_run
from draftling.data.states import StoredStates, states_path
from draftling.data.tokenized import load_tokenized
from draftling.draft.model import Eagle3Draft, draft_config_from_target, draft_window, init_from_target
from draftling.train.warmstart import InitDraft, WarmStart, keep_window, warm_start
from draftling.draft.store import WEIGHTS_FILE, save_draft
from draftling.draft.vocab import hash_dataset_file, load_vocab
from draftling.dynamo import allow_recompiles
from draftling.errors import ConfigError
from draftling.faults import fault_point
from draftling.io import atomic_dir, atomic_path, read_metrics, remove_path, write_json
from draftling.progress import Progress
from draftling.target import Target
from draftling.train.checkpoint import (KeepPolicy, latest_checkpoint, load_train_state, remove_stale_temporaries, save_checkpoint,
                                        set_rng_state)
from draftling.train.convergence import ConvergenceDetector, SmokeBench, SmokeMonitor, verdict_line
from draftling.train.dataset import EpochBatches, collate, to_device
from draftling.train.distributed import (DistContext, TTTObjective, all_reduce_sum, any_rank,
                                         barrier, current, full_model_state, full_optimizer_state, is_sharded,
                                         load_optimizer_state, rank_share, unwrap, wrap)
from draftling.train.host_embed import HostEmbedding
from draftling.train.optim import build_optimizer
from draftling.train.teacher import KeptStatesTeacher, TeacherBatch, TeacherCache, TeacherSource, teacher_forward
from draftling.train.settings import (FAST_MEMORY_SHARE, compile_teacher, draft_param_dtype, fast_train_config,
                                      memory_options, optimizer_offload, pad_multiple, unroll_options)
from draftling.train.ttt import StepCounts, UnrollOptions, step_row_bounds, step_valid_counts

log = logging.getLogger(__name__)


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
    that fit into ``seconds_left`` at ``step_s`` each, at least one more and at most ``cap``."""
    return max(step + 1, min(cap, step + int(seconds_left / max(step_s, 1e-9))))


class MetricsLog:
    """JSONL metrics plus a plain progress line on stdout (works without a TTY), and
    TensorBoard when it is installed. Every record is flushed as it is written."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.exists():
            # Drop records the interrupted run wrote after the checkpoint we resume from.
            # The final validation comes after the last checkpoint: a resume writes it again.
            kept = [json.dumps(r) for r in read_metrics(path) if r.get("step", 0) <= resume_step and not r.get("final")]
            with atomic_path(path) as tmp:
                tmp.write_text("".join(l + "\n" for l in kept))
        elif path.exists():
            path.unlink()
        self.file = open(path, "a")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(path.parent / "tensorboard"))
        except ImportError:
            pass

    def write(self, record: dict, line: str | None = None) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            prefix = record.get("split", "train")
            for key in ("loss", "sim_tau", "chain_tau", "lr", "tok_s", "mean_tau"):
                if key in record:
                    self.tb.add_scalar(f"{prefix}/{key}", record[key], record["step"])
            for j, a in enumerate(record.get("acc", [])):
                self.tb.add_scalar(f"{prefix}/acc_step{j}", a, record["step"])
        if line:
            print(line, flush=True)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def format_line(prefix: str, m: dict) -> str:
    acc = " ".join(f"{a:.2f}" for a in m["acc"])
    cond = " ".join(f"{a:.2f}" for a in m["cond_acc"])
    vocab = f" | vocab {m['vocab_coverage']:.2f}" if "vocab_coverage" in m else ""
    chain = f" | chain_tau {m['chain_tau']:.2f}" if "chain_tau" in m else ""
    return f"{prefix} loss {m['loss']:.3f} | acc {acc} | cond {cond} | sim_tau {m['sim_tau']:.2f}{chain}{vocab}"


def build_draft(cfg: RunConfig, target: Target, vocab, warm: WarmStart | None = None) -> Eagle3Draft:
    if warm is not None:  # --init-from: the head's working copy, its maps already set
        keep_window(warm.draft, cfg.draft.window, warm.report["init_from"])
        return warm.draft
    overrides = {}
    if cfg.draft.intermediate_size is not None:
        if cfg.draft.intermediate_size < 1:
            raise ConfigError(f"draft.intermediate_size={cfg.draft.intermediate_size}: expected a positive "
                              "width or null (the target's)")
        overrides["intermediate_size"] = cfg.draft.intermediate_size
    config = draft_config_from_target(target.config, vocab.size, target.aux_layer_ids, cfg.draft.window, **overrides)
    draft = Eagle3Draft(config)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    if cfg.draft.init_from_target:
        init_from_target(draft, target.model, vocab.t2d)
    return draft


def resolve_memory_policy(tc: TrainConfig, device, shape, batch: int, seq: int, param_dtype: torch.dtype,
                          offload: bool, embed_dtype) -> tuple[TrainConfig, str]:
    """The TrainConfig to train with, and why. ``shape``: the draft's (a plan.DraftShape);
    ``batch``: sequences per process and step; ``seq``: the longest sequence; ``embed_dtype``:
    the target's (a dtype or its name)."""
    from draftling.train.plan import MemoryOptions, estimate_train_memory

    device = torch.device(device)
    if tc.memory_policy == "config" or device.type != "cuda":
        return tc, "as configured"
    fast = fast_train_config(tc)
    mem = memory_options(fast, device, param_dtype=param_dtype)
    options = MemoryOptions.from_unroll_options(mem, optimizer_offload=offload, draft_dtype=param_dtype,
                                                embed_dtype=embed_dtype, embedding_on_host=tc.embedding_on_host)
    multiple = pad_multiple(fast, mem["attention"])  # batches are padded up to it
    need = estimate_train_memory(shape, batch, -(-seq // multiple) * multiple, tc.ttt_steps, options)["total"]
    free = torch.cuda.mem_get_info(device)[0]
    gib = 2 ** 30
    if need <= FAST_MEMORY_SHARE * free:
        return fast, (f"fast: estimated draft peak {need / gib:.1f} GiB of {free / gib:.1f} GiB free, so no "
                      f"recompute and loss chunks of {fast.loss_chunk_tokens}")
    return tc, (f"as configured: the fast settings would need ~{need / gib:.1f} GiB, over "
                f"{FAST_MEMORY_SHARE:.0%} of the {free / gib:.1f} GiB free")


def place_draft(draft: Eagle3Draft, device, dtype: torch.dtype) -> Eagle3Draft:
    """Cast the draft's weights (on the host, so the device never holds an fp32 copy of a
    bf16 draft) and move it to the device; the rotary table stays fp32."""
    for module in (draft.fc, draft.midlayer, draft.norm, draft.lm_head):
        module.to(dtype)
    return draft.to(device)


def prepare_draft(cfg: RunConfig, target: Target, vocab, device, sharded: bool = False,
                  warm: WarmStart | None = None):
    """Build the draft and place it on the device as training needs it. Returns
    (draft, optimizer offload on?, the draft's compute dtype).

    Build order: the teacher (the target) is already loaded and resident. The draft is built
    on the CPU (random init, vocab maps, optional warm start from the target's head) and moved
    to the device once, after the teacher, so none of its build-time temporaries touch device
    memory. train.build_on_host=false moves it as built instead (same weights: the init runs
    on the host RNG either way)."""
    tc = cfg.train
    with torch.device("cpu"):
        draft = build_draft(cfg, target, vocab, warm)
    if not tc.build_on_host:
        draft = draft.to(device)
    n_params = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    offload = optimizer_offload(tc, device, n_params)
    param_dtype = draft_param_dtype(tc, device, n_params)
    # FSDP keeps fp32 shards and casts for compute itself (its mixed-precision policy).
    place_draft(draft, device, torch.float32 if sharded else param_dtype)
    return draft, offload, param_dtype


_HOST_EMBEDDINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def draft_embedding(cfg: RunConfig, target: Target, device):
    """What ``ttt_unroll`` embeds tokens with: the target's embedding module, or with
    ``train.embedding_on_host`` a HostEmbedding over it (built once per module and device)."""
    module = target.input_embeddings()
    if not cfg.train.embedding_on_host:
        return module
    host = _HOST_EMBEDDINGS.get(module)
    if host is None or host.device != torch.device(device):
        host = HostEmbedding.from_module(module, device)
        _HOST_EMBEDDINGS[module] = host
    return host


def read_counts(counts: StepCounts, extras: list, ctx: DistContext) -> tuple[StepCounts, list[float]]:
    """``counts`` and ``extras`` (device scalars or host numbers) summed over ranks and read to
    the host: one collective and one read, once per log line (every rank calls it there)."""
    steps, device = counts.steps, counts.sums.device
    tail = [torch.as_tensor(x, dtype=torch.float64, device=device).reshape(1)
            for x in (counts.walk_rounds, counts.walk_accepted, *extras)]
    values = all_reduce_sum(torch.cat([counts.sums.flatten(), *tail]), ctx).tolist()
    n = len(StepCounts.FIELDS) * steps
    out = StepCounts(steps, torch.tensor(values[:n], dtype=torch.float64).view(-1, steps),
                     walk_rounds=int(round(values[n])), walk_accepted=int(round(values[n + 1])))
    return out, values[n + 2:]


def kept_states_teacher(target: Target, jsonl_path, t2d, say) -> KeptStatesTeacher | None:
    """The teacher for the rows of ``jsonl_path`` from the states kept beside it at
    regeneration, when they match it (else None: the target runs as usual)."""
    path = states_path(Path(jsonl_path).parent, Path(jsonl_path).stem)
    if not path.is_file():
        return None
    states = StoredStates(path)
    why_not = states.matches(jsonl_path, target.aux_layer_ids)
    if why_not:
        say(f"teacher: not using {path.name} ({why_not}); the target recomputes its states")
        return None
    say(f"teacher: states kept at regeneration ({path.name}); only the output head runs")
    return KeptStatesTeacher(target, states, t2d)


@dataclasses.dataclass
class BatchSource:
    """Where a global batch's inputs come from: the examples its keys index, the target (its
    tokenizer pads them; it is the teacher unless ``teacher`` is set), the device, the ranks
    that share each batch and the teacher cache."""

    cfg: RunConfig
    target: Target
    examples: list
    device: torch.device
    ctx: DistContext = DistContext()
    teacher: TeacherSource | None = None  # None: the target runs
    cache: TeacherCache | None = None
    # Fixed unroll options (the training bench runs the options it estimates); None: resolved
    # per batch for the draft's params, as a run does.
    unroll: UnrollOptions | None = None


@dataclasses.dataclass
class RankBatch:
    """This rank's share of a global batch on the device, and the teacher's outputs for it."""

    tensors: dict  # input_ids, loss_mask, attention_mask
    teacher: TeacherBatch
    stand_in: bool  # a stand-in share (see rank_share): its loss mask is zero
    tokens: int = 0  # its real tokens (none for a stand-in), counted on the host
    row_bounds: list[int] | None = None  # ttt.step_row_bounds of its masks, counted on the host


def batch_multiple(source: BatchSource) -> int:
    """What a batch's length is padded up to a multiple of (settings.pad_multiple)."""
    tc = source.cfg.train
    attention = (source.unroll.attention if source.unroll is not None
                 else memory_options(tc, source.device, torch.is_grad_enabled())["attention"])
    return pad_multiple(tc, attention)


def host_batch(source: BatchSource, chunk: list, stand_in: bool) -> tuple[dict, list[int]]:
    """A share collated on the host (padded, its loss mask final) and its step_row_bounds: all
    from the examples' lists, so counting them reads nothing from the device."""
    batch = collate(chunk, source.target.tokenizer.pad_token_id, batch_multiple(source))
    if stand_in:
        batch["loss_mask"].zero_()
    elif source.cfg.train.loss_on_prompt and torch.is_grad_enabled():
        # Every real position has a teacher label; validation keeps the assistant-only mask.
        batch["loss_mask"] = batch["attention_mask"].clone()
    return batch, step_row_bounds(batch["loss_mask"], batch["attention_mask"], source.cfg.train.ttt_steps)


def load_batch(source: BatchSource, keys: list[int], t2d: torch.Tensor) -> RankBatch:
    """This rank's share of the global batch ``keys``, collated on the device, with its teacher
    outputs (from the cache, the teacher source, or a forward of the target)."""
    share, stand_in = rank_share(keys, source.ctx)
    chunk = [source.examples[k] for k in share]
    lengths = [len(e.input_ids) for e in chunk]
    host, bounds = host_batch(source, chunk, stand_in)
    batch = {k: to_device(v, source.device) for k, v in host.items()}
    return RankBatch(batch, teacher_outputs(source, share, lengths, batch, t2d), stand_in,
                     0 if stand_in else sum(lengths), bounds)


def teacher_outputs(source: BatchSource, share: list[int], lengths: list[int], batch: dict,
                    t2d: torch.Tensor) -> TeacherBatch:
    """The teacher's outputs for this rank's ``share`` of a batch, collated (and padded) as
    ``batch``: the target runs on the padded batch; stored outputs are padded after."""
    cache, device, teacher_source = source.cache, source.device, source.teacher
    # An offline cache already holds the final outputs; kept states still need the head.
    if cache and teacher_source is not None and not teacher_source.cacheable:
        cache = None
    teacher = cache.get(share, lengths, device) if cache else None
    if teacher is None:
        if teacher_source is not None:
            teacher = teacher_source.get(share, lengths, device)
        else:
            target = source.target
            teacher = teacher_forward(target, batch["input_ids"], batch["attention_mask"], t2d,
                                      compile=compile_teacher(source.cfg.train, device, target.model))
        if cache:
            teacher = cache.put(share, lengths, teacher)
    return teacher.padded(batch["input_ids"].shape[1])


def unroll_batch(objective, source: BatchSource, batch: RankBatch):
    """The TTT unroll over a loaded batch. Returns (loss, counts, tokens) of this rank's share;
    the loss is normalized over the whole global batch, so gradients averaged over ranks are
    the single-process gradients."""
    tc, device, ctx, b = source.cfg.train, source.device, source.ctx, batch.tensors
    draft = unwrap(objective)
    denominators = None
    if ctx.active:  # on the device: the unroll divides by them there
        valid = step_valid_counts(b["loss_mask"], b["attention_mask"], batch.teacher.in_draft,
                                  tc.ttt_steps).to(torch.float64)
        denominators = all_reduce_sum(valid, ctx) / ctx.world_size
    options = source.unroll or unroll_options(tc, device, torch.is_grad_enabled(), next(draft.parameters()).dtype)
    loss, counts = objective(draft_embedding(source.cfg, source.target, device), batch.teacher, b["input_ids"],
                             b["loss_mask"], b["attention_mask"], options, denominators, batch.row_bounds)
    return loss, counts, batch.tokens


def run_batch(objective, source: BatchSource, keys: list[int]):
    """This rank's share of one global batch through the teacher and the TTT unroll:
    ``unroll_batch``'s (loss, counts, tokens)."""
    return unroll_batch(objective, source, load_batch(source, keys, unwrap(objective).t2d))


@torch.no_grad()
def evaluate(objective, target: Target, examples, cfg: RunConfig, device, max_batches: int,
             teacher_source: TeacherSource | None = None, ctx: DistContext | None = None) -> dict:
    """Validation metrics over the first ``max_batches`` batches, exact over any world size.
    ``objective`` is what ``distributed.wrap`` returns, or a bare draft."""
    ctx = ctx or current()
    if isinstance(objective, Eagle3Draft):
        objective = TTTObjective(objective)
    objective.eval()
    counts = StepCounts(cfg.train.ttt_steps, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    n = 0
    bs = cfg.train.batch_size
    source = BatchSource(cfg, target, examples, device, ctx, teacher_source)
    for i in range(0, min(len(examples), max_batches * bs), bs):
        keys = list(range(i, min(i + bs, len(examples))))
        l, c, _ = run_batch(objective, source, keys)
        counts.add(c)
        loss = loss + l.double()
        n += 1
    counts, (loss,) = read_counts(counts, [loss], ctx)
    if hasattr(objective, "reshard"):  # FSDP: a forward without backward leaves params gathered
        objective.reshard()
    objective.train()
    m = counts.metrics()
    m["loss"] = loss / ctx.world_size / max(n, 1)
    return m


def train_step(objective, optimizer, scheduler, source: BatchSource, keys: list[int], phase_end=None):
    """One optimizer step on the global batch ``keys`` (this rank's share of it): teacher
    outputs, TTT unroll, backward, clip, optimizer and LR scheduler. Returns unroll_batch's
    (loss, counts, tokens). ``phase_end(phase)`` is called as each phase ends: "teacher",
    "forward", "backward", "optimizer" (the training bench syncs and times them there)."""
    end = phase_end or (lambda phase: None)
    batch = load_batch(source, keys, unwrap(objective).t2d)
    end("teacher")
    loss, counts, tokens = unroll_batch(objective, source, batch)
    end("forward")
    loss.backward()
    end("backward")
    params = [p for p in objective.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, source.cfg.train.grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    end("optimizer")
    return loss, counts, tokens


class FitToTime:
    """``train.fit_schedule``: fit the LR schedule's length to ``train.max_minutes`` from the
    step time measured on this machine, so the decay ends inside the budget instead of being
    cut off. Refitted after the first steps and at each epoch start (later epochs read the
    teacher cache and run faster than the first), from the steps since the last fit."""

    FIRST_FIT = 10

    def __init__(self, tc: TrainConfig, cap: int, t_start: float, step: int, ctx: DistContext, device,
                 clock=time.perf_counter):
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


class _RandomStates:
    """A teacher source of random aux and final states: what kept states cost (the target's
    output head only), for timing."""

    cacheable = False

    def __init__(self, target: Target, t2d: torch.Tensor):
        self.target, self.t2d = target, t2d

    def for_split(self, split: str, data_hash: str | None = None) -> TeacherSource | None:
        return None

    def get(self, keys: list[int], lengths: list[int], device) -> "TeacherBatch":
        from draftling.train.teacher import head_outputs

        h, dtype = self.target.config.hidden_size, self.target.input_embeddings().weight.dtype
        shape = (len(keys), max(lengths))
        aux = torch.randn(*shape, h * len(self.target.aux_layer_ids), device=device, dtype=dtype)
        return head_outputs(self.target, aux, torch.randn(*shape, h, device=device, dtype=dtype), self.t2d)


def measure_step_seconds(cfg: RunConfig, target: Target, seq_len: int, repeats: int = 3) -> float:
    """Seconds of one training step on this machine: ``train.batch_size`` random sequences of
    ``seq_len`` tokens through a fresh draft of the configured shape and dtypes. The teacher is
    what the run will use: with data.keep_teacher_states only the output head runs, otherwise
    the whole target. One warm-up step is not counted, and the fastest of ``repeats`` steps is
    the answer (a transient load on the machine must not make the budget refuse a run); the
    draft is thrown away and the RNG state restored."""
    from draftling.draft.vocab import build_vocab
    from draftling.data.tokenized import TokenizedExample

    rng = torch.get_rng_state()
    device, tc = target.device, cfg.train
    vocab = build_vocab(torch.ones(target.config.vocab_size), min(cfg.vocab.size, target.config.vocab_size), "probe")
    draft, offload, param_dtype = prepare_draft(cfg, target, vocab, device)
    objective = wrap(draft, current(), tc.parallel, param_dtype, offload)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer, scheduled = build_optimizer(params, tc.lr, tc.betas, tc.weight_decay, offload)
    scheduler = torch.optim.lr_scheduler.LambdaLR(scheduled, lambda _: 1.0)
    examples = [TokenizedExample(str(i), "probe", torch.randint(0, vocab.size, (seq_len,)).tolist(),
                                 [1] * seq_len) for i in range(tc.batch_size)]
    teacher = _RandomStates(target, vocab.t2d.to(device)) if cfg.data.keep_teacher_states else None
    source = BatchSource(cfg, target, examples, device, current(), teacher)
    keys = list(range(tc.batch_size))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        train_step(objective, optimizer, scheduler, source, keys)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    torch.set_rng_state(rng)
    return min(times[1:])


def host_draft(objective, config) -> Eagle3Draft:
    """A plain draft with the full weights, for saving (gathers shards on every rank)."""
    draft = unwrap(objective)
    if not is_sharded(draft):
        return draft
    copy = Eagle3Draft(config)
    copy.load_state_dict(full_model_state(objective), strict=False)
    return copy


# Keys a resume may change freely: they steer logging, checkpoints, time and validation, not
# the weights a step computes.
RESUME_FREE_KEYS = ("train.max_minutes", "train.fit_schedule", "train.log_every", "train.ckpt_every",
                    "train.stop_on_convergence", "train.keep_checkpoints", "train.val_every", "train.max_val_batches", "wall_minutes",
                    "device", "data.", "bench.", "extract.")


def resume_config_changes(run_dir: Path, cfg: RunConfig, allow_change) -> dict:
    """{key: (old, new)} for the keys ``allow_change`` lets a resume change; a ConfigError
    listing any other key whose value differs from the run's saved config.yaml."""
    from draftling.config import load_config, to_dict

    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return {}
    old, new = _flatten(to_dict(load_config(saved))), _flatten(to_dict(cfg))
    differ = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
              if old.get(k) != new.get(k) and not k.startswith(RESUME_FREE_KEYS)}
    refused = [k for k in differ if k not in set(allow_change)]
    if refused:
        listed = "; ".join(f"{k}: {differ[k][0]!r} -> {differ[k][1]!r}" for k in refused)
        raise ConfigError(f"--resume {run_dir}: the config differs from the run's ({listed}); resume with the "
                          f"run's values, or apply the change with --allow-change {refused[0]}")
    return differ


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "max_prompts_by_file":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> list[Path]:
    """A run directory that holds an earlier run is refused unless the run resumes it or
    starts over (``overwrite``); a later ``--resume`` must never pick up a stale checkpoint of
    another run. Returns what an overwrite removes."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: is a file, not a directory")
    earlier = [run_dir / n for n in ("checkpoints", "draft", "metrics.jsonl") if (run_dir / n).exists()]
    if earlier and not resume and not overwrite:
        raise ConfigError(f"--run-dir {run_dir}: holds an earlier run ({', '.join(p.name for p in earlier)}); "
                          "pass --resume to continue it or --overwrite to start over")
    return [] if resume else earlier


def claim_run_dir(run_dir: Path, resume: bool, overwrite: bool, ctx: DistContext) -> None:
    """check_run_dir, then make the directory: with ``overwrite`` the earlier run's
    checkpoints, draft and metrics go."""
    earlier = check_run_dir(run_dir, resume, overwrite)
    if earlier:
        barrier(ctx)  # every rank has looked before rank 0 removes
        if ctx.is_main:
            for path in earlier + [run_dir / "tensorboard", run_dir / "train_result.json"]:
                remove_path(path)
        barrier(ctx)
    run_dir.mkdir(parents=True, exist_ok=True)
    if ctx.is_main:
        stale = remove_stale_temporaries(run_dir)
        if stale:
            print(f"removed {len(stale)} temporaries that interrupted writes left in {run_dir}: "
                  f"{', '.join(sorted(stale)[:4])}{' ...' if len(stale) > 4 else ''}", flush=True)
    barrier(ctx)


@dataclasses.dataclass
class RunInputs:
    """What a run reads before it touches its directory: a bad input leaves nothing behind."""
    examples: list
    val_examples: list
    vocab: object
    teacher: TeacherSource | None  # None: the resident target is the teacher
    val_teacher: TeacherSource | None
    warm: WarmStart | None = None  # --init-from: the head training starts from, and its maps


def load_run_inputs(target: Target, train_path, val_path, vocab_path, teacher_source: TeacherSource | None,
                    say, init: InitDraft | None = None) -> RunInputs:
    """The examples, the vocab and the teachers of both splits. A given ``teacher_source`` serves
    validation through its ``for_split("val", hash)``; without one, the states kept beside each
    jsonl file (if any) are the teacher of its split."""
    n_vocab = target.config.vocab_size
    check_one_run(*[Path(p) for p in (train_path, val_path) if p])
    examples = load_tokenized(train_path, n_vocab)
    val_examples = load_tokenized(val_path, n_vocab) if val_path and Path(val_path).exists() else []
    val_teacher = None
    if teacher_source is not None and val_examples:
        val_teacher = teacher_source.for_split("val", hash_dataset_file(val_path))
    vocab = load_vocab(vocab_path, expect_data_hash=hash_dataset_file(train_path), target_vocab_size=n_vocab)
    warm = None
    if init is not None:
        warm = warm_start(init, target, vocab, examples)
        r = warm.report
        say(f"init from {init.where}: " + (f"vocab map rebuilt from the data, {r['tokens_entered']} tokens entered "
            f"with the target's head rows; coverage {r['new_map_coverage']:.3f}" if init.rebuild_vocab else
            f"its own vocab map kept, covering {r['kept_map_coverage']:.3f} of the data's loss tokens (a map "
            f"from the data: {r['new_map_coverage']:.3f}; --rebuild-vocab switches to it)"))
        if teacher_source is not None and not torch.equal(warm.vocab.t2d, vocab.t2d):
            raise ConfigError(f"--init-from {init.where}: the head keeps its own vocab map, but the teacher cache "
                              "holds logits over the data's map; pass --rebuild-vocab or train online")
        vocab = warm.vocab
    if teacher_source is None:
        teacher_source = kept_states_teacher(target, train_path, vocab.t2d, say)
        if teacher_source is not None and val_examples:
            val_teacher = kept_states_teacher(target, val_path, vocab.t2d, say)
    return RunInputs(examples, val_examples, vocab, teacher_source, val_teacher, warm)


@dataclasses.dataclass
class TrainRun:
    """One run's live state, built by ``build_run`` and advanced by ``train_step``."""
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
        return BatchSource(self.cfg, self.target, self.inputs.examples, self.target.device, self.ctx,
                           self.inputs.teacher, self.cache)

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
        vm = evaluate(self.objective, self.target, self.inputs.val_examples, self.cfg, self.target.device,
                      tc.max_val_batches, self.inputs.val_teacher, self.ctx)
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
            save_checkpoint(self.run_dir, weights, opt_state, self.scheduler, self.step,
                            self.batches.position(self.step),
                            KeepPolicy(tc.keep_checkpoints, tc.ckpt_every_epoch, tc.keep_every_steps),
                            {"total_steps": self.total_steps, "compute_dtype": self.unroll.autocast or "float32"})
        barrier(self.ctx)


def build_run(cfg: RunConfig, target: Target, inputs: RunInputs, run_dir: Path, ckpt: Path | None,
              ctx: DistContext, say) -> TrainRun:
    """The draft (with the checkpoint's weights, before wrapping: DDP broadcasts them, FSDP
    shards them), its wrapper, optimizer and schedule, with the memory policy resolved."""
    from draftling.train.plan import DraftShape

    tc, device = cfg.train, target.device
    sharded = ctx.active and tc.parallel == "fsdp"
    draft, offload, param_dtype = prepare_draft(cfg, target, inputs.vocab, device, sharded, inputs.warm)
    longest = max((len(e.input_ids) for e in inputs.examples + inputs.val_examples), default=1)
    shape = DraftShape.from_config(draft.config, inputs.vocab.size, draft_window(draft.config))  # the built draft's
    tc, policy = resolve_memory_policy(tc, device, shape,
                                       -(-tc.batch_size // ctx.world_size), longest, param_dtype, offload,
                                       target.input_embeddings().weight.dtype)
    say(f"memory policy: {policy}")
    if ckpt is not None:
        draft.load_state_dict(load_file(str(ckpt / WEIGHTS_FILE), device=str(device)), strict=False)
        # A timed probe (bfloat16_if_fast) could decide otherwise on a busy machine: keep the run's.
        resolved = json.loads((ckpt / "meta.json").read_text()).get("compute_dtype")
        if resolved:
            tc = dataclasses.replace(tc, compute_dtype=resolved)
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
        say(f"data: training on {len(batches.pool)} of {len(inputs.examples)} sequences (train.data_fraction="
            f"{tc.data_fraction:g})")
    total_steps = tc.max_steps or max(1, math.ceil(tc.epochs * batches.batches_per_epoch))
    schedule = CosineSchedule(tc.warmup_steps, total_steps, tc.min_lr_ratio)
    # Through a lambda: LambdaLR would save a callable object's fields in its state and a resume
    # would restore them over the config's; the fitted length is restored from meta.json instead.
    scheduler = torch.optim.lr_scheduler.LambdaLR(scheduled, lambda step: schedule(step))
    return TrainRun(cfg, target, ctx, run_dir, inputs, draft, objective, optimizer, scheduled, scheduler, schedule,
                    batches, unroll_options(tc, device, param_dtype=param_dtype), offload, param_dtype,
                    total_steps, total_steps, say, policy)


def restore_run(run: TrainRun, ckpt: Path, changes: dict) -> None:
    """The optimizer, scheduler, RNG and step of ``ckpt``; a ``train.lr`` change applied."""
    tc, state = run.cfg.train, load_train_state(ckpt)
    opt_state = dict(state["optimizer"])
    if not run.offload or (run.ctx.active and tc.parallel == "fsdp"):  # an offloaded run's also has fp32 masters
        opt_state.pop("master_params", None)
    load_optimizer_state(run.objective, run.optimizer, opt_state)
    run.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    run.step = state["step"]
    if tc.fit_schedule:  # the schedule as the interrupted run had fitted it
        run.total_steps = run.schedule.total = json.loads((ckpt / "meta.json").read_text()).get(
            "total_steps", run.total_steps)
    if "train.lr" in changes:  # the scheduler's state holds the old base lr
        run.scheduler.base_lrs = [tc.lr] * len(run.scheduler.base_lrs)
        for group in run.scheduled.param_groups:
            group["initial_lr"], group["lr"] = tc.lr, tc.lr * run.schedule(run.step)
    run.say(f"resumed from {ckpt} at step {run.step}"
            + (f", with {', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in changes.items())}" if changes else ""))


def param_counts(draft: torch.nn.Module, target: Target) -> dict:
    """What the draft trains and what its forward reads frozen (its own frozen parameters and the
    target's input embedding, which it embeds tokens with), the target's parameters, and the
    trainable share of the target's: a head that trains the wrong thing shows here."""
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)
    frozen += target.input_embeddings().weight.numel()
    total = sum(p.numel() for p in target.model.parameters())
    return {"trainable": trainable, "frozen": frozen, "target": total,
            "share_of_target": trainable / total if total else None}


def params_line(p: dict) -> str:
    share = f" ({p['share_of_target']:.1%} of the target's {p['target'] / 1e6:.2f}M)" if p["share_of_target"] else ""
    return (f"{p['trainable'] / 1e6:.2f}M trainable params{share}, {p['frozen'] / 1e6:.2f}M frozen "
            "(the target's embedding included)")


def describe_run(run: TrainRun) -> None:
    tc, ctx, inputs = run.cfg.train, run.ctx, run.inputs
    parallel = (f", {ctx.world_size} ranks ({tc.parallel}), {tc.batch_size // ctx.world_size}+ "
                f"sequences per rank" if ctx.active else "")
    m = run.unroll
    run.say(f"training draft: {params_line(param_counts(run.draft, run.target))}, {len(inputs.examples)} train / "
            f"{len(inputs.val_examples)} val sequences, {run.total_steps} steps of {tc.batch_size}, "
            f"TTT {tc.ttt_steps}, device {run.target.device}{parallel}")
    run.say(f"memory: loss_chunk_tokens {m.loss_chunk_tokens}, grad_checkpoint {m.grad_checkpoint}, "
            f"attention {m.attention}, optimizer_offload {run.offload}, draft_dtype "
            f"{str(run.param_dtype).replace('torch.', '')}, embedding_on_host {tc.embedding_on_host}, compile "
            f"{m.compile} (layer {m.compile_layer}, teacher "
            f"{compile_teacher(tc, run.target.device, run.target.model)}), autocast {m.autocast or 'off'}, "
            f"pad_to_multiple {pad_multiple(tc, m.attention)}")


@dataclasses.dataclass(frozen=True)
class RunDirClaim:
    """How ``train`` takes its run directory: ``resume`` the run there (``allow_change``: config
    keys the resume may change, see resume_config_changes), or ``overwrite`` an earlier run;
    by default the directory must hold none (check_run_dir)."""

    resume: bool = False
    overwrite: bool = False
    allow_change: Sequence[str] = ()


def train(cfg: RunConfig, target: Target, run_dir: str | Path, train_path: str | Path,
          val_path: str | Path | None, vocab_path: str | Path, teacher_source: TeacherSource | None = None,
          init: InitDraft | None = None, **claim) -> dict:
    """``teacher_source``: a TeacherSource (e.g. an offline.OfflineTeacher) used instead of running
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
    if tc.batch_size < ctx.world_size:
        raise ConfigError(f"train.batch_size={tc.batch_size} is the global batch; it must be at least "
                          f"the world size ({ctx.world_size})")

    def say(line: str) -> None:
        if ctx.is_main:
            print(line, flush=True)

    if cfg.draft.init_from and init is None:
        raise ConfigError(f"draft.init_from={cfg.draft.init_from}: load that draft and pass it as init= "
                          "(the `train` command does)")
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
        restore_run(run, ckpt, changes)
    run.metrics_log = (MetricsLog(run_dir / "metrics.jsonl", run.step if ckpt is not None else None)
                       if ctx.is_main else None)
    if run.metrics_log and changes and ckpt is not None:
        run.metrics_log.write({"step": run.step, "split": "config_change",
                               "changes": {k: {"from": a, "to": b} for k, (a, b) in changes.items()}})
    run.smoke = start_smoke(run, smoke_bench, ckpt is not None)
    describe_run(run)
    run.cache = TeacherCache(int(tc.teacher_cache_gb * 2**30)) if tc.teacher_cache_gb > 0 else None
    t_start = train_loop(run)
    return finish_run(run, t_start)


def train_loop(run: TrainRun) -> float:
    """Steps to ``run.total_steps``, logging, validating and checkpointing on the way. Returns
    the loop's start time."""
    tc, ctx, device = run.cfg.train, run.ctx, run.target.device
    # Steps are its units; its lines are the log lines (StepWindow.log appends its timing).
    progress = run.progress = Progress(run.total_steps, "train", enabled=ctx.is_main, initial=run.step)
    window = StepWindow(tc.ttt_steps, device)
    t_start = run.segment_start = time.perf_counter()
    run.segment_step = run.step
    fit = FitToTime(tc, run.total_steps, t_start, run.step, ctx, device) if tc.fit_schedule else None
    while run.step < run.total_steps:
        loss, counts, tokens = run.train_step()
        fault_point("train.step")
        if fit is not None and fit.due(run.step, run.batches.position(run.step)[1] == 0):
            run.total_steps = run.schedule.total = fit.refit(run.step)
            progress.set_total(run.total_steps)
        window.add(counts, loss, tokens)  # stays on the device until the log line
        progress.update(1)
        if run.step % tc.log_every == 0 or run.step == run.total_steps:
            window.log(run)
        if tc.val_every and run.step % tc.val_every == 0 and run.inputs.val_examples:
            run.validate(f"val @ {run.step}")
        if run.smoke is not None and run.step % run.smoke_every == 0:
            seconds = smoke_check(run)
            window.t0 += seconds  # the smoke bench's time is not training throughput
            pace_smoke(run, seconds)
        out_of_time = tc.max_minutes > 0 and time.perf_counter() - t_start > 60 * tc.max_minutes
        if tc.max_minutes > 0 and any_rank(out_of_time, ctx, device) and run.step < run.total_steps:
            run.say(f"stopping at step {run.step}/{run.total_steps}: train.max_minutes={tc.max_minutes} reached")
            run.stop("max_minutes")
        epoch_end = tc.ckpt_every_epoch and run.batches.position(run.step)[1] == 0
        if run.step % tc.ckpt_every == 0 or run.step == run.total_steps or epoch_end:
            run.checkpoint()
    progress.close()
    return t_start


def start_smoke(run: TrainRun, bench: SmokeBench | None, resumed: bool) -> SmokeMonitor | None:
    """The run's smoke monitor (train.smoke_every), None when off. A resumed run replays the
    checks metrics.jsonl holds up to its checkpoint, so it decides as the uninterrupted run
    would; one that had converged there with train.stop_on_convergence stops at once."""
    if bench is None:
        return None
    tc = run.cfg.train
    run.smoke_every = tc.smoke_every
    monitor = SmokeMonitor(bench, ConvergenceDetector(tc.convergence_checks, tc.warmup_steps),
                           run.metrics_log.write if run.metrics_log else None)
    log = run.run_dir / "metrics.jsonl"
    if resumed and log.is_file():
        records = read_metrics(log)
        monitor.replay(records, run.step)
        for r in records:  # the interval the interrupted run had come to, so it checks at the same steps
            if r.get("split") == "smoke_interval" and r["step"] <= run.step:
                run.smoke_every = r["every"]
    verdict = monitor.detector.verdict
    if verdict and tc.stop_on_convergence and run.step < run.total_steps:
        run.say(f"{verdict_line(verdict)}, before this resume: stopping at step {run.step}")
        run.stop("converged")
    return monitor


def smoke_check(run: TrainRun) -> float:
    """The smoke bench at this step, on every rank (the same weights give the same verdict); with
    train.stop_on_convergence a convergence ends the run here. Returns the seconds it took."""
    t0 = time.perf_counter()
    verdict = run.smoke.check(host_draft(run.objective, run.draft.config), run.step,
                              run.step / run.batches.batches_per_epoch, run.batches.position(run.step - 1)[0])
    converged = any_rank(verdict is not None, run.ctx, run.target.device)
    if converged and run.cfg.train.stop_on_convergence and run.step < run.total_steps:
        run.say(f"stopping at step {run.step}/{run.total_steps}: the smoke tau converged "
                "(train.stop_on_convergence)")
        run.stop("converged")
    return time.perf_counter() - t0


def pace_smoke(run: TrainRun, seconds: float) -> None:
    """train.smoke_max_share: where a check of ``seconds`` costs more than that share of the
    training time between checks, check every multiple of train.smoke_every that keeps within it
    (the slowest rank's numbers, so every rank checks at the same steps), and log the numbers.
    A segment's first check is not judged: it also pays one-off costs (compiling and capturing
    the decode) that later checks do not."""
    tc = run.cfg.train
    run.smoke_seconds += seconds
    run.smoke_checks += 1
    steps = run.step - run.segment_step
    train_s = time.perf_counter() - run.segment_start - run.smoke_seconds
    if tc.smoke_max_share <= 0 or steps <= 0 or train_s <= 0 or run.smoke_checks == 1:
        return
    step_s, cap = train_s / steps, tc.smoke_max_share
    need = seconds * (1 - cap) / (cap * step_s)  # steps between checks for c / (c + N s) <= cap
    every = max(run.smoke_every, tc.smoke_every * math.ceil(need / tc.smoke_every))
    if run.ctx.active:
        t = torch.tensor([every], dtype=torch.int64, device=run.target.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        every = int(t.item())
    if every == run.smoke_every:
        return
    share = seconds / (seconds + run.smoke_every * step_s)
    run.say(f"smoke bench: a check took {seconds:.1f} s against {step_s:.3f} s a training step, {share:.0%} of the "
            f"time at every {run.smoke_every} steps, over train.smoke_max_share={tc.smoke_max_share:g}: checking "
            f"every {every} steps from here")
    if run.metrics_log:
        run.metrics_log.write({"split": "smoke_interval", "step": run.step, "every": every, "check_s": seconds,
                               "step_s": step_s, "share": share, "max_share": tc.smoke_max_share})
    run.smoke_every = every


class StepWindow:
    """The counts, loss and tokens since the last log line. Counts and loss stay on the device
    until ``log`` reads them (summed over ranks): the steps between never wait for the device."""

    def __init__(self, ttt_steps: int, device):
        self.ttt_steps, self.device = ttt_steps, device
        self.reset()

    def reset(self) -> None:
        self.counts = StepCounts(self.ttt_steps, device=self.device)
        self.loss, self.tokens = torch.zeros((), dtype=torch.float64, device=self.device), 0
        self.t0 = time.perf_counter()

    def add(self, counts: StepCounts, loss: torch.Tensor, tokens: int) -> None:
        self.counts.add(counts)
        self.loss = self.loss + loss.detach().double()
        self.tokens += tokens

    def log(self, run: TrainRun) -> None:
        every, step, world = run.cfg.train.log_every, run.step, run.ctx.world_size
        counts, (loss, tokens) = read_counts(self.counts, [self.loss, self.tokens], run.ctx)
        m = counts.metrics()
        n_logged = every if step % every == 0 else step % every
        now = time.perf_counter()  # after the read: the window's steps have finished on the device
        tokens = int(tokens)
        m.update(step=step, epoch=run.batches.position(step - 1)[0], loss=loss / world / n_logged,
                 lr=run.scheduler.get_last_lr()[0], tok_s=tokens / (now - self.t0), window_tokens=tokens,
                 segment=run.segment_step, wall_s=now - run.segment_start, split="train")
        if run.metrics_log:
            timing = f" | {run.progress.timing()}" if run.progress is not None else ""
            run.metrics_log.write(m, format_line(f"step {step}/{run.total_steps}", m)
                                  + f" | lr {m['lr']:.2e} | {m['tok_s']:.0f} tok/s{timing}")
        self.reset()


def data_used(run: TrainRun) -> dict:
    """The training sequences this run drew from (train.data_fraction) and their loss tokens."""
    pool = run.batches.pool
    return {"fraction": run.cfg.train.data_fraction, "sequences": len(pool),
            "loss_tokens": sum(sum(run.inputs.examples[i].loss_mask) for i in pool)}


def finish_run(run: TrainRun, t_start: float) -> dict:
    """The final validation, the head in ``<run>/draft`` and ``train_result.json``."""
    ctx, device = run.ctx, run.target.device
    # train_wall_s is this segment's: a resumed run started at segment_from_step (the earlier
    # segments' times are in metrics.jsonl; `draftling report` lists them).
    result = {"steps": run.total_steps, "steps_ceiling": run.ceiling, "train_wall_s": time.perf_counter() - t_start,
              "segment_from_step": run.segment_step, "stop_reason": run.stop_reason, "world_size": ctx.world_size, "data": data_used(run),
              "compute_dtype": run.unroll.autocast or str(run.param_dtype).replace("torch.", ""),
              "params": param_counts(run.draft, run.target)}
    if run.smoke is not None:
        result["convergence"] = run.smoke.detector.summary()
    if torch.cuda.is_available() and device.type == "cuda":
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if run.inputs.val_examples:
        result["val"] = run.validate("validation", final=True)
    final = host_draft(run.objective, run.draft.config)
    if ctx.is_main:
        run.metrics_log.close()
        with atomic_dir(run.run_dir / "draft") as tmp:
            save_draft(final, tmp)
            fault_point("draft.written")
        write_json(run.run_dir / "train_result.json", result)
    barrier(ctx)
    return result
