"""The online trainer: the teacher stays resident and its states are recomputed per batch."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
import weakref
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftling.config import RunConfig, TrainConfig, save_config
from draftling.data.runs import check_one_run
from draftling.data.states import StoredStates, states_path
from draftling.draft.model import Eagle3Draft, draft_config_from_target, init_from_target
from draftling.draft.store import WEIGHTS_FILE, save_draft
from draftling.draft.vocab import hash_dataset_file, load_vocab
from draftling.dynamo import allow_recompiles
from draftling.errors import ConfigError
from draftling.faults import fault_point
from draftling.hardware import BF16_IF_FAST, bf16_matmul_is_faster
from draftling.io import atomic_dir, atomic_path, remove_path, write_json
from draftling.target import Target
from draftling.target.quant import has_plain_weights
from draftling.train.checkpoint import (latest_checkpoint, load_train_state, remove_stale_temporaries, save_checkpoint,
                                        set_rng_state)
from draftling.train.dataset import EpochBatches, collate, load_tokenized
from draftling.train.distributed import (PARALLEL_MODES, DistContext, TTTObjective, all_reduce_sum, any_rank,
                                         barrier, current, full_model_state, full_optimizer_state, is_sharded,
                                         load_optimizer_state, rank_share, unwrap, wrap)
from draftling.train.host_embed import HostEmbedding
from draftling.train.optim import build_optimizer
from draftling.train.teacher import KeptStatesTeacher, TeacherCache, teacher_forward
from draftling.train.ttt import ATTENTION_BACKENDS, StepCounts, flex_usable, step_valid_counts

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
            records = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
            kept = [json.dumps(r) for r in records if r.get("step", 0) <= resume_step and not r.get("final")]
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
            for key in ("loss", "sim_tau", "chain_tau", "lr", "tok_s"):
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


def build_draft(cfg: RunConfig, target: Target, vocab) -> Eagle3Draft:
    overrides = {}
    if cfg.draft.intermediate_size is not None:
        if cfg.draft.intermediate_size < 1:
            raise ConfigError(f"draft.intermediate_size={cfg.draft.intermediate_size}: expected a positive "
                              "width or null (the target's)")
        overrides["intermediate_size"] = cfg.draft.intermediate_size
    config = draft_config_from_target(target.config, vocab.size, target.aux_layer_ids, **overrides)
    draft = Eagle3Draft(config)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    if cfg.draft.init_from_target:
        init_from_target(draft, target.model, vocab.t2d)
    return draft


def memory_options(tc: TrainConfig, device, training: bool = True,
                   param_dtype: torch.dtype = torch.float32) -> dict:
    """The ``ttt_unroll`` keyword options for this device, with the config's auto values
    (null / "auto") resolved: see TrainConfig for what each one does. ``param_dtype``: the
    draft's device params (autocast only pays over fp32 params)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    attention = tc.attention
    if attention == "auto":
        attention = "flex" if cuda and flex_usable(device, training)[0] else "sdpa"
    elif attention == "flex":
        ok, why = flex_usable(device, training)
        if not ok:
            raise ConfigError(f"train.attention=flex: {why}; use train.attention=sdpa (or auto)")
    elif attention not in ATTENTION_BACKENDS:
        raise ConfigError(f"train.attention={attention!r}: expected auto, {' or '.join(ATTENTION_BACKENDS)}")
    if tc.loss_chunk_tokens < 0:
        raise ConfigError(f"train.loss_chunk_tokens={tc.loss_chunk_tokens}: expected >= 0 (0 = off)")
    grad_checkpoint = tc.grad_checkpoint if tc.grad_checkpoint is not None else cuda
    # The chunked loss and the layer's halves; evaluation runs the loss eagerly (no_grad).
    compile = tc.compile if tc.compile is not None else cuda
    if tc.compute_dtype not in ("auto", "float32", "bfloat16", BF16_IF_FAST):
        raise ConfigError(f"train.compute_dtype={tc.compute_dtype!r}: expected auto, float32, bfloat16 "
                          f"or {BF16_IF_FAST}")
    compute = tc.compute_dtype
    if compute == "auto":
        compute = "bfloat16" if cuda and param_dtype == torch.float32 else "float32"
    elif compute == BF16_IF_FAST:
        compute = "bfloat16" if bf16_matmul_is_faster(device.type) else "float32"
    return {"loss_chunk_tokens": tc.loss_chunk_tokens, "grad_checkpoint": grad_checkpoint,
            "attention": attention, "compile": bool(compile and tc.loss_chunk_tokens > 0),
            "compile_layer": bool(compile),
            "autocast": None if compute == "float32" else compute}


def compile_teacher(tc: TrainConfig, device, target_model=None) -> bool:
    """Whether the teacher's decoder layers run compiled: ``train.compile_teacher``, by
    default as ``train.compile`` (auto: on CUDA), except for a quantized teacher (bitsandbytes
    and friends bring their own kernels; a GGUF teacher is dequantized, so it is plain). A
    small target's forward on a GPU is mostly unfused elementwise kernels."""
    if tc.compile_teacher is not None:
        return tc.compile_teacher
    if target_model is not None and not has_plain_weights(target_model):
        return False
    return bool(tc.compile if tc.compile is not None else torch.device(device).type == "cuda")


# train.memory_policy=auto: when the draft's estimated peak (train/plan.py) without activation
# recomputation and with large loss chunks stays under this share of the device's free
# memory, train that way: each recompute and each chunk costs host time, and a small draft
# beside a small teacher is bound by the host, not by the device.
FAST_MEMORY_SHARE = 0.5
FAST_LOSS_CHUNK_TOKENS = 16384


def fast_train_config(tc: TrainConfig) -> TrainConfig:
    """What ``train.memory_policy=auto`` trains with when it fits: no recompute unless asked
    for, and large loss chunks."""
    return dataclasses.replace(
        tc, grad_checkpoint=False if tc.grad_checkpoint is None else tc.grad_checkpoint,
        loss_chunk_tokens=max(tc.loss_chunk_tokens, FAST_LOSS_CHUNK_TOKENS) if tc.loss_chunk_tokens else 0)


def resolve_memory_policy(tc: TrainConfig, device, target_config, draft_vocab: int, batch: int, seq: int,
                          param_dtype: torch.dtype, offload: bool, embed_dtype) -> tuple[TrainConfig, str]:
    """The TrainConfig to train with, and why. ``batch``: sequences per process and step;
    ``seq``: the longest sequence; ``embed_dtype``: the target's (a dtype or its name)."""
    from draftling.train.plan import DraftShape, MemoryOptions, estimate_train_memory

    if tc.memory_policy not in ("auto", "config"):
        raise ConfigError(f"train.memory_policy={tc.memory_policy!r}: expected auto or config")
    device = torch.device(device)
    if tc.memory_policy == "config" or device.type != "cuda":
        return tc, "as configured"
    fast = fast_train_config(tc)
    mem = memory_options(fast, device, param_dtype=param_dtype)
    options = MemoryOptions.from_unroll_options(mem, optimizer_offload=offload, draft_dtype=param_dtype,
                                                embed_dtype=embed_dtype, embedding_on_host=tc.embedding_on_host)
    shape = DraftShape.from_config(target_config, draft_vocab)
    need = estimate_train_memory(shape, batch, seq, tc.ttt_steps, options)["total"]
    free = torch.cuda.mem_get_info(device)[0]
    gib = 2 ** 30
    if need <= FAST_MEMORY_SHARE * free:
        return fast, (f"fast: estimated draft peak {need / gib:.1f} GiB of {free / gib:.1f} GiB free, so no "
                      f"recompute and loss chunks of {fast.loss_chunk_tokens}")
    return tc, (f"as configured: the fast settings would need ~{need / gib:.1f} GiB, over "
                f"{FAST_MEMORY_SHARE:.0%} of the {free / gib:.1f} GiB free")


# "auto" offloads the optimizer once its fp32 state (masters and two moments, 12 bytes per
# param) would take more than this share of the device's memory; below that the host
# round trip costs more step time than the memory is worth.
OFFLOAD_AUTO_SHARE = 0.02


def optimizer_offload(tc: TrainConfig, device, n_params: int | None = None) -> bool:
    if tc.optimizer_offload is not None:
        return tc.optimizer_offload
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if n_params is None:
        return True
    total = torch.cuda.get_device_properties(device).total_memory
    return 12 * n_params > OFFLOAD_AUTO_SHARE * total


DRAFT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def draft_param_dtype(tc: TrainConfig, device, n_params: int | None = None) -> torch.dtype:
    """The dtype of the draft's device params (``train.draft_dtype``, "auto" resolved)."""
    if tc.draft_dtype == "auto":
        return torch.bfloat16 if optimizer_offload(tc, device, n_params) else torch.float32
    if tc.draft_dtype not in DRAFT_DTYPES:
        raise ConfigError(f"train.draft_dtype={tc.draft_dtype!r}: expected auto, {', '.join(DRAFT_DTYPES)}")
    return DRAFT_DTYPES[tc.draft_dtype]


def place_draft(draft: Eagle3Draft, device, dtype: torch.dtype) -> Eagle3Draft:
    """Cast the draft's weights (on the host, so the device never holds an fp32 copy of a
    bf16 draft) and move it to the device; the rotary table stays fp32."""
    for module in (draft.fc, draft.midlayer, draft.norm, draft.lm_head):
        module.to(dtype)
    return draft.to(device)


def prepare_draft(cfg: RunConfig, target: Target, vocab, device, sharded: bool = False):
    """Build the draft and place it on the device as training needs it. Returns
    (draft, optimizer offload on?, the draft's compute dtype).

    Build order: the teacher (the target) is already loaded and resident. The draft is built
    on the CPU (random init, vocab maps, optional warm start from the target's head) and moved
    to the device once, after the teacher, so none of its build-time temporaries touch device
    memory. train.build_on_host=false moves it as built instead (same weights: the init runs
    on the host RNG either way)."""
    tc = cfg.train
    with torch.device("cpu"):
        draft = build_draft(cfg, target, vocab)
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


def _global_counts(counts: StepCounts, extras: list[float], ctx: DistContext, device):
    """Sum the step counts and extra scalars over ranks (one collective)."""
    if not ctx.active:
        return counts, extras
    fields, walk = StepCounts.FIELDS, StepCounts.WALK_FIELDS
    flat = ([float(x) for f in fields for x in getattr(counts, f)] + [float(getattr(counts, f)) for f in walk]
            + [float(x) for x in extras])
    total = all_reduce_sum(torch.tensor(flat, dtype=torch.float64, device=device), ctx).tolist()
    out = StepCounts(counts.steps)
    for i, f in enumerate(fields):
        values = total[i * counts.steps:(i + 1) * counts.steps]
        setattr(out, f, values if f == "loss_sum" else [int(round(v)) for v in values])
    end = len(fields) * counts.steps
    for i, f in enumerate(walk):
        setattr(out, f, int(round(total[end + i])))
    return out, total[end + len(walk):]


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


def run_batch(objective, cfg: RunConfig, target: Target, examples, keys: list[int], device,
              ctx: DistContext, teacher_source=None, cache: TeacherCache | None = None):
    """This rank's share of one global batch through the teacher and the TTT unroll.
    Returns (loss, counts, tokens) of the share; the loss is normalized over the whole
    global batch, so gradients averaged over ranks are the single-process gradients."""
    tc = cfg.train
    share, stand_in = rank_share(keys, ctx)
    chunk = [examples[k] for k in share]
    lengths = [len(e.input_ids) for e in chunk]
    batch = {k: v.to(device) for k, v in collate(chunk, target.tokenizer.pad_token_id).items()}
    if stand_in:
        batch["loss_mask"].zero_()
    elif tc.loss_on_prompt and torch.is_grad_enabled():
        # Every real position has a teacher label; validation keeps the assistant-only mask.
        batch["loss_mask"] = batch["attention_mask"].clone()
    draft = unwrap(objective)
    # An offline cache already holds the final outputs; kept states still need the head.
    if cache and not getattr(teacher_source, "cacheable", teacher_source is None):
        cache = None
    teacher = cache.get(share, lengths, device) if cache else None
    if teacher is None:
        if teacher_source is not None:
            teacher = teacher_source.get(share, lengths, device)
        else:
            teacher = teacher_forward(target, batch["input_ids"], batch["attention_mask"], draft.t2d,
                                      compile=compile_teacher(tc, device, target.model))
        if cache:
            teacher = cache.put(share, lengths, teacher)
    denominators = None
    if ctx.active:
        valid = step_valid_counts(batch["loss_mask"], batch["attention_mask"], teacher.in_draft,
                                  tc.ttt_steps).to(torch.float64)
        denominators = (all_reduce_sum(valid, ctx) / ctx.world_size).tolist()
    training = torch.is_grad_enabled()
    loss, counts = objective(draft_embedding(cfg, target, device), teacher, batch["input_ids"],
                             batch["loss_mask"], batch["attention_mask"], tc.ttt_steps,
                             tc.step_weight_decay,
                             memory_options(tc, device, training, next(draft.parameters()).dtype),
                             denominators)
    tokens = 0 if stand_in else int(batch["attention_mask"].sum())
    return loss, counts, tokens


@torch.no_grad()
def evaluate(objective, target: Target, examples, cfg: RunConfig, device, max_batches: int,
             teacher_source=None, ctx: DistContext | None = None) -> dict:
    """Validation metrics over the first ``max_batches`` batches, exact over any world size.
    ``objective`` is what ``distributed.wrap`` returns, or a bare draft."""
    ctx = ctx or current()
    if isinstance(objective, Eagle3Draft):
        objective = TTTObjective(objective)
    objective.eval()
    counts = StepCounts(cfg.train.ttt_steps)
    loss = 0.0
    n = 0
    bs = cfg.train.batch_size
    for i in range(0, min(len(examples), max_batches * bs), bs):
        keys = list(range(i, min(i + bs, len(examples))))
        l, c, _ = run_batch(objective, cfg, target, examples, keys, device, ctx, teacher_source)
        c, (l_sum,) = _global_counts(c, [l.item()], ctx, device)
        counts.add(c)
        loss += l_sum / ctx.world_size
        n += 1
    if hasattr(objective, "reshard"):  # FSDP: a forward without backward leaves params gathered
        objective.reshard()
    objective.train()
    m = counts.metrics()
    m["loss"] = loss / max(n, 1)
    return m


def train_step(objective, cfg: RunConfig, target: Target, examples, keys: list[int], device, ctx: DistContext,
               params, optimizer, scheduler, teacher_source=None, cache: TeacherCache | None = None):
    """One optimizer step on the global batch ``keys`` (this rank's share of it). Returns
    run_batch's (loss, counts, tokens)."""
    loss, counts, tokens = run_batch(objective, cfg, target, examples, keys, device, ctx, teacher_source, cache)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
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
    from draftling.train.dataset import TokenizedExample

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
    keys = list(range(tc.batch_size))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        train_step(objective, cfg, target, examples, keys, device, current(), params, optimizer, scheduler, teacher)
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
                    "train.keep_checkpoints", "train.val_every", "train.max_val_batches", "wall_minutes",
                    "device", "data.", "bench.")


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


def train(cfg: RunConfig, target: Target, run_dir: str | Path, train_path: str | Path,
          val_path: str | Path | None, vocab_path: str | Path, resume: bool = False,
          teacher_source=None, overwrite: bool = False, allow_change=()) -> dict:
    """``teacher_source``: an object with ``get(keys, lengths, device) -> TeacherBatch`` (e.g. an
    offline.OfflineTeacher) used instead of running the teacher; its ``for_split("val", hash)``,
    when it has one, serves validation.

    Under torchrun (``distributed.init_distributed`` called first) every rank runs this
    with its own resident teacher and its share of each global batch; rank 0 writes."""
    ctx = current()
    run_dir = Path(run_dir)
    check_run_dir(run_dir, resume, overwrite)
    tc = cfg.train
    device = target.device
    torch.manual_seed(tc.seed)
    torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 draft trains against a bf16 teacher
    allow_recompiles()  # batches of many lengths: flex and the loss chunks must stay compiled
    if tc.parallel not in PARALLEL_MODES:
        raise ConfigError(f"train.parallel={tc.parallel!r}: expected {' or '.join(PARALLEL_MODES)}")
    if tc.batch_size < ctx.world_size:
        raise ConfigError(f"train.batch_size={tc.batch_size} is the global batch; it must be at least "
                          f"the world size ({ctx.world_size})")

    def say(line: str) -> None:
        if ctx.is_main:
            print(line, flush=True)

    n_vocab = target.config.vocab_size
    check_one_run(*[Path(p) for p in (train_path, val_path) if p])
    examples = load_tokenized(train_path, n_vocab)
    val_examples = load_tokenized(val_path, n_vocab) if val_path and Path(val_path).exists() else []
    val_source = None
    if teacher_source is not None and val_examples and hasattr(teacher_source, "for_split"):
        val_source = teacher_source.for_split("val", hash_dataset_file(val_path))
    vocab = load_vocab(vocab_path, expect_data_hash=hash_dataset_file(train_path),
                       target_vocab_size=target.config.vocab_size)
    # Inputs are read before the run directory is touched: a bad one leaves nothing behind.
    claim_run_dir(run_dir, resume, overwrite, ctx)
    changes = resume_config_changes(run_dir, cfg, allow_change) if resume else {}
    if ctx.is_main:
        save_config(cfg, run_dir / "config.yaml")
    if teacher_source is None:
        teacher_source = kept_states_teacher(target, train_path, vocab.t2d, say)
        if teacher_source is not None and val_examples:
            val_source = kept_states_teacher(target, val_path, vocab.t2d, say)
    sharded = ctx.active and tc.parallel == "fsdp"
    draft, offload, param_dtype = prepare_draft(cfg, target, vocab, device, sharded)
    n_params = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    longest = max((len(e.input_ids) for e in examples + val_examples), default=1)
    tc, policy = resolve_memory_policy(tc, device, target.config, vocab.size, -(-tc.batch_size // ctx.world_size),
                                       longest, param_dtype, offload, target.input_embeddings().weight.dtype)
    cfg = dataclasses.replace(cfg, train=tc)
    say(f"memory policy: {policy}")

    ckpt = latest_checkpoint(run_dir, warn=say) if resume else None
    if resume and ckpt is None:
        log.warning("--resume: no checkpoint in %s, starting from scratch", run_dir)
    state = load_train_state(ckpt) if ckpt is not None else None
    if ckpt is not None:  # weights before wrapping: DDP broadcasts them, FSDP shards them
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
    mem_opts = memory_options(tc, device, param_dtype=param_dtype)
    # With offload the scheduler drives the inner torch AdamW over the host masters. Under
    # FSDP, offload is its CPUOffloadPolicy and the plain optimizer steps the host shards.
    optimizer, scheduled = build_optimizer(params, tc.lr, tc.betas, tc.weight_decay, offload and not sharded)
    batches = EpochBatches(examples, tc.batch_size, tc.seed, tc.group_by_length)
    total_steps = ceiling = tc.max_steps or max(1, math.ceil(tc.epochs * batches.batches_per_epoch))
    schedule = CosineSchedule(tc.warmup_steps, total_steps, tc.min_lr_ratio)
    # Through a lambda: LambdaLR would save a callable object's fields in its state and a resume
    # would restore them over the config's; the fitted length is restored from meta.json instead.
    scheduler = torch.optim.lr_scheduler.LambdaLR(scheduled, lambda step: schedule(step))

    start_step = 0
    if state is not None:
        opt_state = dict(state["optimizer"])
        if not offload or sharded:  # a checkpoint of an offloaded run also carries its fp32 masters
            opt_state.pop("master_params", None)
        load_optimizer_state(objective, optimizer, opt_state)
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start_step = state["step"]
        if tc.fit_schedule:  # the schedule as the interrupted run had fitted it
            total_steps = schedule.total = json.loads((ckpt / "meta.json").read_text()).get("total_steps", total_steps)
        if "train.lr" in changes:  # the scheduler's state holds the old base lr
            scheduler.base_lrs = [tc.lr] * len(scheduler.base_lrs)
            for group in scheduled.param_groups:
                group["initial_lr"], group["lr"] = tc.lr, tc.lr * schedule(start_step)
        say(f"resumed from {ckpt} at step {start_step}"
            + (f", with {', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in changes.items())}" if changes else ""))

    metrics_log = (MetricsLog(run_dir / "metrics.jsonl", start_step if ckpt is not None else None)
                   if ctx.is_main else None)
    if metrics_log and changes and ckpt is not None:
        metrics_log.write({"step": start_step, "split": "config_change",
                           "changes": {k: {"from": a, "to": b} for k, (a, b) in changes.items()}})
    parallel = (f", {ctx.world_size} ranks ({tc.parallel}), {tc.batch_size // ctx.world_size}+ "
                f"sequences per rank" if ctx.active else "")
    say(f"training draft: {n_params / 1e6:.2f}M trainable params, {len(examples)} train / "
        f"{len(val_examples)} val sequences, {total_steps} steps of {tc.batch_size}, "
        f"TTT {tc.ttt_steps}, device {device}{parallel}")
    say(f"memory: loss_chunk_tokens {mem_opts['loss_chunk_tokens']}, grad_checkpoint "
        f"{mem_opts['grad_checkpoint']}, attention {mem_opts['attention']}, optimizer_offload "
        f"{offload}, draft_dtype {str(param_dtype).replace('torch.', '')}, embedding_on_host "
        f"{tc.embedding_on_host}, compile {mem_opts['compile']} (layer {mem_opts['compile_layer']}, "
        f"teacher {compile_teacher(tc, device, target.model)}), autocast {mem_opts['autocast'] or 'off'}")
    progress = None
    if sys.stderr.isatty() and ctx.is_main:
        from tqdm import tqdm
        progress = tqdm(total=total_steps, initial=start_step, desc="train", leave=False)

    def validate(prefix: str, step: int, final: bool = False) -> dict:
        vm = evaluate(objective, target, val_examples, cfg, device, tc.max_val_batches, val_source, ctx)
        vm.update(step=step, split="val", **({"final": True} if final else {}))
        if metrics_log:
            metrics_log.write(vm, format_line(prefix, vm))
        return vm

    window = StepCounts(tc.ttt_steps)
    window_loss, window_tokens, window_t0 = 0.0, 0, time.perf_counter()
    cache = TeacherCache(int(tc.teacher_cache_gb * 2**30)) if tc.teacher_cache_gb > 0 else None
    step = start_step
    t_start = time.perf_counter()
    fit = FitToTime(tc, total_steps, t_start, start_step, ctx, device) if tc.fit_schedule else None
    while step < total_steps:
        epoch, index = batches.position(step)
        loss, counts, tokens = train_step(objective, cfg, target, examples, batches.indices(epoch, index),
                                          device, ctx, params, optimizer, scheduler, teacher_source, cache)
        step += 1
        fault_point("train.step")
        if fit is not None and fit.due(step, batches.position(step)[1] == 0):
            total_steps = schedule.total = fit.refit(step)
            if progress is not None:
                progress.total = total_steps
        counts, (loss_sum, tokens) = _global_counts(counts, [loss.item(), tokens], ctx, device)
        window.add(counts)
        window_loss += loss_sum / ctx.world_size
        window_tokens += int(tokens)
        if progress is not None:
            progress.update(1)
        if step % tc.log_every == 0 or step == total_steps:
            m = window.metrics()
            n_logged = tc.log_every if step % tc.log_every == 0 else step % tc.log_every
            m.update(step=step, epoch=epoch, loss=window_loss / n_logged, lr=scheduler.get_last_lr()[0],
                     tok_s=window_tokens / (time.perf_counter() - window_t0), split="train")
            if metrics_log:
                metrics_log.write(m, format_line(f"step {step}/{total_steps}", m)
                                  + f" | lr {m['lr']:.2e} | {m['tok_s']:.0f} tok/s")
            window = StepCounts(tc.ttt_steps)
            window_loss, window_tokens, window_t0 = 0.0, 0, time.perf_counter()
        if tc.val_every and step % tc.val_every == 0 and val_examples:
            validate(f"val @ {step}", step)
        out_of_time = tc.max_minutes > 0 and time.perf_counter() - t_start > 60 * tc.max_minutes
        if tc.max_minutes > 0 and any_rank(out_of_time, ctx, device) and step < total_steps:
            say(f"stopping at step {step}/{total_steps}: train.max_minutes={tc.max_minutes} reached")
            total_steps = step
        if step % tc.ckpt_every == 0 or step == total_steps:
            e, i = batches.position(step)
            weights = host_draft(objective, draft.config)
            opt_state = full_optimizer_state(objective, optimizer)
            if ctx.is_main:
                save_checkpoint(run_dir, weights, opt_state, scheduler, step, e, i, tc.keep_checkpoints,
                                {"total_steps": total_steps, "compute_dtype": mem_opts["autocast"] or "float32"})
            barrier(ctx)
    if progress is not None:
        progress.close()

    result = {"steps": total_steps, "steps_ceiling": ceiling, "train_wall_s": time.perf_counter() - t_start,
              "world_size": ctx.world_size,
              "compute_dtype": mem_opts["autocast"] or str(param_dtype).replace("torch.", "")}
    if torch.cuda.is_available() and device.type == "cuda":
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if val_examples:
        result["val"] = validate("validation", step, final=True)
    final = host_draft(objective, draft.config)
    if ctx.is_main:
        metrics_log.close()
        with atomic_dir(run_dir / "draft") as tmp:
            save_draft(final, tmp)
            fault_point("draft.written")
        write_json(run_dir / "train_result.json", result)
    barrier(ctx)
    return result
