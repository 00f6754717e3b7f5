"""The block drafter's training objective (draft/block.py), on the same teacher batch as
EAGLE-3's: the target's aux states, its logits over the draft vocabulary and its argmax.

Anchors: up to ``max_anchors`` positions per row, drawn without replacement from those whose
next token is trained (``loss_mask``), so every block has at least one scored slot. A block at
anchor a holds ``[x_a, MASK...]``; slot j >= 1 sits at a+j and learns the target's
distribution there, which the target's logits at a+j-1 give (teacher-forced on the text, as
the published design trains). A slot counts where ``loss_mask[a+j]`` holds and a+j is inside
the row. Slot j's loss weighs exp(-(j-1)/gamma): the first drafts decide most of what a round
accepts.

Metrics: per-slot accuracy (draft argmax == target argmax) and the expected accepted length
of a round (the leading run of correct slots, plus the bonus token), over scored blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from draftling.draft.block import BlockDraft, block_positions, block_visibility
from draftling.train.step_counts import StepCounts
from draftling.train.teacher import TeacherBatch

# Blocks per row and step: enough to cover a reply's positions several times over an epoch,
# few enough that the [blocks x block, context + blocks x block] attention stays small.
MAX_ANCHORS = 64


@dataclass
class BlockLoss:
    """The loss, the per-slot counts the trainer logs, and the masks behind them. The
    summaries below read the masks back to the host when asked, never in a training step."""

    loss: torch.Tensor  # weighted mean soft cross-entropy over scored slots
    counts: StepCounts  # per slot, as the EAGLE-3 unroll counts per step
    correct: torch.Tensor  # [B, A, block-1] the draft's argmax is the target's, at a scored slot
    scored: torch.Tensor  # [B, A, block-1] the slot has a loss

    @property
    def slot_acc(self) -> list[float]:
        """Accuracy per slot j = 1..B-1."""
        return (self.correct.sum((0, 1)).float() / self.scored.sum((0, 1)).clamp(min=1)).tolist()

    @property
    def accept_len(self) -> float:
        """Mean leading run of correct slots + 1 (the bonus), over blocks whose first slot is scored."""
        blocks = self.scored[..., 0]
        run = self.correct.long().cumprod(-1).sum(-1).float()
        return float((run[blocks] + 1).mean()) if blocks.any() else 1.0


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator=None) -> torch.Tensor:
    """[B, A] anchor positions (sorted; -1 where a row has fewer candidates): positions a
    with ``loss_mask[a+1]``, so slot 1 of every real block is scored."""
    nxt = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt[:, :-1] = loss_mask[:, 1:].bool()
    keys = torch.rand(loss_mask.shape, generator=generator, device=loss_mask.device)
    keys = torch.where(nxt, keys, torch.full_like(keys, 2.0))  # candidates first, in random order
    a = min(max_anchors, loss_mask.shape[1])
    picked = keys.topk(a, dim=1, largest=False)
    anchors = torch.where(picked.values < 2.0, picked.indices, torch.full_like(picked.indices, -1))
    return anchors.sort(dim=1).values


def row_anchors(input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The anchors of a training batch (host tensors): each row's drawn by ``sample_anchors``
    over its real length from a generator seeded by its own tokens, so a row gets the same
    anchors in any batch, on any rank, after any resume; [B, MAX_ANCHORS], -1 padded."""
    out = torch.full((input_ids.shape[0], MAX_ANCHORS), -1, dtype=torch.long)
    weights = torch.arange(1, input_ids.shape[1] + 1, dtype=torch.long)
    for i, n in enumerate(attention_mask.sum(1).tolist()):
        seed = int((input_ids[i, :n] * weights[:n]).sum()) * 1_000_003 + n
        picked = sample_anchors(loss_mask[i : i + 1, :n], MAX_ANCHORS, torch.Generator().manual_seed(seed))
        out[i, : picked.shape[1]] = picked[0]
    return out


def scored_slots(anchors: torch.Tensor, loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, A, block-1]: slot j of the block at each anchor has a loss (a real anchor, a+j
    inside the row, ``loss_mask[a+j]``)."""
    t = loss_mask.shape[1]
    slots = block_positions(anchors.clamp(min=0), block_size).view(*anchors.shape, block_size)[..., 1:]
    trained = loss_mask.bool().gather(1, slots.clamp(max=t - 1).flatten(1)).view_as(slots)
    return (anchors >= 0)[..., None] & (slots < t) & trained


def block_loss(
    draft: BlockDraft,
    embed: Any,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    teacher: TeacherBatch,
    anchors: torch.Tensor,
    gamma: float = 4.0,
    denominator: torch.Tensor | None = None,
) -> BlockLoss:
    """The loss and metrics of ``draft`` on one batch at ``anchors`` [B, A] (see the module).
    ``denominator``: what the weighted loss sum is divided by instead of this batch's scored
    count (data parallelism passes the global count over world size)."""
    bsz, t = input_ids.shape
    size, dev = draft.block_size, input_ids.device
    a = anchors.clamp(min=0)
    slots = block_positions(a, size).view(bsz, -1, size)  # [B, A, block]
    tokens = torch.full_like(slots, int(draft.config.mask_token_id))
    tokens[..., 0] = input_ids.gather(1, a)
    positions = torch.arange(t, device=dev).expand(bsz, t)
    ctx_kv = draft.context_kv(draft.context(teacher.aux), positions)
    visible = block_visibility(a, size, t, attention_mask.bool(), draft.causal)
    lookup = embed.for_batch(tokens) if hasattr(embed, "for_batch") else embed  # a host-resident embedding
    hidden = draft.block_hidden(lookup(tokens.flatten(1)), slots.flatten(1), ctx_kv, visible)
    logits = draft.compute_logits(hidden).float().view(bsz, -1, size, draft.config.draft_vocab_size)[..., 1:, :]
    src = (slots[..., 1:] - 1).clamp(max=t - 1)  # the target's logits at a+j-1 predict a+j
    flat = src.flatten(1)
    want = teacher.draft_logits.gather(1, flat[..., None].expand(-1, -1, teacher.draft_logits.shape[-1]))
    want = want.float().view_as(logits).softmax(-1)
    scored = scored_slots(anchors, loss_mask, size)
    weight = torch.exp(-torch.arange(size - 1, device=dev, dtype=torch.float32) / gamma)
    ce = -(want * logits.log_softmax(-1)).sum(-1)  # [B, A, block-1]
    total = scored.sum().clamp(min=1) if denominator is None else denominator.clamp(min=torch.finfo(torch.float32).tiny)
    loss = (ce * weight * scored).sum() / total
    guess = draft.draft_to_target(logits.argmax(-1))
    correct = (guess == teacher.target_argmax.gather(1, flat).view_as(src)) & scored
    valid = scored & teacher.in_draft.gather(1, flat).view_as(src)
    return BlockLoss(loss, _counts(ce, correct, valid, scored), correct, scored)


def block_unroll(
    draft, embed, teacher, input_ids, loss_mask, attention_mask, options=None, loss_denominators=None, **_
):
    """The trainer's objective for a dflash head (train/batches.py calls it as it calls
    ``ttt_unroll``): (loss, StepCounts over the block's K slots), at ``row_anchors``.
    ``loss_denominators``: [1], the loss sum's divisor (see ``block_loss``)."""
    host = [x.cpu() for x in (input_ids, loss_mask, attention_mask)]  # one read: the anchors are drawn on the host
    anchors = row_anchors(*host).to(input_ids.device)
    denominator = None if loss_denominators is None else torch.as_tensor(loss_denominators, device=input_ids.device)[0]
    out = block_loss(draft, embed, input_ids, loss_mask, attention_mask, teacher, anchors, denominator=denominator)
    return out.loss, out.counts


@torch.no_grad()
def _counts(ce, correct, valid, scored) -> StepCounts:
    """Per slot j: the loss sum and counts StepCounts reads (chain: every earlier slot correct)."""
    earlier = torch.ones_like(correct[..., :1])
    chain = torch.cat([earlier, correct.long().cumprod(-1)[..., :-1].bool()], -1)
    rows = [
        (ce * valid).sum((0, 1)),
        valid.sum((0, 1)),
        correct.sum((0, 1)),
        (chain & valid).sum((0, 1)),
        (chain & correct).sum((0, 1)),
        scored.sum((0, 1)),
    ]
    return StepCounts(ce.shape[-1], torch.stack([r.double() for r in rows]))
