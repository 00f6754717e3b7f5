"""The EAGLE-3 training-time-test (TTT) unroll and its loss and metrics.

Alignment, for a sequence x_0..x_{T-1} whose target logits z_t predict x_{t+1}:
step j at position t reads embed(x_{t+1+j}) and (j == 0) the fused target feature at t or
(j > 0) the draft's own step j-1 output at t, sits at position t+j, and predicts
x_{t+2+j}, whose target distribution is z_{t+1+j}. That is exactly what the draft sees
at decode time, where step j extends the chain one token past step j-1.

Attention at step j: the query at t sees the step-0 keys at positions <= t (causal) and
the keys of steps 1..j at position t only (the diagonal), as a tree branch would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from draftling.draft.model import Eagle3Draft, repeat_kv
from draftling.train.teacher import TeacherBatch


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n]; the last n positions get ``fill``."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


class TTTAttention:
    """Holds the step-0 keys and the diagonal keys of later steps across the unroll."""

    def __init__(self):
        self.k0 = self.v0 = None
        self.diag_k: list[torch.Tensor] = []
        self.diag_v: list[torch.Tensor] = []

    def __call__(self, q, k, v):
        n_rep = q.shape[1] // k.shape[1]
        if self.k0 is None:
            self.k0, self.v0 = k, v
            return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                                  is_causal=True)
        self.diag_k.append(repeat_kv(k, n_rep))
        self.diag_v.append(repeat_kv(v, n_rep))
        scale = 1.0 / math.sqrt(q.shape[-1])
        t = q.shape[2]
        k0, v0 = repeat_kv(self.k0, n_rep), repeat_kv(self.v0, n_rep)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        s0 = (q @ k0.transpose(-1, -2)) * scale
        s0 = s0.masked_fill(~causal, float("-inf"))
        sd = torch.stack([(q * dk).sum(-1) for dk in self.diag_k], dim=-1) * scale  # [B,h,T,j]
        p = torch.cat([s0, sd], dim=-1).float().softmax(-1).to(q.dtype)
        out = p[..., :t] @ v0
        dv = torch.stack(self.diag_v, dim=-2)  # [B,h,T,j,d]
        return out + (p[..., t:, None] * dv).sum(-2)


@dataclass
class StepCounts:
    """Summed counts over batches, so metrics are exact over any number of batches."""

    steps: int
    loss_sum: list[float] = field(default_factory=list)
    valid: list[int] = field(default_factory=list)
    correct: list[int] = field(default_factory=list)
    chain_valid: list[int] = field(default_factory=list)  # valid and all earlier steps correct
    chain_correct: list[int] = field(default_factory=list)

    def __post_init__(self):
        for name in ("loss_sum", "valid", "correct", "chain_valid", "chain_correct"):
            if not getattr(self, name):
                setattr(self, name, [0] * self.steps)

    def add(self, other: "StepCounts") -> None:
        for name in ("loss_sum", "valid", "correct", "chain_valid", "chain_correct"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])

    def metrics(self) -> dict:
        acc = [c / v if v else 0.0 for c, v in zip(self.correct, self.valid)]
        cond = [c / v if v else 0.0 for c, v in zip(self.chain_correct, self.chain_valid)]
        tau, prod = 1.0, 1.0
        for c in cond:
            prod *= c
            tau += prod
        loss = [s / v if v else 0.0 for s, v in zip(self.loss_sum, self.valid)]
        return {"loss_per_step": loss, "acc": acc, "cond_acc": cond, "sim_tau": tau,
                "tokens": self.valid[0] if self.valid else 0}


def ttt_unroll(draft: Eagle3Draft, embed: torch.nn.Module, teacher: TeacherBatch,
               input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor,
               steps: int, step_weight_decay: float = 0.8) -> tuple[torch.Tensor, StepCounts]:
    """Run the k-step unroll. Returns the weighted loss (mean over valid tokens per step)
    and the counts behind the per-step and conditional accuracies."""
    device = input_ids.device
    b, t = input_ids.shape
    positions = torch.arange(t, device=device).unsqueeze(0).expand(b, t)
    hidden = draft.fuse(teacher.aux)
    attend = TTTAttention()
    loss_mask = loss_mask.bool() & attention_mask.bool()
    draft_argmax = teacher.draft_logits.argmax(-1)
    counts = StepCounts(steps)
    chain_ok = torch.ones(b, t, dtype=torch.bool, device=device)
    total = hidden.new_zeros((), dtype=torch.float32)
    for j in range(steps):
        with torch.no_grad():
            embeds = embed(shift_left(input_ids, 1 + j))
        hidden = draft.step(embeds, hidden, positions + j, attend)
        logits = draft.compute_logits(hidden).float()
        # The label for position t at step j is the target's prediction at t+1+j.
        valid = shift_left(loss_mask, 2 + j, False) & shift_left(teacher.in_draft, 1 + j, False)
        target_p = shift_left(teacher.draft_logits, 1 + j).softmax(-1)
        logp = logits.log_softmax(-1)
        token_loss = -(target_p * logp).sum(-1)
        n_valid = int(valid.sum())
        step_loss = (token_loss * valid).sum() / max(n_valid, 1)
        total = total + (step_weight_decay ** j) * step_loss
        with torch.no_grad():
            correct = (logits.argmax(-1) == shift_left(draft_argmax, 1 + j)) & valid
            chain_valid = chain_ok & valid
            counts.loss_sum[j] = float((token_loss * valid).sum())
            counts.valid[j] = n_valid
            counts.correct[j] = int(correct.sum())
            counts.chain_valid[j] = int(chain_valid.sum())
            counts.chain_correct[j] = int((chain_valid & correct).sum())
            chain_ok = chain_valid & correct
    return total, counts
