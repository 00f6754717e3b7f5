"""What the loss needs from the target, for one batch: the three aux states, the target's
logits restricted to the draft vocab, and the target's full-vocab argmax.

The output head runs in chunks over positions so a [tokens, target_vocab] fp32 tensor is
never materialised for the whole batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from draftling.target import Target, aux_hidden_states
from draftling.target.aux import compiled_decoder_layers
from draftling.target.quant import plain_weight


@dataclass
class TeacherBatch:
    aux: torch.Tensor  # [B, T, 3*H_t], low/mid/high concatenated
    draft_logits: torch.Tensor  # [B, T, V_d] target logits at the draft-vocab ids (target dtype)
    target_argmax: torch.Tensor  # [B, T] argmax over the FULL target vocab
    in_draft: torch.Tensor  # [B, T] bool: that argmax is in the draft vocab


@torch.no_grad()
def teacher_forward(target: Target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    t2d: torch.Tensor, chunk_tokens: int = 2048, compile=False) -> TeacherBatch:
    """``compile``: False, True (inductor) or a torch.compile backend for the decoder layers
    (see ``compiled_decoder_layers``); the fused elementwise work is most of a small
    target's forward time on a GPU."""
    decoder = target.model.get_decoder()
    layers = (compiled_decoder_layers(decoder, "inductor" if compile is True else compile)
              if compile else contextlib.nullcontext())
    with layers:
        out, aux = aux_hidden_states(decoder, target.aux_layer_ids, input_ids=input_ids,
                                     attention_mask=attention_mask, use_cache=False)
    final = out.last_hidden_state  # already final-normed
    head = target.output_head()
    t2d = t2d.to(final.device)
    weight = plain_weight(head)
    # A quantized head (bitsandbytes, torchao, quanto) has no float rows to slice: its
    # draft-vocab logits are the columns of its own full output instead.
    draft_rows = weight[t2d] if weight is not None else None  # [V_d, H]
    b, t, h = final.shape
    flat = final.reshape(-1, h)
    draft_logits, argmax = [], []
    for start in range(0, flat.shape[0], chunk_tokens):
        part = flat[start:start + chunk_tokens]
        logits = head(part)
        argmax.append(logits.argmax(-1))
        draft_logits.append(part @ draft_rows.T if draft_rows is not None else logits[:, t2d])
    argmax = torch.cat(argmax).view(b, t)
    return TeacherBatch(
        aux=torch.cat(aux, dim=-1),
        # In the target's dtype: a bf16 head's logits carry no more precision as fp32, and
        # the loss reads them at every TTT step (it upcasts per chunk).
        draft_logits=torch.cat(draft_logits).view(b, t, -1),
        target_argmax=argmax,
        in_draft=t2d[argmax],
    )


class TeacherCache:
    """Hybrid online/offline: keep each example's teacher outputs in host RAM on first
    sight and reuse them in later epochs, up to a byte budget. Rows are stored unpadded,
    so a later batch of different neighbours is assembled from them exactly."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, keys: list[int], lengths: list[int], device) -> TeacherBatch | None:
        if not all(k in self.rows for k in keys):
            return None
        t = max(lengths)
        parts = [self.rows[k] for k in keys]

        def stack(i, fill=0):
            out = []
            for p in parts:
                x = p[i]
                pad = [0, 0] * (x.dim() - 1) + [0, t - x.shape[0]]
                out.append(torch.nn.functional.pad(x, pad, value=fill))
            return torch.stack(out).to(device)

        return TeacherBatch(aux=stack(0), draft_logits=stack(1).float(), target_argmax=stack(2),
                            in_draft=stack(3, False))

    def put(self, keys: list[int], lengths: list[int], batch: TeacherBatch) -> None:
        for i, (k, n) in enumerate(zip(keys, lengths)):
            if k in self.rows:
                continue
            row = (batch.aux[i, :n].cpu(), batch.draft_logits[i, :n].to(torch.bfloat16).cpu(),
                   batch.target_argmax[i, :n].cpu(), batch.in_draft[i, :n].cpu())
            size = sum(x.numel() * x.element_size() for x in row)
            if self.used + size > self.budget:
                return
            self.rows[k] = row
            self.used += size
