"""Typed run config: nested dataclasses, loaded from YAML, overridden with ``a.b=value``.

A run saves the config it actually used as ``config.yaml`` in its directory, so every
number a run reports can be traced to the settings that produced it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from draftling.errors import ConfigError

# Bounds checked when a config is built (so a bad value fails before any model loads):
# field -> (what is expected, test). None passes where a field allows it.
POSITIVE = ("a number > 0", lambda v: v > 0)
AT_LEAST_ONE = ("an integer >= 1", lambda v: v >= 1)
NON_NEGATIVE = ("a number >= 0", lambda v: v >= 0)
FRACTION = ("a number in [0, 1]", lambda v: 0 <= v <= 1)
SPLIT_KEYS = ("auto", "id", "task", "source")  # data.split_key (see data/split.py)


def check_bounds(section: str, obj, rules: dict) -> None:
    for name, (expected, ok) in rules.items():
        value = getattr(obj, name)
        if value is not None and not ok(value):
            raise ConfigError(f"{section + '.' if section else ''}{name}={value!r}: expected {expected}")


# The names enum-like string fields accept, checked when a config is built (not where used).
TRAIN_CHOICES = {
    "attention": ("auto", "sdpa", "flex"),
    "compute_dtype": ("auto", "float32", "bfloat16", "bfloat16_if_fast"),
    "memory_policy": ("auto", "config"),
    "parallel": ("ddp", "fsdp"),
    "draft_dtype": ("auto", "float32", "bfloat16"),
}


def check_choices(section: str, obj, choices: dict) -> None:
    """None passes where a field allows it (its type says so; an unset choice)."""
    for name, allowed in choices.items():
        value = getattr(obj, name)
        if value is not None and value not in allowed:
            raise ConfigError(f"{section}.{name}={value!r}: expected one of {', '.join(allowed)}")


def parse_size(text: str) -> int:
    """'80GiB', '24GB', '24G', '512MiB', '141' (GiB) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r}: expected e.g. 80GiB, 24GB or 141 (GiB)")
    value, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    if not unit:
        return int(value * 2**30)
    power = "KMGT".index(unit) + 1
    return int(value * (1024 if binary or not m.group(0).strip().upper().endswith("B") else 1000) ** power)


# --- device maps (device_map, max_memory): checked here, used by target/devmap.py ---------------

DEVICE_MAP_MODES = ("auto", "balanced")


def device_name(value, where: str) -> int | str:
    """A device as accelerate names it: a GPU index (0, "1", "cuda:1"; "cuda" is 0), cpu, disk or mps."""
    text = str(value).strip()
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if text.isdigit() and not isinstance(value, bool):
        return int(text)
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return int(text[5:] or 0)
    if text in ("cpu", "disk", "mps"):
        return text
    raise ConfigError(f"{where}: device {value!r}: expected a GPU index (0, cuda:1), cpu or disk")


def device_map_value(value: str | None) -> str | dict | None:
    """``device_map`` resolved: None, "auto", "balanced", or {module name: device} read from
    the JSON file it names (devices as ``device_name`` gives them)."""
    if value is None or value in DEVICE_MAP_MODES:
        return value
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"device_map={value!r}: expected auto, balanced or a JSON file mapping module "
                          "names to devices (no such file)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"device_map {path}: not valid JSON: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"device_map {path}: expected a JSON object of module names to devices, e.g. "
                          '{"model.layers.0": 0, "model.layers.1": "cpu"}')
    return {name: device_name(device, f"device_map {path}: {name!r}") for name, device in data.items()}


def max_memory_bytes(value: dict | None) -> dict | None:
    """``max_memory`` resolved: {device: bytes}, sizes as ``parse_size`` reads them."""
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"max_memory={value!r}: expected a mapping of devices to sizes, e.g. {{0: 40GiB, cpu: 200GiB}}")
    out = {}
    for device, size in value.items():
        where = f"max_memory[{device!r}]"
        try:
            out[device_name(device, where)] = parse_size(str(size))
        except ValueError:
            raise ConfigError(f"{where}={size!r}: expected a size, e.g. 40GiB") from None
    return out


@dataclass
class RegenConfig:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    batch_size: int = 16
    seed: int = 0
    # Prefill long prompts in pieces of about this many tokens (rows x columns) per forward.
    # On the CPU a whole batch of long prompts at once is memory-bound in its elementwise ops:
    # a batch of 53 prompts (7121 tokens) took 63 s in one forward and 38 s in pieces of 4096,
    # same replies (lab/experiments/gguf_load_and_chunked_prefill.py). null = 4096 on the
    # CPU and off elsewhere; 0 = off.
    prefill_chunk_tokens: int | None = None
    # dtype of the model that writes the TRAINING replies (and their kept states): null = the
    # target's own; "bfloat16_if_fast" = bf16 where this device multiplies bf16 faster than fp32
    # (CUDA; a CPU with AVX512-BF16 or AMX, by a timed probe, see hardware.py), else the target's
    # own; or a dtype name. Validation replies always come from the target's own dtype, so its
    # metrics score the target as it is served.
    dtype: str | None = None
    # Regenerate through an OpenAI-compatible server (vLLM / SGLang `serve`) instead of the local
    # target, e.g. "http://localhost:8000". Then only the target's tokenizer is loaded.
    server_url: str | None = None
    server_model: str | None = None  # null = the one model the server lists
    concurrency: int = 16  # requests in flight; the server batches them
    api_key_env: str = "OPENAI_API_KEY"  # env var holding the key (the key is never written)
    request_timeout_s: float = 600.0
    max_retries: int = 5  # on connection errors, HTTP 429 and 5xx
    # Write replies (greedy or sampled) with the batched plain engine (engine/batch.py) instead of
    # HF generate: data.regen.batch_size engine rows, finished rows refilled. auto = on with CUDA,
    # without kept teacher states, for an architecture the engine serves; on = the same but
    # refused (with the reason) where it cannot; off = HF generate.
    engine: str = "auto"
    # Replies per TRAINING prompt: the first at `temperature` (greedy by default), each further
    # one sampled at `sample_temperature` (top_p as set; seed + k), its temperature in the
    # reply's provenance; more of the target's own distribution per prompt. Validation keeps one.
    # The sampled passes take the same writer as the first (data.regen.engine).
    samples_per_prompt: int = 1
    sample_temperature: float = 0.8

    def __post_init__(self):
        check_choices("data.regen", self, {"engine": ("auto", "on", "off")})
        check_bounds("data.regen", self, {
            "samples_per_prompt": AT_LEAST_ONE, "sample_temperature": POSITIVE,
            "max_new_tokens": AT_LEAST_ONE, "temperature": NON_NEGATIVE,
            "top_p": ("a number in (0, 1]", lambda v: 0 < v <= 1), "batch_size": AT_LEAST_ONE,
            "prefill_chunk_tokens": NON_NEGATIVE, "concurrency": AT_LEAST_ONE,
            "request_timeout_s": POSITIVE, "max_retries": NON_NEGATIVE})


@dataclass
class DataConfig:
    # Prompt specs (data/sources.py): a jsonl file (project schema, ShareGPT or OpenAI messages),
    # "starter:NAME" (shipped with the package), "shared:NAME" (the development corpus),
    # "hf:NAME[:CONFIG][@SPLIT]" or a save_to_disk folder (the `datasets` extra).
    prompts: list[str] = field(default_factory=lambda: [
        "shared:sharegpt.jsonl", "shared:instruct.jsonl", "shared:code_mbpp.jsonl",
        "shared:math_gsm8k_train.jsonl", "shared:summarize.jsonl"])
    max_prompts_per_file: int = 0  # 0 = all
    # Per-file caps that replace max_prompts_per_file for the files they name (keys as listed
    # in ``prompts``), e.g. to keep a large file from dominating the mix: {"shared:x.jsonl": 3000}.
    max_prompts_by_file: dict[str, int] = field(default_factory=dict)
    # Prompt files whose conversations must not be trained on, e.g. "set:v1" (the release
    # bench's prompts): a conversation is dropped if its id matches or any of its user turns
    # repeats one of theirs, so the bench stays out of distribution.
    exclude: list[str] = field(default_factory=list)
    # Files of conversation ids never to train on (`data --exclude-ids FILE`), e.g. the tasks
    # of a serving replay set: one id per line ('#' comments allowed) or a jsonl with "id".
    exclude_ids: list[str] = field(default_factory=list)
    # Agent rollouts: every assistant turn of a multi-turn conversation becomes a prompt of its
    # own, its original prefix as it is (user turns, tool results, earlier replies) and the
    # target's reply; only that reply is a loss token. The split stays by the conversation's task.
    rollouts: bool = False
    # With rollouts: at most this many of a conversation's assistant turns (0 = all), a seeded
    # sample of those whose prefix fits data.max_tokens - data.regen.max_new_tokens; prefixes
    # grow with the turn, so all turns of a long trajectory cost quadratically in its length.
    rollout_max_turns: int = 0
    val_fraction: float = 0.05
    # "id": each conversation is its own task; "task": a record's `task` field, or NAME-TASK for
    # ids NAME-TASK-TRIAL (tau-bench's trials of one task stay on one side); "source": per file;
    # "auto": task when any record carries a task identity, else id (data/split.py
    # resolve_split_key; the data summary names the key chosen and why).
    split_key: str = "auto"
    drop_tool_calls: bool = False
    min_tokens: int = 8  # drop conversations shorter than this (in target tokens)
    max_tokens: int = 2048  # truncate longer ones
    seed: int = 0
    regen: RegenConfig = field(default_factory=RegenConfig)
    # Keep the target's aux and final states from local regeneration (data/states.py), so
    # training skips its teacher forward on those tokens. Costs 4*H values per token on
    # disk (SmolLM2-135M in fp32: 9 KB); worth it where the teacher forward is dear (CPU).
    keep_teacher_states: bool = False

    def __post_init__(self):
        check_bounds("data", self, {
            "max_prompts_per_file": ("an integer >= 0 (0 = all)", lambda v: v >= 0),
            "val_fraction": ("a number in [0, 1)", lambda v: 0 <= v < 1),
            "min_tokens": NON_NEGATIVE, "max_tokens": AT_LEAST_ONE, "rollout_max_turns": NON_NEGATIVE,
            "split_key": (f"one of {', '.join(SPLIT_KEYS)}", lambda v: v in SPLIT_KEYS)})
        if self.min_tokens > self.max_tokens:
            raise ConfigError(f"data.min_tokens={self.min_tokens} is above data.max_tokens={self.max_tokens}")
        for spec, cap in self.max_prompts_by_file.items():
            if cap < 0:
                raise ConfigError(f"data.max_prompts_by_file[{spec!r}]={cap}: expected an integer >= 0 (0 = all)")
        unknown = sorted(set(self.max_prompts_by_file) - set(self.prompts))
        if unknown:
            raise ConfigError(f"data.max_prompts_by_file: {unknown} not in data.prompts {self.prompts}")

    def prompt_cap(self, spec: str) -> int:
        """How many prompts to sample from the file ``spec`` (0 = all)."""
        return self.max_prompts_by_file.get(spec, self.max_prompts_per_file)


@dataclass
class VocabConfig:
    size: int = 32000
    # Rank tokens by their share of the reply tokens plus this weight times their share of
    # the prompt text in the prompt files (every prompt but validation's; counted by `data`).
    # 0 = replies only. A few hundred replies miss tokens that replies copy from their
    # prompts, which the target often predicts with high confidence.
    prompt_weight: float = 0.0

    def __post_init__(self):
        check_bounds("vocab", self, {"size": AT_LEAST_ONE, "prompt_weight": NON_NEGATIVE})


@dataclass
class DraftConfig:
    # Copy the target's final norm and head rows for the draft vocab into the head. Off by
    # default: on SmolLM2 it started confidently wrong and learned slower than a fresh head.
    init_from_target: bool = False
    # The draft layer's MLP width; null = the target's intermediate_size (the EAGLE-3 shape).
    # A narrower MLP trains faster and overfits less when there is little data (the CPU profile).
    intermediate_size: int | None = None
    # Start from this head instead of a new one (`train --init-from DIR`: a draftling run,
    # draft or checkpoint, an SGLang/EAGLE export or a speculators export). It keeps its own
    # vocab map unless rebuild_vocab (train/warmstart.py).
    init_from: str | None = None
    rebuild_vocab: bool = False
    # Sliding-window attention: each draft query sees the context keys of its last `window`
    # positions (its own included), so the draft's cost stays flat in context length; 0 = full
    # causal attention. Kept in the draft's config (sliding_window), which training, the engine
    # and the exports read.
    window: int = 0

    def __post_init__(self):
        check_bounds("draft", self, {"window": (
            "an integer >= 0 (0 = full attention)",
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)})


@dataclass
class TrainConfig:
    ttt_steps: int = 7
    step_weight_decay: float = 0.8  # loss weight of TTT step j is decay**j
    epochs: float = 1.0
    max_steps: int = 0  # 0 = derived from epochs
    batch_size: int = 8  # sequences per optimizer step
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    log_every: int = 10
    ckpt_every: int = 200
    keep_checkpoints: int = 2  # the newest N complete checkpoints are kept; 0 = keep all
    # Candidates for selection by served speed (`draftling select`), kept beside the newest N:
    # a checkpoint at every epoch's end, and every checkpoint whose step is a multiple of this
    # (0 = none; a multiple of ckpt_every, or it never coincides with one).
    ckpt_every_epoch: bool = False
    keep_every_steps: int = 0
    seed: int = 0
    val_every: int = 0  # 0 = only at the end
    # Also learn at prompt (user/system) positions, against the teacher's predictions there.
    # More signal per teacher pass for small data; decoding only ever drafts replies, so
    # validation metrics stay on assistant tokens.
    loss_on_prompt: bool = False
    # Hybrid mode: keep teacher outputs of the first epoch in host RAM (GiB budget) and
    # reuse them afterwards instead of recomputing. 0 = fully online.
    teacher_cache_gb: float = 0.0
    # Wall-clock budget: stop after the step that crosses it (checkpoint and final draft
    # are still written). 0 = no limit.
    max_minutes: float = 0.0
    # With max_minutes: fit the LR schedule's length to that budget from the step time measured
    # while training (after 10 steps and at each epoch start), so the decay completes inside it
    # instead of being cut off. The steps derived from epochs (or max_steps) stay the ceiling.
    fit_schedule: bool = False
    max_val_batches: int = 16
    # Train on a seeded share of the training sequences (validation unchanged), for data-scaling
    # curves: the shares are nested (a 25% run's sequences are all in the 50% run's), so points of
    # one curve differ in amount only. 1.0 = all.
    data_fraction: float = 1.0
    # Batch examples of similar length (sorted within groups of 16 batches, batch order
    # shuffled): less padding, same data per epoch. false = plain random batches.
    group_by_length: bool = True
    # Right-pad each batch to a multiple of this many tokens (the padding carries no loss and
    # changes no gradient). Flex attention builds a block mask per batch length and caches it:
    # padded lengths are few, so masks are built once and reused. null = auto: flex's block
    # size (128) when the attention is flex, else 1 (no padding).
    pad_to_multiple: int | None = None
    # --- Memory (train/ttt.py, train/optim.py, train/host_embed.py). Each is exact against
    # the plain path up to float summation order; tests/test_train_memory.py checks that.
    # Draft head, log-softmax, soft CE and argmax over chunks of this many valid positions,
    # each recomputed in backward (checkpointed), so no [tokens, draft_vocab] fp32 tensor
    # exists for the whole batch. 0 = off (one full-batch head).
    loss_chunk_tokens: int = 2048
    # Recompute each TTT step's decoder layer in backward instead of keeping its
    # activations. null = auto: on for CUDA, off on CPU (there it only costs time).
    grad_checkpoint: bool | None = None
    # TTT attention: "flex" (flex_attention with the TTT mask_mod, compiled; CUDA only for
    # training: torch 2.13 has no flex backward on CPU), "sdpa" (explicit scores, any
    # device), or "auto" = flex on CUDA, sdpa elsewhere.
    attention: str = "auto"
    # fp32 master weights and AdamW moments in host RAM, stepped there; the device keeps
    # only params and grads. null = auto: on for CUDA when the fp32 optimizer state (12
    # bytes/param) exceeds 2% of the device's memory, off otherwise and on CPU.
    optimizer_offload: bool | None = None
    # The target's embedding table in host RAM; per batch only the rows of its ids go to
    # the device. Saves device memory only when the target is not resident (offline
    # teacher); off by default.
    embedding_on_host: bool = False
    # Build order: build the draft on the host and move it (cast to draft_dtype first) after
    # the teacher has claimed its memory, so no fp32 build copy ever sits on the device.
    # false = move it to the device as built, before the cast. (No DDP/FSDP wrapper at world
    # size 1 is not a flag: one process always trains the bare module.)
    build_on_host: bool = True
    # dtype of the draft's device params: "float32", "bfloat16", or "auto" = bfloat16 when
    # the optimizer is offloaded (its fp32 masters keep full precision on the host), else
    # float32.
    draft_dtype: str = "auto"
    # torch.compile each checkpointed loss chunk (head, softmaxes, soft CE, argmax fused into a
    # few kernels; needs loss_chunk_tokens > 0) and the decoder layer around its attention
    # (norms, projections, RoPE, MLP). null = auto: on for CUDA, off on CPU.
    compile: bool | None = None
    # torch.compile the teacher's decoder layers for its forward (hooks stay eager).
    # null = auto: follows ``compile``.
    compile_teacher: bool | None = None
    # Compute dtype of the draft's forward: "bfloat16" runs it under torch.autocast (bf16
    # matmuls and attention over the params' own dtype; softmaxes and the loss stay fp32),
    # "float32" runs it in the params' own dtype, "auto" = bfloat16 on CUDA over fp32 params
    # (bf16 params, as with optimizer offload, already compute in bf16), float32 elsewhere;
    # "bfloat16_if_fast" = bfloat16 where this device multiplies bf16 faster (see hardware.py).
    compute_dtype: str = "auto"
    # "auto": on CUDA, when train/memory.py estimates the draft's peak without recomputation
    # (grad_checkpoint off unless set) and with loss chunks of 16384 rows under half the free
    # device memory, train that way (faster: a small draft is bound by host overhead, and each
    # recompute and each chunk adds to it); otherwise, and on CPU, as configured. "config":
    # always as configured.
    memory_policy: str = "auto"
    # Under torchrun: "ddp" replicates the draft (DistributedDataParallel); "fsdp" shards
    # it and its optimizer state with FSDP2 fully_shard, for drafts too big to replicate.
    # batch_size stays the global batch at any world size.
    parallel: str = "ddp"
    # --- Convergence (train/convergence.py). Every smoke_every steps (0 = off) a greedy
    # chain-3-1-4 smoke bench over the prompt set smoke_prompts ("set:NAME", shipped, or a jsonl
    # path), smoke_max_new_tokens per prompt, logs tau per workload to metrics.jsonl: a trend, not a
    # release number. When the mean tau stays inside its noise band (estimated from the per-prompt
    # taus) for convergence_checks checks in a row, the run logs "converged at X% of epoch N";
    # with stop_on_convergence (`train --stop-on-convergence`) it also stops there, head written.
    # A check decodes 14 prompts through the target: seconds on a GPU, minutes on a 2-core CPU.
    # smoke_rows prompts decode at once, each in its own row of the target's static cache, which
    # lives through the run: 1 decodes them one at a time in the least memory. On the H200 a
    # check of 14 prompts one at a time took 23-32 s, a third of a 2,394-step run's wall time.
    # smoke_max_share: where a check's measured seconds exceed this share of the training time
    # between checks, the run checks less often (every multiple of smoke_every that fits) and logs
    # the numbers; 0 = never adapt.
    smoke_every: int = 0
    smoke_max_share: float = 0.05
    smoke_prompts: str = "set:smoke-v1"
    smoke_max_new_tokens: int = 32
    smoke_rows: int = 16
    convergence_checks: int = 3
    stop_on_convergence: bool = False
    # Experiment trackers that get every metrics record besides metrics.jsonl and TensorBoard:
    # any of wandb, mlflow (their library must be installed); empty = the env var
    # DRAFTLING_TRACKERS (comma-separated), else none. See trackers.py.
    trackers: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.trackers, list) or not all(t in ("wandb", "mlflow") for t in self.trackers):
            raise ConfigError(f"train.trackers={self.trackers!r}: expected a list of wandb, mlflow (e.g. [wandb])")
        check_bounds("train", self, {
            "smoke_every": ("an integer >= 0 (0 = off)", lambda v: v >= 0),
            "smoke_max_new_tokens": AT_LEAST_ONE, "smoke_rows": AT_LEAST_ONE, "convergence_checks": AT_LEAST_ONE,
            "smoke_max_share": ("a number in [0, 1) (0 = never adapt)", lambda v: 0 <= v < 1)})
        if self.stop_on_convergence and not self.smoke_every:
            raise ConfigError("train.stop_on_convergence needs the smoke bench: set train.smoke_every "
                              "(steps between checks), e.g. train.smoke_every=200")
        if not self.smoke_prompts:
            raise ConfigError("train.smoke_prompts: expected a prompt set, e.g. set:smoke-v1 or a jsonl path")
        check_bounds("train", self, {
            "ttt_steps": AT_LEAST_ONE, "step_weight_decay": POSITIVE, "epochs": POSITIVE,
            "data_fraction": ("a number in (0, 1]", lambda v: 0 < v <= 1),
            "max_steps": ("an integer >= 0 (0 = from epochs)", lambda v: v >= 0), "batch_size": AT_LEAST_ONE,
            "lr": POSITIVE, "min_lr_ratio": FRACTION, "warmup_steps": NON_NEGATIVE,
            "weight_decay": NON_NEGATIVE, "grad_clip": POSITIVE, "log_every": AT_LEAST_ONE,
            "ckpt_every": AT_LEAST_ONE, "keep_checkpoints": ("an integer >= 0 (0 = keep all)", lambda v: v >= 0),
            "keep_every_steps": NON_NEGATIVE,
            "val_every": ("an integer >= 0 (0 = only at the end)", lambda v: v >= 0),
            "teacher_cache_gb": NON_NEGATIVE, "max_minutes": ("a number >= 0 (0 = no limit)", lambda v: v >= 0),
            "max_val_batches": AT_LEAST_ONE, "loss_chunk_tokens": ("an integer >= 0 (0 = off)", lambda v: v >= 0),
            "pad_to_multiple": ("an integer >= 1 or null (auto)", lambda v: v >= 1)})
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.betas={list(self.betas)}: expected two numbers in [0, 1)")
        check_choices("train", self, TRAIN_CHOICES)


# The release bench's baselines and the decode engine's attention kinds (sdpa: SDPA with a
# boolean mask; matmul: two matmuls and a softmax in the model's dtype; exact: the same with
# float64 sums, whose logits do not depend on where in the cache a token's context sits, which
# makes tree output equal plain output in bf16). Named here, the lowest stage, so that a config
# is checked when it loads; bench/release.py and engine/options.py take them from here.
RELEASE_BASELINES = ("engine_plain", "hf_static", "hf_prompt_lookup", "hf_eager")
RELEASE_SAMPLED_TEMPERATURES = (0.7, 1.0)  # how chat is served: the sampled figures beside the greedy ones
ENGINE_ATTENTION = ("sdpa", "matmul", "exact")
BENCH_CHOICES = {"attention": ("auto", *ENGINE_ATTENTION)}


@dataclass
class BenchConfig:
    num_prompts: int = 8
    max_new_tokens: int = 256
    configs: list[str] = field(default_factory=lambda: ["chain-3-1-4"])
    # 0 = greedy, where speculative output must equal plain output token for token. Above 0
    # both decodes sample (lossless verification), so only tau and speed are comparable.
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int = 0  # sampling: prompt i uses seed + i, the same for plain and every config
    # --- The release bench (`bench --release`, bench/release.py); the simple bench ignores these.
    # Its protocol sets configs and max_new_tokens itself (the three DEFAULT_CONFIGS, 256 new
    # tokens) over whatever a profile gives the simple bench; flags and overrides still win.
    prompt_set: str = "v1"  # a built-in set name (v1, ...) or a jsonl path
    baselines: list[str] = field(default_factory=lambda: list(RELEASE_BASELINES))  # engine_plain always runs
    baseline_prompts_per_workload: int | None = None  # the slow HF baselines on the first N of each; null = all
    results_dir: str = "."  # each run writes a folder of its own in here; "." = the working directory
    tag: str | None = None  # suffix of the run's folder and file names
    engine_compile: bool | None = None  # compile the target's and draft's layers; null = auto: on with CUDA
    # Pad every target pass to this many queries, so plain and verify passes share kernels
    # (0 = off); null = auto: the largest config's draft tokens on CUDA, off on CPU.
    query_pad: int | None = None
    attention: str = "auto"  # one of ENGINE_ATTENTION; auto = exact on CUDA, sdpa on CPU
    round_timing: bool | None = None  # also time each round's phases; null = on CUDA
    # Also decode sampled at each of these temperatures (plain and every config); [] = greedy only.
    sampled_temperatures: list[float] = field(default_factory=lambda: list(RELEASE_SAMPLED_TEMPERATURES))
    # The concurrency sweep (`bench --concurrency`, bench/concurrency.py): its levels, e.g.
    # [1, 2, 4, 8, 16, 32, 64]; null = no sweep. It uses prompt_set, configs, max_new_tokens and
    # results_dir above.
    concurrency: list[int] | None = None

    def __post_init__(self):
        check_bounds("bench", self, {"num_prompts": AT_LEAST_ONE, "max_new_tokens": AT_LEAST_ONE,
                                     "baseline_prompts_per_workload": ("an integer >= 1 (null = all)", lambda v: v >= 1),
                                     "query_pad": ("an integer >= 0 (0 = off, null = auto)", lambda v: v >= 0)})
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0
                   for t in self.sampled_temperatures):
            raise ConfigError(f"bench.sampled_temperatures={self.sampled_temperatures!r}: expected a list of "
                              "numbers > 0, e.g. [0.7, 1.0], or [] for greedy only")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"bench: temperature {self.temperature} must be >= 0, top_k {self.top_k} "
                              f">= 0 and top_p {self.top_p} in (0, 1]")
        check_choices("bench", self, BENCH_CHOICES)
        if self.concurrency is not None and (not self.concurrency or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in self.concurrency)):
            raise ConfigError(f"bench.concurrency={self.concurrency!r}: expected a list of integers >= 1, "
                              "e.g. 1,2,4,8")
        unknown = [b for b in self.baselines if b not in RELEASE_BASELINES]
        if unknown:
            raise ConfigError(f"bench.baselines: unknown baselines {unknown}; expected some of "
                              f"{', '.join(RELEASE_BASELINES)}")


# The storage dtypes `extract` writes the draft-vocab logits in (train/offline.py).
EXTRACT_CHOICES = {"logits_dtype": ("float32", "bfloat16", "float16")}


@dataclass
class ExtractConfig:
    """`draftling extract` (train/offline.py): how the offline teacher cache is written."""

    shard_size: int = 256  # sequences per shard
    batch_size: int = 8  # sequences per teacher forward pass
    # Storage dtype of the draft-vocab logits: float32, bfloat16 or float16; null = the
    # target's compute dtype (lossless). They dominate the cache's size.
    logits_dtype: str | None = None

    def __post_init__(self):
        check_bounds("extract", self, {"shard_size": AT_LEAST_ONE, "batch_size": AT_LEAST_ONE})
        check_choices("extract", self, EXTRACT_CHOICES)


@dataclass
class RunConfig:
    target: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    device: str = "auto"
    aux_layer_ids: list[int] | None = None
    chat_template: str | None = None
    # Quantize the target on load (bnb-4bit, bnb-8bit, quanto-int8, quanto-int4, torchao-int8);
    # needs the matching optional extra. null = load as stored. See docs/teachers.md.
    quantization: str | None = None
    # Spread the target over devices with accelerate's big-model dispatch (target/devmap.py):
    # "auto" or "balanced" (accelerate fills the GPUs, then host RAM, then disk), or a JSON file
    # of module names to devices ({"model.layers.20": 1, "lm_head": "cpu"}; a GPU index, "cuda:1",
    # "cpu" or "disk"). null = the whole target on `device`. The draft trains on `device`, which
    # must hold the target's input embedding; aux states are gathered there.
    device_map: str | None = None
    # With device_map: the most of the target each device may hold, e.g. {0: 40GiB, cpu: 200GiB}
    # (keys: a GPU index, cpu, disk), so the training device keeps room for the draft. null =
    # accelerate's default (what each device has free).
    max_memory: dict | None = None
    # Where disk-offloaded weights are written, in a temporary folder removed with the target;
    # null = $TMPDIR. (A safetensors checkpoint's offloaded weights are read where they are.)
    offload_folder: str | None = None
    # Wall-clock budget of a whole `draftling quickstart` run, in minutes (0 = none): training
    # stops early enough to leave room for the bench and the export, so a slower machine
    # trains fewer steps instead of overrunning. train.max_minutes still caps training alone.
    wall_minutes: float = 0.0
    data: DataConfig = field(default_factory=DataConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)

    def __post_init__(self):
        check_bounds("", self, {"wall_minutes": ("a number >= 0 (0 = no budget)", lambda v: v >= 0)})
        device_map_value(self.device_map)
        max_memory_bytes(self.max_memory)
        if self.max_memory is not None and self.device_map not in DEVICE_MAP_MODES:
            raise ConfigError(f"max_memory applies with device_map auto or balanced, not {self.device_map!r} "
                              "(a FILE places every module itself)")


_BOOL_WORDS = {"on": True, "yes": True, "off": False, "no": False}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        key_tp, value_tp = args or (Any, Any)
        return {_coerce(k, key_tp, where): _coerce(v, value_tp, f"{where}[{k!r}]") for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if tp is bool:
        value = _BOOL_WORDS.get(value.lower(), value) if isinstance(value, str) else value
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = tp(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if tp is int and float(value) != int(value):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def from_dict(cls, data: dict, where: str = "config"):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(names)}")
    return cls(**{k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()})


def to_dict(cfg) -> dict:
    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans: only true/false. PyYAML's 1.1 rules also read on/off and
    yes/no as booleans, so `data.regen.engine=off` arrived as False; a bool field still takes
    them (``_BOOL_WORDS``)."""


_Loader.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
                                   for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides; values are parsed as YAML (numbers, lists, bools)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=3e-4")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = yaml_load(raw)
    return data


def builtin_config(name: str) -> Path:
    path = resources.files("draftling") / "configs" / f"{name}.yaml"
    return Path(str(path))


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults < YAML file (a path or a built-in name like ``quickstart_cpu``) < overrides."""
    data: dict = {}
    if path:
        p = Path(path)
        if not p.is_file() and builtin_config(str(path)).is_file():
            p = builtin_config(str(path))
        if not p.is_file():
            raise ConfigError(f"config {path}: file not found")
        try:
            data = yaml_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}".replace("\n", " ")) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
    # Round-trip through the defaults so overrides of nested keys merge, not replace.
    merged = _deep_merge(to_dict(RunConfig()), data)
    merged = apply_overrides(merged, overrides or [])
    return from_dict(RunConfig, merged, where=str(path or "config"))


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def save_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    from draftling.io import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
