"""What the loss needs from the target, for one batch: the three aux states, the target's
logits restricted to the draft vocab, and the target's full-vocab argmax.

The output head runs in chunks over positions so a [tokens, target_vocab] fp32 tensor is
never materialised for the whole batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from draftling.errors import DataError
from draftling.target import Target, aux_hidden_states
from draftling.target.aux import compiled_decoder_layers
from draftling.target.devmap import execution_device
from draftling.target.quant import plain_weight


@dataclass
class TeacherBatch:
    aux: torch.Tensor  # [B, T, 3*H_t], low/mid/high concatenated
    draft_logits: torch.Tensor  # [B, T, V_d] target logits at the draft-vocab ids (target dtype)
    target_argmax: torch.Tensor  # [B, T] argmax over the FULL target vocab
    in_draft: torch.Tensor  # [B, T] bool: that argmax is in the draft vocab

    def padded(self, length: int) -> TeacherBatch:
        """Right-padded with zeros to ``length`` positions, for a batch padded past its longest
        row (train.pad_to_multiple): no loss ever reads a padded position."""
        extra = length - self.aux.shape[1]
        if extra <= 0:
            return self

        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 2) + [0, extra])

        return TeacherBatch(pad(self.aux), pad(self.draft_logits), pad(self.target_argmax), pad(self.in_draft))


@torch.no_grad()
def teacher_forward(
    target: Target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    t2d: torch.Tensor,
    chunk_tokens: int = 2048,
    compile=False,
) -> TeacherBatch:
    """``compile``: False, True (inductor) or a torch.compile backend for the decoder layers
    (see ``compiled_decoder_layers``); the fused elementwise work is most of a small
    target's forward time on a GPU."""
    decoder = target.model.get_decoder()
    layers = (
        compiled_decoder_layers(decoder, "inductor" if compile is True else compile)
        if compile
        else contextlib.nullcontext()
    )
    with layers:
        out, aux = aux_hidden_states(
            decoder, target.aux_layer_ids, input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        )
    # A target dispatched over devices (device_map) leaves each state where its layer ran.
    aux = torch.cat([a.to(input_ids.device) for a in aux], dim=-1)  # the draft's device
    # last_hidden_state is already final-normed.
    return head_outputs(target, aux, out.last_hidden_state, t2d, chunk_tokens)


_DRAFT_IDS = WeakIdKeyDictionary()


def draft_token_ids(t2d: torch.Tensor) -> torch.Tensor:
    """The target ids of the draft vocab (where ``t2d`` is True, ascending), found once per
    ``t2d`` tensor (and kept while it is unchanged): indexing by the mask itself would read its
    count back from the device on every batch."""
    found = _DRAFT_IDS.get(t2d)
    if found is None or found[0] != t2d._version:
        found = _DRAFT_IDS[t2d] = (t2d._version, t2d.nonzero().squeeze(1))
    return found[1]


@torch.no_grad()
def head_outputs(
    target: Target, aux: torch.Tensor, final: torch.Tensor, t2d: torch.Tensor, chunk_tokens: int = 2048
) -> TeacherBatch:
    """The TeacherBatch for aux states [B,T,3H] and final-normed states [B,T,H]: the output
    head's draft-vocab logits and full-vocab argmax, on ``aux``'s device."""
    head = target.output_head()
    final = final.to(execution_device(head) or final.device)  # a dispatched head may run elsewhere
    t2d = t2d.to(final.device)
    ids = draft_token_ids(t2d)
    weight = plain_weight(head)
    # A quantized head (bitsandbytes, torchao, quanto) has no float rows to slice, nor has one
    # offloaded by a device map (its weight is a meta tensor between calls): their draft-vocab
    # logits are the columns of their own full output instead.
    draft_rows = weight[ids] if weight is not None and weight.device.type != "meta" else None  # [V_d, H]
    b, t, h = final.shape
    flat = final.reshape(-1, h)
    draft_logits, argmax = [], []
    for start in range(0, flat.shape[0], chunk_tokens):
        part = flat[start : start + chunk_tokens]
        logits = head(part)
        argmax.append(logits.argmax(-1))
        draft_logits.append(part @ draft_rows.T if draft_rows is not None else logits[:, ids])
    argmax = torch.cat(argmax).view(b, t)
    return TeacherBatch(
        aux=aux,
        # In the target's dtype: a bf16 head's logits carry no more precision as fp32, and
        # the loss reads them at every TTT step (it upcasts per chunk).
        draft_logits=torch.cat(draft_logits).view(b, t, -1).to(aux.device),
        target_argmax=argmax.to(aux.device),
        in_draft=t2d[argmax].to(aux.device),
    )


def pad_stack(rows: list[torch.Tensor], length: int, fill=0) -> torch.Tensor:
    """Stack unpadded per-sequence rows [n_i, ...] into [B, length, ...], padding with ``fill``."""
    return torch.stack(
        [torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1) + [0, length - x.shape[0]], value=fill) for x in rows]
    )


@runtime_checkable
class TeacherSource(Protocol):
    """Where the teacher's outputs come from instead of the resident target's forward (the
    trainer takes ``TeacherSource | None``; None: the target runs).

    ``cacheable``: whether the trainer's TeacherCache keeps its outputs (worth it when the
    source still runs the output head; an offline cache already holds the final outputs).
    ``get``: the outputs for the examples ``keys`` of ``lengths`` tokens, padded to the longest,
    on ``device``. ``for_split``: the same source's teacher for another split of the data (e.g.
    "val", whose jsonl hashes to ``data_hash``), or None when it has none."""

    cacheable: bool

    def get(self, keys: list[int], lengths: list[int], device) -> TeacherBatch: ...

    def for_split(self, split: str, data_hash: str | None = None) -> TeacherSource | None: ...


class TeacherCache:
    """Hybrid online/offline: keep each example's teacher outputs in host RAM on first
    sight and reuse them in later epochs, up to a byte budget. Rows are stored unpadded,
    so a later batch of different neighbours is assembled from them exactly.

    The draft-vocab logits are stored in bf16. So that a run resumed with an empty cache trains
    on the very tensors an uninterrupted run reads from it, every batch goes through the same
    rounding and assembly, cached or not (``put`` returns the batch as the cache holds it)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, keys: list[int], lengths: list[int], device) -> TeacherBatch | None:
        if not all(k in self.rows for k in keys):
            return None
        return self._assemble([self.rows[k] for k in keys], max(lengths), device)

    def put(self, keys: list[int], lengths: list[int], batch: TeacherBatch) -> TeacherBatch:
        """Keep the rows that fit the budget; return the whole batch as a cache hit would."""
        rows = [
            (
                batch.aux[i, :n].cpu(),
                batch.draft_logits[i, :n].to(torch.bfloat16).cpu(),
                batch.target_argmax[i, :n].cpu(),
                batch.in_draft[i, :n].cpu(),
            )
            for i, n in enumerate(lengths)
        ]
        for k, row in zip(keys, rows):
            size = sum(x.numel() * x.element_size() for x in row)
            if k in self.rows or self.used + size > self.budget:
                continue
            self.rows[k] = row
            self.used += size
        return self._assemble(rows, max(lengths), batch.aux.device)

    @staticmethod
    def _assemble(parts: list, t: int, device) -> TeacherBatch:
        def stack(i, fill=0):
            return pad_stack([p[i] for p in parts], t, fill).to(device)

        return TeacherBatch(
            aux=stack(0), draft_logits=stack(1).float(), target_argmax=stack(2), in_draft=stack(3, False)
        )


class KeptStatesTeacher:
    """Teacher outputs from the states kept at regeneration (data/states.py): only the output
    head runs, not the target's layers. ``cacheable``: the trainer keeps its outputs in the
    TeacherCache, so later epochs skip the head too."""

    cacheable = True

    def __init__(self, target: Target, states, t2d: torch.Tensor):
        self.target, self.states, self.t2d = target, states, t2d

    def __repr__(self) -> str:
        return f"KeptStatesTeacher({str(self.states.path)!r})"

    def for_split(self, split: str, data_hash: str | None = None) -> TeacherSource | None:
        """None: states are kept per jsonl file, and the trainer finds another split's beside
        its own file (inputs.kept_states_teacher)."""
        return None

    def get(self, keys: list[int], lengths: list[int], device) -> TeacherBatch:
        t = max(lengths)
        rows = [self.states.rows(k) for k in keys]
        for k, n, (aux, _) in zip(keys, lengths, rows):
            if aux.shape[0] != n:
                raise DataError(
                    f"{self.states.path}: row {k} has states for {aux.shape[0]} tokens but "
                    f"{n} tokens in the data; regenerate the data"
                )
        aux, final = (pad_stack([r[i] for r in rows], t).to(device) for i in (0, 1))
        self.t2d = self.t2d.to(device)  # once: head_outputs finds the draft ids once per t2d tensor
        return head_outputs(self.target, aux, final, self.t2d)
