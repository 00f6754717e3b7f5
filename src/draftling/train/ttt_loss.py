"""The TTT unroll's loss chunks (train/ttt.py): soft cross-entropy of the draft head against the
teacher over chunks of the valid positions, each under activation checkpointing and, with
``compile``, as one ``torch.compile``d function (see ttt.py's memory options)."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from draftling.draft.model import Eagle3Draft


def teacher_logsumexp(teacher_logits: torch.Tensor, rows_per_pass: int = 1024) -> torch.Tensor:
    """[B, T] fp32 log-sum-exp of the teacher's draft-vocab logits, once per batch: every
    TTT step reads the same teacher rows (shifted), so the loss chunks need not each redo
    the teacher's max and sum passes. In row blocks, so no [B*T, V] fp32 copy exists."""
    flat = teacher_logits.reshape(-1, teacher_logits.shape[-1])
    out = torch.cat([flat[s : s + rows_per_pass].float().logsumexp(-1) for s in range(0, flat.shape[0], rows_per_pass)])
    return out.view(teacher_logits.shape[:-1])


def _soft_ce_chunk(
    draft: Eagle3Draft,
    teacher_logits: torch.Tensor,
    teacher_lse: torch.Tensor,
    hidden: torch.Tensor,
    rows_b: torch.Tensor,
    rows_t: torch.Tensor,
    keep: torch.Tensor,
):
    """Summed soft cross-entropy of the draft head on ``hidden`` [C, H] against
    softmax(teacher_logits[rows_b, rows_t]) (= exp(logits - teacher_lse)) over the rows
    where ``keep`` (the others only fill a fixed-size chunk), plus the draft argmax per row.

    The teacher rows are gathered in here (from indices), not passed in, so a checkpoint
    of this function keeps only indices alive until backward, not [C, V] logits."""
    logits = draft.compute_logits(hidden).float()
    logp = logits.log_softmax(-1)
    target_p = (teacher_logits[rows_b, rows_t].float() - teacher_lse[rows_b, rows_t, None]).exp()
    token_loss = -(target_p * logp).sum(-1)
    return torch.where(keep, token_loss, 0.0).sum(), logits.argmax(-1)


def _checkpointed_chunk(
    draft: Eagle3Draft,
    teacher_logits: torch.Tensor,
    teacher_lse: torch.Tensor,
    hidden: torch.Tensor,
    rows_b: torch.Tensor,
    rows_t: torch.Tensor,
    keep: torch.Tensor,
):
    """One loss chunk recomputed in backward: only its inputs (and indices) stay alive. The
    teacher logits are bound, not passed, so the checkpoint does not count them as saved."""
    chunk = functools.partial(_soft_ce_chunk, draft, teacher_logits, teacher_lse)
    return checkpoint(chunk, hidden, rows_b, rows_t, keep, use_reentrant=False)


_COMPILED_CHUNKS: dict = {}


def compiled_chunk_fn(backend="inductor"):
    """:func:`_checkpointed_chunk` under ``torch.compile``. The checkpoint sits inside the
    compiled region, so the compiler recomputes the chunk in its own backward graph."""
    fn = _COMPILED_CHUNKS.get(backend)
    if fn is None:
        fn = torch.compile(_checkpointed_chunk, backend=backend, dynamic=None)
        _COMPILED_CHUNKS[backend] = fn
    return fn


def loss_chunk(
    draft: Eagle3Draft,
    teacher_logits: torch.Tensor,
    teacher_lse: torch.Tensor,
    hidden: torch.Tensor,
    rows_b: torch.Tensor,
    rows_t: torch.Tensor,
    keep: torch.Tensor,
    compile,
):
    if not torch.is_grad_enabled():
        return _soft_ce_chunk(draft, teacher_logits, teacher_lse, hidden, rows_b, rows_t, keep)
    # Sizes 0 and 1 would each get a specialised graph; such chunks are rare and tiny.
    if compile and hidden.shape[0] >= 2:
        # Dynamic from the first call: the last chunk of every step has another size, and
        # batches have other lengths; without this each new size costs a recompile.
        for x in (hidden, rows_b, rows_t, keep):
            torch._dynamo.maybe_mark_dynamic(x, 0)
        torch._dynamo.maybe_mark_dynamic(teacher_logits, 0)
        torch._dynamo.maybe_mark_dynamic(teacher_logits, 1)
        torch._dynamo.maybe_mark_dynamic(teacher_lse, 0)
        torch._dynamo.maybe_mark_dynamic(teacher_lse, 1)
        backend = "inductor" if compile is True else compile
        return compiled_chunk_fn(backend)(draft, teacher_logits, teacher_lse, hidden, rows_b, rows_t, keep)
    return _checkpointed_chunk(draft, teacher_logits, teacher_lse, hidden, rows_b, rows_t, keep)
