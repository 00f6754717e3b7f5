"""The train section."""

from __future__ import annotations

from dataclasses import dataclass

from draftling.config.fields import (
    AT_LEAST_ONE,
    AUTO,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    Auto,
    bounds_of,
    check_bounds,
    check_choices,
    choices_of,
    key,
)
from draftling.errors import ConfigError


@dataclass
class TrainConfig:
    ttt_steps: int = key(7, bounds=AT_LEAST_ONE, help="TTT unroll steps per position.")
    step_weight_decay: float = key(0.8, bounds=POSITIVE, help="loss weight of TTT step j is decay**j")
    epochs: float = key(1.0, bounds=POSITIVE, help="Passes over the training data.")
    max_steps: int = key(
        0, bounds=("an integer >= 0 (0 = from epochs)", lambda v: v >= 0), help=("0 = derived from epochs")
    )
    batch_size: int = key(8, bounds=AT_LEAST_ONE, help="sequences per optimizer step")
    lr: float = key(1e-4, bounds=POSITIVE, help="Peak learning rate (AdamW).")
    min_lr_ratio: float = key(0.1, bounds=FRACTION, help="The cosine schedule's floor, as a share of lr.")
    warmup_steps: int = key(50, bounds=NON_NEGATIVE, help="Linear warmup steps.")
    betas: tuple[float, float] = key((0.9, 0.95), help="AdamW betas, two numbers in [0, 1).")
    weight_decay: float = key(0.0, bounds=NON_NEGATIVE, help="AdamW weight decay.")
    grad_clip: float = key(0.5, bounds=POSITIVE, help="Gradient norm clip.")
    log_every: int = key(
        10, bounds=AT_LEAST_ONE, resume="free", help=("Steps between step lines in the log and metrics.jsonl.")
    )
    ckpt_every: int = key(200, bounds=AT_LEAST_ONE, resume="free", help="Steps between checkpoints.")
    keep_checkpoints: int = key(
        2,
        bounds=("an integer >= 0 (0 = keep all)", lambda v: v >= 0),
        resume="free",
        help=("the newest N complete checkpoints are kept; 0 = keep all"),
    )
    ckpt_every_epoch: bool = key(
        False,
        resume="free",
        help=(
            "Also keep a checkpoint at every epoch's end, a candidate for selection by served speed (`draftling "
            "select`), beside the newest keep_checkpoints."
        ),
    )
    keep_every_steps: int = key(
        0,
        bounds=NON_NEGATIVE,
        resume="free",
        help=(
            "Also keep, as candidates for `draftling select`, every checkpoint whose step is a multiple of this (0 = "
            "none; a multiple of ckpt_every, or it never coincides with one)."
        ),
    )
    seed: int = key(0, help="Seed of the draft's init and the batch order.")
    val_every: int = key(
        0,
        bounds=("an integer >= 0 (0 = only at the end)", lambda v: v >= 0),
        resume="free",
        help=("0 = only at the end"),
    )
    loss_on_prompt: bool = key(
        False,
        help=(
            "Also learn at prompt (user/system) positions, against the teacher's predictions there. More signal per "
            "teacher pass for small data; decoding only ever drafts replies, so validation metrics stay on assistant "
            "tokens."
        ),
    )
    teacher_cache_gb: float = key(
        0.0,
        bounds=NON_NEGATIVE,
        help=(
            "Hybrid mode: keep teacher outputs of the first epoch in host RAM (GiB budget) and reuse them afterwards "
            "instead of recomputing. 0 = fully online."
        ),
    )
    max_minutes: float = key(
        0.0,
        bounds=("a number >= 0 (0 = no limit)", lambda v: v >= 0),
        resume="free",
        help=(
            "Wall-clock budget: stop after the step that crosses it (checkpoint and final draft are still written). 0 = "
            "no limit."
        ),
    )
    fit_schedule: bool = key(
        False,
        resume="free",
        help=(
            "With max_minutes: fit the LR schedule's length to that budget from the step time measured while training "
            "(after 10 steps and at each epoch start), so the decay completes inside it instead of being cut off. The "
            "steps derived from epochs (or max_steps) stay the ceiling."
        ),
    )
    max_val_batches: int = key(16, bounds=AT_LEAST_ONE, resume="free", help="Most validation batches per evaluation.")
    data_fraction: float = key(
        1.0,
        bounds=("a number in (0, 1]", lambda v: 0 < v <= 1),
        help=(
            "Train on a seeded share of the training sequences (validation unchanged), for data-scaling curves: the "
            "shares are nested (a 25% run's sequences are all in the 50% run's), so points of one curve differ in amount"
            " only. 1.0 = all."
        ),
    )
    group_by_length: bool = key(
        True,
        help=(
            "Batch examples of similar length (sorted within groups of 16 batches, batch order shuffled): less padding, "
            "same data per epoch. false = plain random batches."
        ),
    )
    pad_to_multiple: int | Auto = key(
        AUTO,
        bounds=("an integer >= 1 or auto", lambda v: v >= 1),
        help=(
            "Right-pad each batch to a multiple of this many tokens (the padding carries no loss and changes no "
            "gradient). Flex attention builds a block mask per batch length and caches it: padded lengths are few, so "
            "masks are built once and reused. auto = flex's block size (128) when the attention is flex, else 1 "
            "(no padding)."
        ),
    )
    # --- Memory (train/ttt.py, train/optim.py, train/host_embed.py). Each is exact against
    # the plain path up to float summation order; tests/test_train_memory.py checks that.
    loss_chunk_tokens: int = key(
        2048,
        bounds=("an integer >= 0 (0 = off)", lambda v: v >= 0),
        help=(
            "Draft head, log-softmax, soft CE and argmax over chunks of this many valid positions, each recomputed in "
            "backward (checkpointed), so no [tokens, draft_vocab] fp32 tensor exists for the whole batch. 0 = off (one "
            "full-batch head)."
        ),
    )
    grad_checkpoint: bool | Auto = key(
        AUTO,
        help=(
            "Recompute each TTT step's decoder layer in backward instead of keeping its activations. auto = on for"
            " CUDA, off on CPU (there it only costs time)."
        ),
    )
    attention: str = key(
        "auto",
        choices=("auto", "sdpa", "flex"),
        help=(
            'TTT attention: "flex" (flex_attention with the TTT mask_mod, compiled; CUDA only for training: torch 2.13'
            ' has no flex backward on CPU), "sdpa" (explicit scores, any device), or "auto" = flex on CUDA, sdpa '
            "elsewhere."
        ),
    )
    optimizer_offload: bool | Auto = key(
        AUTO,
        help=(
            "fp32 master weights and AdamW moments in host RAM, stepped there; the device keeps only params and grads. "
            "auto = on for CUDA when the fp32 optimizer state (12 bytes/param) exceeds 2% of the device's memory, "
            "off otherwise and on CPU."
        ),
    )
    embedding_on_host: bool = key(
        False,
        help=(
            "The target's embedding table in host RAM; per batch only the rows of its ids go to the device. Saves device"
            " memory only when the target is not resident (offline teacher); off by default."
        ),
    )
    build_on_host: bool = key(
        True,
        help=(
            "Build order: build the draft on the host and move it (cast to draft_dtype first) after the teacher has "
            "claimed its memory, so no fp32 build copy ever sits on the device. false = move it to the device as built, "
            "before the cast. (No DDP/FSDP wrapper at world size 1 is not a flag: one process always trains the bare "
            "module.)"
        ),
    )
    draft_dtype: str = key(
        "auto",
        choices=("auto", "float32", "bfloat16"),
        help=(
            'dtype of the draft\'s device params: "float32", "bfloat16", or "auto" = bfloat16 when the optimizer is'
            " offloaded (its fp32 masters keep full precision on the host), else float32."
        ),
    )
    compile: bool | Auto = key(
        AUTO,
        help=(
            "torch.compile each checkpointed loss chunk (head, softmaxes, soft CE, argmax fused into a few kernels; "
            "needs loss_chunk_tokens > 0) and the decoder layer around its attention (norms, projections, RoPE, MLP). "
            "auto = on for CUDA, off on CPU."
        ),
    )
    compile_teacher: bool | Auto = key(
        AUTO,
        help=(
            "torch.compile the teacher's decoder layers for its forward (hooks stay eager). auto = as ``compile``, "
            "except off for a quantized teacher (its library brings its own kernels)."
        ),
    )
    compute_dtype: str = key(
        "auto",
        choices=("auto", "float32", "bfloat16", "bfloat16_if_fast"),
        help=(
            'Compute dtype of the draft\'s forward: "bfloat16" runs it under torch.autocast (bf16 matmuls and attention'
            " over the params' own dtype; softmaxes and the loss stay fp32), \"float32\" runs it in the params' own "
            'dtype, "auto" = bfloat16 on CUDA over fp32 params (bf16 params, as with optimizer offload, already '
            'compute in bf16), float32 elsewhere; "bfloat16_if_fast" = bfloat16 where this device multiplies bf16 '
            "faster (see hardware.py)."
        ),
    )
    memory_policy: str = key(
        "auto",
        choices=("auto", "config"),
        help=(
            '"auto": on CUDA, when train/memory.py estimates the draft\'s peak without recomputation (grad_checkpoint '
            "off unless set) and with loss chunks of 16384 rows under half the free device memory, train that way "
            "(faster: a small draft is bound by host overhead, and each recompute and each chunk adds to it); otherwise,"
            ' and on CPU, as configured. "config": always as configured.'
        ),
    )
    parallel: str = key(
        "ddp",
        choices=("ddp", "fsdp"),
        help=(
            'Under torchrun: "ddp" replicates the draft (DistributedDataParallel); "fsdp" shards it and its '
            "optimizer state with FSDP2 fully_shard, for drafts too big to replicate. batch_size stays the global batch "
            "at any world size."
        ),
    )
    # --- Convergence (train/convergence.py). Every smoke_every steps (0 = off) a greedy
    # chain-3-1-4 smoke bench over the prompt set smoke_prompts ("set:NAME", shipped, or a jsonl
    # path), smoke_max_new_tokens per prompt, logs tau per workload to metrics.jsonl: a trend, not a
    # release number. When the mean tau stays inside its noise band (estimated from the per-prompt
    # taus) for convergence_checks checks in a row, the run logs "converged at X% of epoch N";
    # with stop_on_convergence (`train --stop-on-convergence`) it also stops there, head written.
    # A check decodes 14 prompts through the target: seconds on a GPU, minutes on a 2-core CPU.
    smoke_every: int = key(
        0, bounds=("an integer >= 0 (0 = off)", lambda v: v >= 0), help=("Steps between smoke-bench checks (0 = off).")
    )
    smoke_max_share: float = key(
        0.05,
        bounds=("a number in [0, 1) (0 = never adapt)", lambda v: 0 <= v < 1),
        help=(
            "Where a check's measured seconds exceed this share of the training time between checks, the run checks "
            "less often (every multiple of smoke_every that fits) and logs the numbers; 0 = never adapt."
        ),
    )
    smoke_prompts: str = key(
        "set:smoke-v1", help='The smoke bench\'s prompt set: "set:NAME" (shipped) or a jsonl path.'
    )
    smoke_max_new_tokens: int = key(32, bounds=AT_LEAST_ONE, help="New tokens per smoke-bench prompt.")
    smoke_rows: int = key(
        16,
        bounds=AT_LEAST_ONE,
        help=(
            "Smoke prompts decoded at once, each in its own row of the target's static cache, which lives through the "
            "run: 1 decodes them one at a time in the least memory. On the H200 a check of 14 prompts one at a time took "
            "23-32 s, a third of a 2,394-step run's wall time."
        ),
    )
    convergence_checks: int = key(
        3,
        bounds=AT_LEAST_ONE,
        help=('Checks in a row whose mean tau stays inside its noise band before the run logs "converged".'),
    )
    stop_on_convergence: bool = key(
        False,
        resume="free",
        flag="--stop-on-convergence",
        help=(
            "Stop cleanly (head written) once converged: the smoke bench's tau stays inside its noise band for "
            "convergence_checks checks in a row, above a floor tau (train/convergence.py's FLOOR_TAU: a draft that "
            'accepts next to nothing never converges); needs smoke_every > 0. Without it the run only logs "converged '
            'at X% of epoch N".'
        ),
    )
    # Experiment trackers that get every metrics record besides metrics.jsonl and TensorBoard
    # (their library must be installed); empty = the env var DRAFTLING_TRACKERS, else none.
    trackers: list[str] = key(
        factory=list,
        resume="free",
        bounds=(
            "a list of wandb, mlflow (e.g. [wandb])",
            lambda v: isinstance(v, list) and all(t in ("wandb", "mlflow") for t in v),
        ),
        help="Trackers that get every metrics record (wandb, mlflow); empty: DRAFTLING_TRACKERS, else none.",
    )

    def __post_init__(self):
        check_bounds("train", self, bounds_of(TrainConfig, SMOKE_KEYS))
        if self.stop_on_convergence and not self.smoke_every:
            raise ConfigError(
                "train.stop_on_convergence needs the smoke bench: set train.smoke_every "
                "(steps between checks), e.g. train.smoke_every=200"
            )
        if not self.smoke_prompts:
            raise ConfigError("train.smoke_prompts: expected a prompt set, e.g. set:smoke-v1 or a jsonl path")
        check_bounds("train", self, {k: v for k, v in bounds_of(TrainConfig).items() if k not in SMOKE_KEYS})
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.betas={list(self.betas)}: expected two numbers in [0, 1)")
        check_choices("train", self, choices_of(TrainConfig))


SMOKE_KEYS = ("smoke_every", "smoke_max_new_tokens", "smoke_rows", "convergence_checks", "smoke_max_share")
# The names enum-like string fields accept, checked when a config is built (not where used).
TRAIN_CHOICES = choices_of(TrainConfig)
