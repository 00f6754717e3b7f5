"""Training-step bench: peak GPU memory of a 36B-class draft under the memory options, with
ablations and sequence scaling, and training throughput against a real small teacher.

    python3 lab/benches/train_bench.py --out FILE.json [--target GGUF_PATH] [--quick]

Memory (teacher stubbed by random tensors): a draft of a 36B-class target's shape (hidden
5120, intermediate 27648, 64 heads, 8 KV heads, head_dim 128, vocab 155136, draft vocab
32000) is built and placed exactly as ``trainer.train`` does it (``build_draft`` on the
host, ``place_draft``, ``distributed.wrap``, ``build_optimizer``), and the trainer's own step
runs (``batches.train_step``: the teacher's outputs, here served by a stub source, the TTT
unroll, backward, grad clip, optimizer step). The peak is
``torch.cuda.max_memory_allocated`` over the whole run (placement and steps). Then each
feature is turned off in turn, and the all-on run is repeated at other sequence lengths;
each run also carries ``train.memory``'s estimate for it.

Throughput: the real teacher (``--target``, loaded in bf16 on the GPU), synthetic batches of
random token ids, the trainer's CUDA defaults against the eager SDPA path (attention sdpa,
no compile, everything else the same). Each path is a run as ``trainer.build_run`` builds it,
stepped by ``TrainRun.train_step``. It runs its measured batches twice: once with a sync
after every phase of the step, for the time split into teacher prefill, draft
forward+backward and optimizer step; then back to back with one sync at the end, as the
trainer runs, which gives tokens/s.

The results JSON is rewritten (atomically) after every run, so a bench cut off by a time
limit still leaves what it finished. It records the run's manifest fields (commit, command,
config, machine, date; bench/manifest.py) inside it under "manifest".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import statistics
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch._dynamo

_SRC = str(Path(__file__).resolve().parents[2] / "src")  # draftling from this checkout, installed or not
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)

from draftling.bench.manifest import device_name, manifest_fields
from draftling.config import RunConfig, TrainConfig
from draftling.data.tokenized import TokenizedExample
from draftling.draft.vocab import build_vocab
from draftling.dtypes import dtype_name
from draftling.dynamo import allow_recompiles
from draftling.io import write_json
from draftling.timing import sync
from draftling.train.batches import BatchSource, train_step
from draftling.train.distributed import DistContext, TTTObjective, shard, wrap
from draftling.train.draft_setup import build_draft, place_draft
from draftling.train.inputs import RunInputs
from draftling.train.memory import GIB, DraftShape, MemoryOptions, estimate_train_memory
from draftling.train.optim import build_optimizer
from draftling.train.probe import RandomStates
from draftling.train.settings import (
    compile_teacher,
    draft_param_dtype,
    memory_options,
    optimizer_offload,
    unroll_options,
)
from draftling.train.teacher import TeacherBatch, teacher_forward
from draftling.train.trainer import TrainRun, build_run

SHAPE_36B = DraftShape(
    hidden=5120, intermediate=27648, heads=64, kv_heads=8, head_dim=128, vocab=155136, draft_vocab=32000
)
SHAPE_QUICK = DraftShape(
    hidden=1024, intermediate=2816, heads=16, kv_heads=4, head_dim=64, vocab=32768, draft_vocab=8000
)
PHASES = ("memory", "throughput", "seq", "ablation")

# Each ablation turns one feature off against the all-on run: TrainConfig changes, plus the
# two features that are not config flags (build order, the world-size-1 wrapper).
# The wrapper runs last: it is the only run that brings up a process group.
ABLATIONS = {
    "optimizer_offload_off": {"train": {"optimizer_offload": False}},  # draft_dtype auto: fp32
    "build_order_off": {"build_on_device": True},
    "embedding_on_device": {"train": {"embedding_on_host": False}},
    "loss_chunking_off": {"train": {"loss_chunk_tokens": 0}},
    "grad_checkpoint_off": {"train": {"grad_checkpoint": False}},
    "flex_off_sdpa": {"train": {"attention": "sdpa"}},
    "fsdp_world_size_1": {"fsdp": True},
}


@dataclass
class Settings:
    shape: DraftShape = SHAPE_36B
    seq: int = 2048
    batch: int = 1
    ttt_steps: int = 7
    seq_scaling: tuple[int, ...] = (1024, 2048, 4096, 8192)
    warmup: int = 1  # the all-on run: steps before the measured ones
    measured: int = 2
    case_steps: int = 1  # ablation / seq runs (the peak is over the whole run)
    ablations: tuple[str, ...] = tuple(ABLATIONS)
    tp_seq: int = 2048
    tp_batch: int = 8  # TrainConfig's default batch_size
    tp_draft_vocab: int = 32000
    tp_warmup: int = 2
    tp_measured: int = 6
    tp_profile: bool = True  # one extra profiled step of the default path (not in the tok/s)
    aux_dtype: torch.dtype = torch.bfloat16  # the stub teacher's dtype (aux states, embedding)
    caveats: list[str] = field(default_factory=list)


def quick_settings() -> Settings:
    """A small sanity run: the same code paths at a ~1B-class shape and short sequences."""
    return Settings(
        shape=SHAPE_QUICK,
        seq=512,
        seq_scaling=(256, 512, 1024),
        measured=1,
        tp_seq=512,
        tp_batch=2,
        tp_draft_vocab=8000,
        tp_warmup=1,
        tp_measured=2,
    )


def log(msg: str) -> None:
    print(f"[train-bench] {msg}", flush=True)


def all_on_config(ttt_steps: int, **changes) -> TrainConfig:
    """Every memory feature on. attention/compile stay auto: flex and compiled on CUDA."""
    tc = TrainConfig(
        ttt_steps=ttt_steps,
        optimizer_offload=True,
        draft_dtype="auto",
        embedding_on_host=True,
        loss_chunk_tokens=2048,
        grad_checkpoint=True,
        attention="auto",
        compile="auto",
        memory_policy="config",
    )
    return dataclasses.replace(tc, **changes)


# --- device helpers --------------------------------------------------------------------------


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _free(device: torch.device) -> None:
    gc.collect()
    if _cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _reset_peak(device: torch.device) -> None:
    if _cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if _cuda(device) else None


def _reserved_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_reserved(device) / GIB if _cuda(device) else None


def guarded(device: torch.device, fn, *args, **kwargs) -> dict:
    """Run one measurement; an OOM or any failure becomes {"error": ...} and memory is freed,
    so the bench goes on with the next run."""
    try:
        return fn(*args, **kwargs)
    except torch.OutOfMemoryError as e:
        error = f"OutOfMemoryError: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001 - a failed run is a result, not a crash
        where = ""
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            where = f" (at {tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno})"
        error = f"{type(e).__name__}: {str(e)[:600]}{where}"
    # The traceback (and the tensors its frames hold) is gone once the except block ends.
    _free(device)
    log(f"  failed: {error}")
    return {"error": error}


# --- the stubbed 36B-class teacher -----------------------------------------------------------


class StubTarget:
    """What the trainer reads from a target when no teacher forward runs: its config, aux
    layer ids, input embedding and pad id. No weights besides the embedding."""

    def __init__(self, config, embedding: torch.nn.Embedding):
        self.config = config
        n = config.num_hidden_layers
        self.aux_layer_ids = [2, n // 2, n - 3]
        self.embedding = embedding
        self.model = None
        self.tokenizer = types.SimpleNamespace(pad_token_id=0)

    def input_embeddings(self) -> torch.nn.Embedding:
        return self.embedding

    def with_embedding_on(self, device) -> StubTarget:
        """The same target with its embedding table resident on the device."""
        weight = self.embedding.weight.detach().to(device)
        emb = torch.nn.Embedding(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        return StubTarget(self.config, emb)


def stub_target_config(shape: DraftShape, layers: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_hidden_layers=layers,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    )


def tiled_embedding(vocab: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Embedding:
    """A frozen embedding table of random rows without a 0.8G-element random init: one random
    block repeated (the values only have to be finite and varied)."""
    g = torch.Generator().manual_seed(seed)
    block = (torch.randn(1024, hidden, generator=g) * 0.02).to(dtype)
    weight = block.repeat((vocab + block.shape[0] - 1) // block.shape[0], 1)[:vocab].clone()
    return torch.nn.Embedding(vocab, hidden, _weight=weight, _freeze=True)


def stub_batch(shape: DraftShape, batch: int, seq: int, device: torch.device, aux_dtype: torch.dtype, seed: int = 0):
    """A teacher's outputs as random tensors, and the token ids they stand for."""
    g = torch.Generator(device=device).manual_seed(seed)
    aux = torch.randn(batch, seq, 3 * shape.ht, generator=g, device=device).to(aux_dtype)
    # The draft-vocab logits in the teacher's dtype, as teacher_forward returns them.
    logits = (torch.randn(batch, seq, shape.draft_vocab, generator=g, device=device) * 3).to(aux_dtype)
    teacher = TeacherBatch(
        aux=aux,
        draft_logits=logits,
        target_argmax=logits.argmax(-1),
        in_draft=torch.ones(batch, seq, dtype=torch.bool, device=device),
    )
    ids = torch.randint(0, shape.vocab, (batch, seq), generator=g, device=device)
    return teacher, ids


class StubTeacher(RandomStates):
    """The product's random teacher (train/probe.py) without its output head, which the stub
    target lacks: it serves the one stub batch (stub_batch's random logits) for every batch."""

    def __init__(self, batch: TeacherBatch):
        self.batch = batch

    def get(self, keys: list[int], lengths: list[int], device) -> TeacherBatch:
        return self.batch


def token_examples(ids: torch.Tensor, source: str) -> list[TokenizedExample]:
    """The rows of [N, T] token ids as examples with a loss on every position."""
    return [TokenizedExample(str(i), source, row, [1] * len(row)) for i, row in enumerate(ids.tolist())]


def _single_process_group(device: torch.device) -> bool:
    """A world-size-1 process group (in-process store). Returns whether this call made it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if _cuda(device):
        dev = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


class MemoryBench:
    """Shared state of the memory runs: the stub target, vocab and one host-built draft that
    every run copies (building 0.8B params on the host once, not per run)."""

    def __init__(self, settings: Settings, device: torch.device):
        self.s = settings
        self.device = device
        shape = settings.shape
        t0 = time.perf_counter()
        self.target = StubTarget(
            stub_target_config(shape), tiled_embedding(shape.vocab, shape.hidden, settings.aux_dtype)
        )
        self.vocab = build_vocab(torch.zeros(shape.vocab, dtype=torch.long), shape.draft_vocab, "synthetic")
        torch.manual_seed(0)
        with torch.device("cpu"):  # the trainer's build order
            self.base_draft = build_draft(RunConfig(), self.target, self.vocab)
        self.num_params = sum(p.numel() for p in self.base_draft.parameters() if p.requires_grad)
        log(
            f"draft of the {shape.hidden}-wide shape: {self.num_params / 1e6:.1f}M params, built on the host "
            f"in {time.perf_counter() - t0:.1f}s"
        )

    def options(self, tc: TrainConfig, *, build_on_device: bool = False, fsdp: bool = False) -> MemoryOptions:
        """The run's features as train.memory sees them, resolved the way the trainer resolves them."""
        dtype = draft_param_dtype(tc, self.device, self.num_params)
        mem = memory_options(tc, self.device, param_dtype=dtype)
        return MemoryOptions.from_unroll_options(
            mem,
            optimizer_offload=optimizer_offload(tc, self.device, self.num_params),
            draft_dtype=dtype,
            embed_dtype=self.s.aux_dtype,
            embedding_on_host=tc.embedding_on_host,
            fsdp=fsdp,
            build_on_cpu=not build_on_device,
        )

    def run(
        self,
        name: str,
        tc: TrainConfig,
        *,
        seq: int | None = None,
        build_on_device: bool = False,
        fsdp: bool = False,
        warmup: int = 0,
        measured: int = 1,
    ) -> dict:
        s, dev = self.s, self.device
        seq = seq or s.seq
        opts = self.options(tc, build_on_device=build_on_device, fsdp=fsdp)
        if not opts.optimizer_offload and warmup + measured < 2:
            measured = 2  # AdamW's moments appear in the first step; the second runs with them
        log(f"{name}: seq {seq}, {opts}")
        _free(dev)
        _reset_peak(dev)
        baseline = torch.cuda.memory_allocated(dev) / GIB if _cuda(dev) else None  # left by earlier runs
        t0 = time.perf_counter()
        with contextlib.ExitStack() as cleanup:  # an FSDP run's process group ends after its steps
            m = self._measure(tc, seq, cleanup, build_on_device=build_on_device, fsdp=fsdp, steps=warmup + measured)
        _free(dev)
        est = estimate_train_memory(s.shape, s.batch, seq, tc.ttt_steps, opts)
        peak = None if m["setup_peak"] is None else max([m["setup_peak"]] + m["step_peaks"])
        out = {
            "peak_gib": _round(peak),
            "setup_peak_gib": _round(m["setup_peak"]),
            "step_peak_gib": [_round(p) for p in m["step_peaks"]],
            "reserved_peak_gib": None if m["setup_peak"] is None else _round(max(m["reserved"])),
            "baseline_gib": _round(baseline),
            "seq": seq,
            "batch": s.batch,
            "steps": warmup + measured,
            "step_s": [round(x, 3) for x in m["step_s"]],
            "loss": round(m["losses"][-1], 4),
            "options": dataclasses.asdict(opts),
            "plan_estimate_gib": _round(est["total"] / GIB),
            "plan_peak_phase": est["peak_phase"],
            "plan_error": None if peak is None else round((est["total"] / GIB - peak) / peak, 4),
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        log(f"  {name}: peak {out['peak_gib']} GiB (plan {out['plan_estimate_gib']}), steps {out['step_s']} s")
        return out

    def _measure(
        self, tc: TrainConfig, seq: int, cleanup: contextlib.ExitStack, *, build_on_device: bool, fsdp: bool, steps: int
    ) -> dict:
        """The draft placed and given its optimizer as the trainer does it, then ``steps`` of the
        trainer's step on the stub batch: the peak of the setup, and each step's peak and time."""
        s, dev = self.s, self.device
        cfg = RunConfig(train=tc)
        # The target (here: only its embedding) is resident before the draft arrives.
        target = self.target if tc.embedding_on_host else self.target.with_embedding_on(dev)
        if build_on_device:  # the ablation: random init in fp32 on the device, then the cast
            torch.manual_seed(0)
            with torch.device(dev):
                draft = build_draft(cfg, target, self.vocab)
        else:
            draft = copy.deepcopy(self.base_draft)
        dtype = draft_param_dtype(tc, dev, self.num_params)
        if fsdp and _single_process_group(dev):
            import torch.distributed as dist

            cleanup.callback(dist.destroy_process_group)
        objective, optimizer, scheduler = self._optimized(draft, tc, dtype, fsdp)
        teacher, ids = stub_batch(s.shape, s.batch, seq, dev, s.aux_dtype)
        # The options the plan estimates, fixed (under FSDP the params are fp32 shards).
        source = BatchSource(
            cfg,
            target,
            token_examples(ids, "stub"),
            dev,
            teacher=StubTeacher(teacher),
            unroll=unroll_options(tc, dev, param_dtype=dtype),
        )
        m = {
            "setup_peak": _peak_gib(dev),
            "reserved": [_reserved_gib(dev)],
            "step_peaks": [],
            "step_s": [],
            "losses": [],
        }
        for _ in range(steps):
            _reset_peak(dev)
            t = time.perf_counter()
            loss, _counts, _tokens = train_step(objective, optimizer, scheduler, source, list(range(s.batch)))
            sync(dev)
            m["step_s"].append(time.perf_counter() - t)
            m["step_peaks"].append(_peak_gib(dev))
            m["reserved"].append(_reserved_gib(dev))
            m["losses"].append(float(loss.detach()))
        return m

    def _optimized(self, draft, tc: TrainConfig, dtype: torch.dtype, fsdp: bool):
        """(objective, optimizer, constant-LR scheduler) over the draft, placed as the trainer
        places it. ``fsdp``: sharded as distributed.wrap shards it (FSDP2 over the whole TTT
        objective: fp32 shards, compute in the draft dtype, fp32 reduce, the host shards stepped
        by a plain AdamW under CPUOffloadPolicy), here at world size 1."""
        offload = optimizer_offload(tc, self.device, self.num_params)
        if fsdp:
            place_draft(draft, self.device, torch.float32)
            objective = shard(TTTObjective(draft), dtype, offload)
        else:
            place_draft(draft, self.device, dtype)
            objective = wrap(draft, DistContext(), tc.parallel, dtype, offload)  # the bare objective
        objective.train()
        params = [p for p in objective.parameters() if p.requires_grad]
        optimizer, scheduled = build_optimizer(params, tc.lr, tc.betas, tc.weight_decay, offload and not fsdp)
        return objective, optimizer, torch.optim.lr_scheduler.LambdaLR(scheduled, lambda _: 1.0)


def _round(x, nd: int = 3):
    return None if x is None else round(float(x), nd)


# --- throughput against the real teacher ----------------------------------------------------


def synthetic_vocab(target, batches: list[torch.Tensor], size: int, device: torch.device):
    """A draft vocab for random-id batches: the teacher's argmax tokens on them first, then the
    input ids, so (as with real regenerated data) nearly every position has a loss."""
    vocab_size = target.config.vocab_size
    probe = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    probe[0] = True  # teacher_forward needs at least one draft-vocab row
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in batches:
        ids_dev = ids.to(device)
        out = teacher_forward(target, ids_dev, torch.ones_like(ids_dev), probe)
        counts += 1000 * torch.bincount(out.target_argmax.reshape(-1).cpu(), minlength=vocab_size)[:vocab_size]
        counts += torch.bincount(ids.reshape(-1), minlength=vocab_size)[:vocab_size]
    return build_vocab(counts, min(size, vocab_size), "synthetic")


def profile_step(step, device: torch.device, top: int = 15) -> dict:
    """One more step under torch.profiler: where the device time goes, and how much of the
    step's wall time the device is busy (the rest is host overhead and syncs)."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    t0 = time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda(device) else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
    busy_us = sum(e.self_device_time_total for e in events)
    ranked = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    return {
        "wall_s": round(wall, 4),
        "device_busy_s": round(busy_us / 1e6, 4),
        "top_ops": [
            {"name": e.key[:80], "calls": e.count, "device_ms": round(e.self_device_time_total / 1e3, 2)}
            for e in ranked
        ],
    }


def synthetic_run(target, vocab, tc: TrainConfig, batches: list[torch.Tensor]) -> TrainRun:
    """A training run as ``trainer.build_run`` builds it (memory policy resolved, the draft placed
    and wrapped, its optimizer and LR schedule), over the batches' rows as its examples; no run
    directory, checkpoint or validation."""
    examples = token_examples(torch.cat(batches), "synthetic")
    inputs = RunInputs(examples, [], vocab, None, None)
    return build_run(RunConfig(train=tc), target, inputs, None, None, DistContext(), say=lambda line: None)


def timed_step(run: TrainRun, keys: list[int], times: list[float]):
    """``run.train_step`` on the global batch ``keys``, with a sync after each phase and its end
    time appended to ``times`` (after the start time). Returns the step's counts."""
    device = run.target.device

    def phase_end(_phase: str) -> None:
        sync(device)
        times.append(time.perf_counter())

    times.append(time.perf_counter())
    return run.train_step(keys, phase_end)[1]


def phase_split(name: str, run: TrainRun, batch_keys: list[list[int]], warmup: int, tokens: int):
    """Each batch's step with a sync after every phase: [(teacher, draft fwd+bwd, optimizer,
    draft fwd) seconds] and the last step's share of positions with a loss at TTT step 0."""
    split, valid = [], 0.0
    for i, keys in enumerate(batch_keys):
        sync(run.target.device)
        t = []
        counts = timed_step(run, keys, t)
        t0, t1, t_fwd, t2, t3 = t
        split.append((t1 - t0, t2 - t1, t3 - t2, t_fwd - t1))
        valid = counts.valid[0] / tokens
        log(
            f"  {name} step {i + 1}/{len(batch_keys)}: {t3 - t0:.3f}s (teacher {t1 - t0:.3f}, draft fwd+bwd "
            f"{t2 - t1:.3f} of which fwd {t_fwd - t1:.3f}, optimizer {t3 - t2:.3f})"
            + (" [warm-up]" if i < warmup else "")
        )
    return split, valid


def flow_step_seconds(run: TrainRun, batch_keys: list[list[int]]) -> float:
    """Seconds per step as training runs: the steps back to back, one sync at the end."""
    device = run.target.device
    sync(device)
    t0 = time.perf_counter()
    for keys in batch_keys:
        run.train_step(keys)
    sync(device)
    return (time.perf_counter() - t0) / len(batch_keys)


def throughput_path(
    name: str,
    target,
    vocab,
    tc: TrainConfig,
    batches: list[torch.Tensor],
    warmup: int,
    device: torch.device,
    profile: bool = False,
) -> dict:
    """tokens/s of the trainer's own training step (``TrainRun.train_step``), each step also
    timed in its phases."""
    torch.manual_seed(0)
    run = synthetic_run(target, vocab, tc, batches)
    tc, dtype = run.cfg.train, run.param_dtype
    mem_opts = memory_options(tc, device, param_dtype=dtype)
    n_params = sum(p.numel() for p in run.draft.parameters() if p.requires_grad)
    log(
        f"throughput {name}: {n_params / 1e6:.1f}M params ({dtype}), offload {run.offload}, {mem_opts}; "
        f"memory policy {run.memory_policy}"
    )
    tokens = batches[0].numel()
    batch_keys = [list(range(i * len(b), (i + 1) * len(b))) for i, b in enumerate(batches)]
    split, valid = phase_split(name, run, batch_keys, warmup, tokens)
    measured = split[warmup:] or split
    mean = [statistics.fmean(x[k] for x in measured) for k in range(4)]
    # tokens/s as training runs: the measured batches again, back to back.
    flow_step_s = flow_step_seconds(run, batch_keys[warmup:] or batch_keys)
    profiled = profile_step(lambda: timed_step(run, batch_keys[-1], []), device) if profile else None
    split_step_s = sum(mean[:3])
    about = {
        "draft_dtype": dtype_name(dtype),
        "optimizer_offload": run.offload,
        "memory_options": mem_opts,
        "teacher_compiled": compile_teacher(tc, device, target.model),
        "memory_policy": run.memory_policy,
    }
    del run
    _free(device)
    return {
        "tok_s": round(tokens / flow_step_s, 1),
        "step_s": round(flow_step_s, 4),
        "tok_s_with_phase_syncs": round(tokens / split_step_s, 1),
        "step_s_with_phase_syncs": round(split_step_s, 4),
        "time_split": {
            "teacher_prefill_s": round(mean[0], 4),
            "draft_fwd_bwd_s": round(mean[1], 4),
            "optimizer_s": round(mean[2], 4),
            "draft_forward_s": round(mean[3], 4),
        },
        "warmup_step_s": [round(sum(x[:3]), 3) for x in split[:warmup]],
        "measured_steps": len(measured),
        "tokens_per_step": tokens,
        "valid_fraction_step0": round(valid, 4),
        **about,
        "peak_gib": _round(_peak_gib(device)),
        **({"profile": profiled} if profiled else {}),
    }


def run_throughput(target, settings: Settings, device: torch.device) -> dict:
    s = settings
    n = s.tp_warmup + s.tp_measured
    g = torch.Generator().manual_seed(1)
    vocab_size = target.config.vocab_size
    batches = [torch.randint(0, vocab_size, (s.tp_batch, s.tp_seq), generator=g) for _ in range(n)]
    t0 = time.perf_counter()
    vocab = synthetic_vocab(target, batches, s.tp_draft_vocab, device)
    log(f"synthetic draft vocab of {vocab.size} in {time.perf_counter() - t0:.1f}s")
    default = TrainConfig(ttt_steps=s.ttt_steps, batch_size=s.tp_batch)
    paths = {
        "default": default,  # the trainer's defaults, resolved on this device
        # The baseline: the plain eager path (SDPA with explicit TTT scores, no compile, the
        # params' fp32 compute). The memory features stay as the default resolves them.
        "eager": dataclasses.replace(default, attention="sdpa", compile=False, compute_dtype="float32"),
        # Attribution of the gain, one change at a time from each end.
        "eager_bf16": dataclasses.replace(default, attention="sdpa", compile=False, compute_dtype="bfloat16"),
        "flex_no_compile": dataclasses.replace(default, compile=False),
        "default_fp32": dataclasses.replace(default, compute_dtype="float32"),
        "default_eager_teacher": dataclasses.replace(default, compile_teacher=False),
    }
    out = {}
    for name, tc in paths.items():
        _reset_peak(device)
        out[name] = guarded(
            device,
            throughput_path,
            name,
            target,
            vocab,
            tc,
            batches,
            s.tp_warmup,
            device,
            profile=s.tp_profile and name == "default",
        )
    return out


def throughput_phase(target, settings: Settings, device: torch.device) -> dict:
    """``target``: a loaded Target, or a path / name that is loaded here in bf16 (and freed after)."""
    if isinstance(target, str):
        from draftling.target import load_target

        t0 = time.perf_counter()
        target = load_target(target, dtype="bfloat16", device=str(device))
        log(
            f"teacher loaded in {time.perf_counter() - t0:.1f}s: {target.spec.name}, "
            f"{target.num_layers} layers, vocab {target.config.vocab_size}"
        )
    return run_throughput(target, settings, device)


# --- the whole bench --------------------------------------------------------------------------


def new_results(settings: Settings, device: torch.device) -> dict:
    import transformers

    s = settings
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "peak_gib_36b_shape": None,
        "peak_goal_gib": 8.0,
        "ablation": {},
        "seq_scaling": {},
        "tok_s_default": None,
        "tok_s_eager": None,
        "speedup_vs_eager": None,
        "speedup_goal": 3.0,
        "plan_estimate_gib": None,
        "plan_error": None,
        "time_split": {},
        "memory_shape": dataclasses.asdict(s.shape),
        "memory_shape_name": "36B-class" if s.shape == SHAPE_36B else "custom (not the 36B-class shape)",
        "memory_config": {
            "seq": s.seq,
            "batch": s.batch,
            "ttt_steps": s.ttt_steps,
            "dtype": "bfloat16",
            "warmup_steps": s.warmup,
            "measured_steps": s.measured,
            "ablation_steps": s.case_steps,
            "teacher": "stubbed: random aux (bf16) and "
            "draft-vocab logits (bf16, the teacher dtype); embedding table random",
        },
        "throughput_config": {
            "seq": s.tp_seq,
            "batch": s.tp_batch,
            "ttt_steps": s.ttt_steps,
            "draft_vocab": s.tp_draft_vocab,
            "warmup_steps": s.tp_warmup,
            "measured_steps": s.tp_measured,
            "teacher_dtype": "bfloat16",
            "data": "synthetic: uniformly random token ids, loss on every position",
        },
        "all_on": None,
        "throughput": None,
        "caveats": [],
    }


def manifest_config(settings: Settings, device: torch.device, target, phases) -> dict:
    """What a run was asked to do, as JSON values for its manifest: the settings (caveats left
    out: they are the results'), the phases, the device and the throughput teacher."""
    record = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name != "caveats"}
    record["shape"] = dataclasses.asdict(settings.shape)
    record["aux_dtype"] = dtype_name(settings.aux_dtype)
    spec = getattr(target, "spec", None)
    return {
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in record.items()},
        "phases": list(phases),
        "device": str(device),
        "target": spec.label if spec is not None else (None if target is None else str(target)),
    }


def caveats(results: dict, settings: Settings) -> list[str]:
    notes = [
        "memory runs stub the teacher with random tensors: no teacher weights or teacher forward on the "
        "device, so the peak is the draft's own (aux states and draft-vocab logits, both bf16 as a bf16 teacher gives them, are included)",
        "peak = torch.cuda.max_memory_allocated over placement and all steps of a run; the CUDA context "
        "and allocator fragmentation come on top (reserved_peak_gib is recorded beside it)",
        f"few steps per measurement (all-on: {settings.warmup} warm-up + {settings.measured} measured; "
        f"ablation/seq runs: {settings.case_steps}, 2 without optimizer offload; throughput: "
        f"{settings.tp_warmup} warm-up + {settings.tp_measured} measured), single run",
        "optimizer_offload_off uses the trainer's auto dtypes for it: fp32 params (so bf16 autocast "
        "compute), AdamW on the device",
        "build_order_off builds the draft on the device in fp32 and casts it; place_draft moves the host-"
        "built draft after casting it on the host",
        "fsdp_world_size_1 shards with distributed.shard, as the trainer does: fully_shard over "
        "TTTObjective, compute in the draft dtype, fp32 reduce, forward inputs left uncast (the "
        "teacher logits keep the teacher's dtype), CPUOffloadPolicy (plain AdamW steps the host shards)",
        "throughput: synthetic batches of random token ids; the draft vocab holds the teacher's argmax "
        "tokens on them, so nearly every position carries a loss (see valid_fraction_step0)",
        "every run times the trainer's own step (batches.train_step): the teacher phase includes collating "
        "the batch and moving it to the device; memory runs step a constant LR schedule, throughput runs "
        "the trainer's warmup/cosine one",
    ]
    if not _cuda(torch.device(results["device"])):
        notes.append(
            "not run on CUDA: peaks are null; flex attention and compile are off, so the "
            "ablations of those are no-ops here"
        )
    for key in ("ablation", "seq_scaling"):
        for name, entry in (results.get(key) or {}).items():
            if isinstance(entry, dict) and "error" in entry:
                notes.append(f"{key} {name} failed: {entry['error'][:200]}")
    tp = results.get("throughput") or {}
    if "error" in tp:
        notes.append(f"throughput phase failed: {tp['error'][:200]}")
    for name, entry in tp.items():
        if isinstance(entry, dict) and "error" in entry:
            notes.append(f"throughput {name} failed: {entry['error'][:200]}")
    return notes + settings.caveats


def _save(out, results: dict, settings: Settings) -> None:
    results["caveats"] = caveats(results, settings)
    if out:
        write_json(out, results)


def run_bench(
    out, settings: Settings, device: torch.device, target=None, phases=PHASES, command: str | None = None
) -> dict:
    """Run the phases in order (headline memory, throughput, sequence scaling, ablations; the
    FSDP ablation, the one run that needs a process group, last), rewriting ``out`` after
    each run. ``target``: a loaded Target, a path/name to load in bf16, or None to skip the
    throughput phase. ``command``: the manifest's (default: this process's argv)."""
    started = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = True  # as trainer.train sets it
    # One bench process compiles flex attention and the loss chunk for several shapes and
    # dtypes (a training run sees one); past dynamo's default limit of 8 variants a function
    # silently runs eagerly, which would measure the wrong thing.
    allow_recompiles(64)
    results = new_results(settings, device)
    results["manifest"] = manifest_fields(
        command, manifest_config(settings, device, target, phases), device, results["date"]
    )
    s = settings
    bench = MemoryBench(s, device) if {"memory", "ablation", "seq"} & set(phases) else None
    if "memory" in phases:
        _bench_memory(bench, results, out)
    if "throughput" in phases:
        _bench_throughput(target, results, out, s, device)
    if "seq" in phases:
        _bench_seq(bench, results, out)
    if "ablation" in phases:
        _bench_ablations(bench, results, out)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    _save(out, results, s)
    log(
        f"done in {results['wall_s']}s: peak {results['peak_gib_36b_shape']} GiB (plan "
        f"{results['plan_estimate_gib']}), tok/s default {results['tok_s_default']} vs eager "
        f"{results['tok_s_eager']} (x{results['speedup_vs_eager']})"
    )
    return results


def _bench_memory(bench: MemoryBench, results: dict, out) -> None:
    s = bench.s
    all_on = guarded(
        bench.device, bench.run, "all_on", all_on_config(s.ttt_steps), warmup=s.warmup, measured=s.measured
    )
    results["all_on"] = all_on
    if "error" not in all_on:
        results["peak_gib_36b_shape"] = all_on["peak_gib"]
        results["plan_estimate_gib"] = all_on["plan_estimate_gib"]
        results["plan_error"] = all_on["plan_error"]
        results["seq_scaling"][str(s.seq)] = all_on
    _save(out, results, s)


def _bench_throughput(target, results: dict, out, s: Settings, device: torch.device) -> None:
    if target is None:
        s.caveats.append("throughput phase skipped: no --target")
        return
    tp = guarded(device, throughput_phase, target, s, device)
    results["throughput"] = tp
    if "error" not in tp:
        results["time_split"] = {k: v["time_split"] for k, v in tp.items() if "time_split" in v}
        results["tok_s_default"] = tp["default"].get("tok_s")
        results["tok_s_eager"] = tp["eager"].get("tok_s")
        if results["tok_s_default"] and results["tok_s_eager"]:
            results["speedup_vs_eager"] = round(results["tok_s_default"] / results["tok_s_eager"], 3)
    _save(out, results, s)


def _bench_seq(bench: MemoryBench, results: dict, out) -> None:
    s = bench.s
    for seq in s.seq_scaling:
        if str(seq) in results["seq_scaling"]:
            continue
        results["seq_scaling"][str(seq)] = guarded(
            bench.device, bench.run, f"all_on_seq{seq}", all_on_config(s.ttt_steps), seq=seq, measured=s.case_steps
        )
        _save(out, results, s)
    results["seq_scaling"] = dict(sorted(results["seq_scaling"].items(), key=lambda kv: int(kv[0])))


def _bench_ablations(bench: MemoryBench, results: dict, out) -> None:
    s = bench.s
    base_peak = results["peak_gib_36b_shape"]
    for name in s.ablations:
        spec = ABLATIONS[name]
        tc = all_on_config(s.ttt_steps, **spec.get("train", {}))
        entry = guarded(
            bench.device,
            bench.run,
            name,
            tc,
            build_on_device=spec.get("build_on_device", False),
            fsdp=spec.get("fsdp", False),
            measured=s.case_steps,
        )
        if "error" not in entry and base_peak is not None and entry["peak_gib"] is not None:
            entry["delta_vs_all_on_gib"] = round(entry["peak_gib"] - base_peak, 3)
        results["ablation"][name] = entry
        _save(out, results, s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results JSON (rewritten after every run)")
    p.add_argument(
        "--target", help="teacher for the throughput phase (e.g. the SmolLM2 GGUF); without it that phase is skipped"
    )
    p.add_argument("--quick", action="store_true", help="small shapes and short sequences: a sanity run")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)} (default: all, in that order)"
    )
    p.add_argument("--ablations", default=None, help=f"comma list of {', '.join(ABLATIONS)} (default: all)")
    args = p.parse_args(argv)
    phases = [x for x in args.phases.split(",") if x]
    unknown = set(phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phase(s) {sorted(unknown)}; known: {', '.join(PHASES)}")
    settings = quick_settings() if args.quick else Settings()
    if args.ablations:
        names = tuple(x for x in args.ablations.split(",") if x)
        bad = set(names) - set(ABLATIONS)
        if bad:
            p.error(f"unknown ablation(s) {sorted(bad)}; known: {', '.join(ABLATIONS)}")
        settings.ablations = names
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if _cuda(device):
        if device.index is None:  # one spelling of the device everywhere (caches compare it)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    from draftling.progress import quiet_libraries

    quiet_libraries()
    run_bench(args.out, settings, device, target=args.target, phases=phases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
