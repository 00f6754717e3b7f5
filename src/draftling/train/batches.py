"""The batch pipeline: a global batch's keys to this rank's share collated on the device, its teacher
outputs (cache, teacher source or a forward of the target), the TTT unroll over it, and the two
things built on that: one optimizer step (``train_step``) and validation (``evaluate``)."""

from __future__ import annotations

import dataclasses
import weakref

import torch

from draftling.config import RunConfig
from draftling.draft.block import BlockDraft
from draftling.draft.model import Eagle3Draft
from draftling.target import Target
from draftling.train.block_loss import row_anchors, scored_slots
from draftling.train.dataset import collate, to_device
from draftling.train.distributed import DistContext, TTTObjective, all_reduce_sum, current, rank_share, unwrap
from draftling.train.host_embed import HostEmbedding
from draftling.train.metrics import read_counts
from draftling.train.settings import compile_teacher, memory_options, pad_multiple, unroll_options
from draftling.train.step_counts import StepCounts
from draftling.train.teacher import TeacherBatch, TeacherCache, TeacherSource, teacher_forward
from draftling.train.ttt import UnrollOptions, step_row_bounds, step_valid_counts

_HOST_EMBEDDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    attention = (
        source.unroll.attention
        if source.unroll is not None
        else memory_options(tc, source.device, torch.is_grad_enabled())["attention"]
    )
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
    return RankBatch(
        batch, teacher_outputs(source, share, lengths, batch, t2d), stand_in, 0 if stand_in else sum(lengths), bounds
    )


def teacher_outputs(
    source: BatchSource, share: list[int], lengths: list[int], batch: dict, t2d: torch.Tensor
) -> TeacherBatch:
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
            teacher = teacher_forward(
                target,
                batch["input_ids"],
                batch["attention_mask"],
                t2d,
                compile=compile_teacher(source.cfg.train, device, target.model),
            )
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
        denominators = all_reduce_sum(_loss_counts(draft, b, batch.teacher, tc.ttt_steps), ctx) / ctx.world_size
    options = source.unroll or unroll_options(tc, device, torch.is_grad_enabled(), next(draft.parameters()).dtype)
    loss, counts = objective(
        draft_embedding(source.cfg, source.target, device),
        batch.teacher,
        b["input_ids"],
        b["loss_mask"],
        b["attention_mask"],
        options,
        denominators,
        batch.row_bounds,
    )
    return loss, counts, batch.tokens


def _loss_counts(draft, b: dict, teacher, ttt_steps: int) -> torch.Tensor:
    """This rank's loss counts, float64 on the device: per TTT step the valid tokens (EAGLE-3),
    or the scored block slots at the rows' anchors (a dflash head: one count)."""
    if isinstance(draft, BlockDraft):
        host = [b[k].cpu() for k in ("input_ids", "loss_mask", "attention_mask")]
        scored = scored_slots(row_anchors(*host), host[1], draft.block_size).sum()
        return scored.to(device=b["input_ids"].device, dtype=torch.float64).view(1)
    valid = step_valid_counts(b["loss_mask"], b["attention_mask"], teacher.in_draft, ttt_steps)
    return valid.to(torch.float64)


def run_batch(objective, source: BatchSource, keys: list[int]):
    """This rank's share of one global batch through the teacher and the TTT unroll:
    ``unroll_batch``'s (loss, counts, tokens)."""
    return unroll_batch(objective, source, load_batch(source, keys, unwrap(objective).t2d))


@torch.no_grad()
def evaluate(
    objective,
    target: Target,
    examples,
    cfg: RunConfig,
    device,
    max_batches: int,
    teacher_source: TeacherSource | None = None,
    ctx: DistContext | None = None,
) -> dict:
    """Validation metrics over the first ``max_batches`` batches, exact over any world size.
    ``objective`` is what ``distributed.wrap`` returns, or a bare draft."""
    ctx = ctx or current()
    if isinstance(objective, (Eagle3Draft, BlockDraft)):
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
