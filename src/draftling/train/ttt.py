"""The EAGLE-3 training-time-test (TTT) unroll and its loss and metrics.

Alignment, for a sequence x_0..x_{T-1} whose target logits z_t predict x_{t+1}:
step j at position t reads embed(x_{t+1+j}) and (j == 0) the fused target feature at t or
(j > 0) the draft's own step j-1 output at t, sits at position t+j, and predicts
x_{t+2+j}, whose target distribution is z_{t+1+j}. That is exactly what the draft sees
at decode time, where step j extends the chain one token past step j-1.

Attention at step j: the query at t sees the step-0 keys at positions <= t (causal) and
the keys of steps 1..j at position t only (the diagonal), as a tree branch would. With a
sliding window W (the draft config's ``sliding_window``), the step-0 keys are only those at
positions > t+j-W: the query sits at position t+j, and the engine windows by position.

Memory options (all exact up to float summation order; see TrainConfig for defaults):

- ``loss_chunk_tokens``: the head, log-softmax, soft cross-entropy and argmax run over
  chunks of the valid positions, each under activation checkpointing, so no
  [B*T, V_draft] fp32 tensor exists for the whole batch, in forward or backward.
- ``grad_checkpoint``: each TTT step's decoder layer runs under
  ``torch.utils.checkpoint`` (non-reentrant) and is recomputed in backward. The
  attention state is explicit (earlier steps' keys/values go in, this step's come out),
  so recomputation cannot append to a shared cache twice.
- ``attention`` (train/attention.py): "sdpa" (explicit scores; works everywhere, with backward on CPU) or
  "flex" (``flex_attention`` over the concatenated keys with a TTT ``mask_mod``;
  torch 2.13 has no flex backward on CPU, so "flex" is for CUDA training and CPU
  inference only).
- ``compile``: with ``loss_chunk_tokens``, each checkpointed loss chunk (head, log-softmax,
  soft cross-entropy, argmax) runs as one ``torch.compile``d function, so the [C, V_draft]
  softmax math is a few fused passes instead of a dozen eager kernels. The chunk's row
  count is marked dynamic up front: one compiled graph serves every chunk size.
- ``compile_layer``: the decoder layer's two attention-free halves (norms, q/k/v, RoPE; and
  o_proj, residuals, MLP) each run as one compiled function; the attention between them
  is flex's own kernel (or SDPA). The sequence length is marked dynamic.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from draftling.draft.model import Eagle3DecoderLayer, Eagle3Draft, draft_window
from draftling.train.attention import ttt_attention
from draftling.train.step_counts import StepCounts
from draftling.train.teacher import TeacherBatch
from draftling.train.ttt_loss import loss_chunk, teacher_logsumexp


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n]; the last n positions get ``fill``."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


# --- the layer steps (their attention: train/attention.py) ---------------------------------

_COMPILED_HALVES: dict = {}


def compiled_layer_halves(backend="inductor"):
    """The decoder layer's two attention-free halves (norms, projections, RoPE; output
    projection, residuals, MLP) under ``torch.compile``: their dozens of small elementwise
    kernels fuse into a few. Compiled as plain functions of (layer, ...), so one cache
    entry serves every draft (dynamo guards on the module it is given)."""
    fns = _COMPILED_HALVES.get(backend)
    if fns is None:
        fns = tuple(
            torch.compile(f, backend=backend, dynamic=None)
            for f in (Eagle3DecoderLayer.attention_inputs, Eagle3DecoderLayer.attention_to_output)
        )
        _COMPILED_HALVES[backend] = fns
    return fns


def _draft_step(draft: Eagle3Draft, backend: str, compile, embeds, hidden, positions, keys: tuple, values: tuple):
    """One TTT step as a pure function of its inputs: returns (hidden, k, v) of this step.
    ``compile``: False, or a torch.compile backend (True = inductor) for the layer's halves."""
    window = draft_window(draft.config)
    if not compile:
        new: dict = {}

        def attend(q, k, v):
            new["k"], new["v"] = k, v
            return ttt_attention(q, (*keys, k), (*values, v), backend, window)

        out = draft.step(embeds, hidden, positions, attend)  # the same layer halves decoding runs
        return out, new["k"], new["v"]
    # The same computation as draft.step, with the layer's halves compiled.
    layer = draft.midlayer
    cos, sin = draft.rotary_emb(hidden, positions)
    embeds = embeds.to(hidden.dtype)
    inputs_fn, output_fn = compiled_layer_halves("inductor" if compile is True else compile)
    for x in (embeds, hidden, cos, sin):  # batch lengths vary: one graph for all of them
        torch._dynamo.maybe_mark_dynamic(x, 1)
    q, k, v = inputs_fn(layer, embeds, hidden, cos, sin)
    out = ttt_attention(q, (*keys, k), (*values, v), backend, window)
    torch._dynamo.maybe_mark_dynamic(out, 2)
    return draft.carry(output_fn(layer, hidden, out)), k, v


# --- loss and metrics ------------------------------------------------------------------


def chain_walk(correct: Sequence[Sequence[bool]], loss_mask: Sequence[int]) -> list[int]:
    """The draft tokens each round of a greedy chain decode accepts over one teacher-forced
    sequence: ``correct[j][t]`` says step j at position t (which predicts token t+2+j) was
    right. Each run of loss tokens is one reply: its first token comes from the target (the
    prefill), so the first round sits at the token before it; a round accepts its leading
    correct steps and the next one starts after them and the bonus token.

    Simulated tau averages over every position, but a decode starts rounds only where the
    last one stopped, often just after a miss: this walk is what the decode measures."""
    steps, length = len(correct), len(loss_mask)
    rounds: list[int] = []
    start = 0
    while start < length:
        if not loss_mask[start]:
            start += 1
            continue
        end = start
        while end < length and loss_mask[end]:
            end += 1
        t = start - 1  # tokens start..end-1 are the reply; the last scored one is end-1
        while t >= 0 and t + 2 <= end - 1:
            k = 0
            while k < steps and t + 2 + k <= end - 1 and correct[k][t]:
                k += 1
            rounds.append(k)
            t += k + 1
        start = end
    return rounds


def step_masks(loss_mask: torch.Tensor, in_draft: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([steps,B,T] scored, [steps,B,T] valid) for a combined loss/attention mask. Step j at t
    predicts x_{t+2+j}: scored where that token is a loss token, valid where in addition the
    target's argmax at t+1+j lies in the draft vocab (only there is there a loss)."""
    scored = torch.stack([shift_left(loss_mask, 2 + j, False) for j in range(steps)])
    in_vocab = torch.stack([shift_left(in_draft, 1 + j, False) for j in range(steps)])
    return scored, scored & in_vocab


def step_valid_counts(
    loss_mask: torch.Tensor, attention_mask: torch.Tensor, in_draft: torch.Tensor, steps: int
) -> torch.Tensor:
    """[steps] int64: how many positions carry a loss at each TTT step (as ttt_unroll counts)."""
    return step_masks(loss_mask.bool() & attention_mask.bool(), in_draft, steps)[1].sum((1, 2))


def step_row_bounds(loss_mask: torch.Tensor, attention_mask: torch.Tensor, steps: int) -> list[int]:
    """[steps] scored positions per TTT step: a bound on the rows with a loss that needs no
    teacher. From the host's copy of a batch's masks it costs no device read; it is what
    ``ttt_unroll(row_bounds=...)`` sizes the chunked loss by."""
    mask = loss_mask.bool() & attention_mask.bool()
    return [int(shift_left(mask, 2 + j, False).sum()) for j in range(steps)]


def _denominator(denominators, j: int, n_valid: torch.Tensor):
    """Step j's loss divisor: this batch's valid count, or the given one (a number or a tensor
    element, which stays on the device)."""
    if denominators is None:
        return n_valid.clamp(min=1)
    d = denominators[j]
    return d.clamp(min=1e-12).float() if isinstance(d, torch.Tensor) else max(float(d), 1e-12)


@dataclass(frozen=True)
class UnrollOptions:
    """How ``ttt_unroll`` runs: the TTT depth, the loss weight of step j (``step_weight_decay ** j``)
    and the memory options of the module doc. The defaults are the plain path; the trainer's
    come from ``train.settings.unroll_options``.

    ``compile``: False, True (inductor), or another ``torch.compile`` backend (a name or a
    callable; the CPU tests use "aot_eager"). ``compile_layer``: the same for the decoder
    layer's two attention-free halves. ``autocast``: run the forward under ``torch.autocast``
    in this dtype (a dtype or its name): matmuls and attention in bf16 over fp32 params; the
    softmaxes and loss stay fp32."""

    steps: int
    step_weight_decay: float = 0.8
    loss_chunk_tokens: int = 0
    grad_checkpoint: bool = False
    attention: str = "sdpa"
    compile: bool | str | Callable = False
    compile_layer: bool | str | Callable = False
    autocast: torch.dtype | str | None = None


def ttt_unroll(
    draft: Eagle3Draft,
    embed,
    teacher: TeacherBatch,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    options: UnrollOptions | int | None = None,
    *,
    loss_denominators: Sequence[float] | torch.Tensor | None = None,
    row_bounds: Sequence[int] | None = None,
    **overrides,
) -> tuple[torch.Tensor, StepCounts]:
    """Run the k-step unroll. Returns the weighted loss (mean over valid tokens per step)
    and the counts behind the per-step and conditional accuracies.

    ``embed`` maps token ids to embeddings: the target's embedding module, or anything
    with ``for_batch(input_ids) -> lookup`` (see ``HostEmbedding``), which is asked once
    per batch. ``options``: an ``UnrollOptions``, or just the step count (the plain path);
    ``overrides``: UnrollOptions fields set over it, so ``ttt_unroll(..., 3)`` and
    ``ttt_unroll(..., steps=3, grad_checkpoint=True)`` need no options object.

    ``loss_denominators``: step j's summed loss is divided by ``loss_denominators[j]``
    instead of this batch's valid count. Data parallelism passes the global count over
    world size, so averaged gradients equal those of one process on the whole batch. A tensor
    stays on the device.

    ``row_bounds``: per step, at least as many rows as carry a loss (``step_row_bounds`` of the
    host's masks). The chunked loss then takes its rows at those fixed sizes, padded with rows it
    leaves out, and the unroll reads nothing back from the device; without them it reads the
    exact counts once. The counts come back on the device (see StepCounts).

    Without gradients (validation) the counts also hold a chain walk over each sequence
    (``chain_walk``), which costs a host sync: ``metrics()["chain_tau"]``.
    """
    options = _with_overrides(options, overrides)
    autocast = options.autocast
    if isinstance(autocast, str):
        autocast = getattr(torch, autocast)
    with torch.autocast(input_ids.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        return _unroll(
            draft, embed, teacher, input_ids, loss_mask, attention_mask, options, loss_denominators, row_bounds
        )


def _with_overrides(options: UnrollOptions | int | None, overrides: dict) -> UnrollOptions:
    if isinstance(options, UnrollOptions):
        return dataclasses.replace(options, **overrides) if overrides else options
    if options is not None:
        if "steps" in overrides:
            raise TypeError("ttt_unroll: the step count given twice")
        overrides = {"steps": options, **overrides}
    if "steps" not in overrides:
        raise TypeError("ttt_unroll: give the step count (steps=) or an UnrollOptions")
    return UnrollOptions(**overrides)


def _unroll(
    draft, embed, teacher, input_ids, loss_mask, attention_mask, options: UnrollOptions, loss_denominators, row_bounds
):
    loss_mask = loss_mask.bool() & attention_mask.bool()
    scored_steps, valid_steps = step_masks(loss_mask, teacher.in_draft, options.steps)
    layer = _LayerSteps(draft, embed, teacher, input_ids, options)
    step_loss = _StepLoss(draft, teacher, valid_steps, options, loss_denominators, row_bounds)
    tally = _StepTally(scored_steps)
    total = layer.hidden.new_zeros((), dtype=torch.float32)
    for j in range(options.steps):
        hidden = layer(j)
        loss_sum, n_valid, correct, weighted = step_loss(j, hidden)
        total = total + (options.step_weight_decay**j) * weighted
        tally.add(j, loss_sum, n_valid, correct)
    return total, tally.counts(loss_mask)


class _LayerSteps:
    """The TTT steps' decoder-layer forwards. The attention state (every earlier step's keys
    and values) is explicit, so a step recomputed under checkpointing appends nothing twice."""

    def __init__(
        self, draft: Eagle3Draft, embed, teacher: TeacherBatch, input_ids: torch.Tensor, options: UnrollOptions
    ):
        b, t = input_ids.shape
        self.draft, self.input_ids, self.options = draft, input_ids, options
        self.positions = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)
        self.lookup = embed.for_batch(input_ids) if hasattr(embed, "for_batch") else embed
        self.hidden = draft.fuse(teacher.aux)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.checkpointed = options.grad_checkpoint and torch.is_grad_enabled()

    def __call__(self, j: int) -> torch.Tensor:
        """Step j's hidden states [B, T, H]; its keys and values join the state."""
        with torch.no_grad():
            embeds = self.lookup(shift_left(self.input_ids, 1 + j))
        args = (
            self.draft,
            self.options.attention,
            self.options.compile_layer,
            embeds,
            self.hidden,
            self.positions + j,
            tuple(self.keys),
            tuple(self.values),
        )
        if self.checkpointed:
            self.hidden, k, v = checkpoint(_draft_step, *args, use_reentrant=False)
        else:
            self.hidden, k, v = _draft_step(*args)
        self.keys.append(k)
        self.values.append(v)
        return self.hidden


class _StepLoss:
    """Step j's loss against the teacher: (summed soft cross-entropy, valid count, [B, T] where
    the draft's argmax matches the teacher's, the sum over its denominator). Over chunks of the
    valid rows with ``loss_chunk_tokens``, else over the whole batch's logits. Nothing is read
    back from the device when the chunked loss has its row bounds."""

    def __init__(
        self,
        draft: Eagle3Draft,
        teacher: TeacherBatch,
        valid_steps: torch.Tensor,
        options: UnrollOptions,
        denominators,
        row_bounds: Sequence[int] | None,
    ):
        self.draft, self.teacher, self.valid_steps = draft, teacher, valid_steps
        self.chunk, self.denominators = options.loss_chunk_tokens, denominators
        self.draft_argmax = teacher.draft_logits.argmax(-1)
        if self.chunk > 0:
            with torch.no_grad():
                teacher_lse = teacher_logsumexp(teacher.draft_logits)
            self.chunk_fn = functools.partial(
                loss_chunk, draft, teacher.draft_logits, teacher_lse, compile=options.compile
            )
            # Without bounds from the host: the exact counts, read once before the step loop.
            self.bounds = list(row_bounds) if row_bounds is not None else valid_steps.sum((1, 2)).tolist()

    def __call__(self, j: int, hidden: torch.Tensor):
        # The label for position t at step j is the target's prediction at t+1+j.
        return self.chunked(j, hidden) if self.chunk > 0 else self.whole(j, hidden)

    def chunked(self, j: int, hidden: torch.Tensor):
        b, t = hidden.shape[:2]
        n, c = self.bounds[j], self.chunk
        # Step j's valid positions (flat, in order) at the host-known size n: the spare ones are
        # b*t, no position. They read position 0 and are left out of the sum and the hits.
        flat = torch.nonzero_static(self.valid_steps[j].flatten(), size=n, fill_value=b * t).squeeze(1)
        keep = flat < b * t
        at = torch.where(keep, flat, 0)
        vb, label_t = at // t, (at % t + 1 + j).clamp(max=t - 1)  # only spare rows ever clamp
        rows = hidden.flatten(0, 1)[at]  # [n, H]: only the valid positions ever reach the head
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        argmax = []
        # At least one (possibly empty) chunk, so the head always joins the graph.
        for s in range(0, max(n, 1), c):
            part, am = self.chunk_fn(rows[s : s + c], vb[s : s + c], label_t[s : s + c], keep[s : s + c])
            loss_sum = loss_sum + part
            argmax.append(am)
        n_valid = self.valid_steps[j].sum()
        step_loss = loss_sum / _denominator(self.denominators, j, n_valid)
        with torch.no_grad():
            hits = torch.zeros(b * t + 1, dtype=torch.bool, device=hidden.device)  # the last: spare rows
            hits[flat] = torch.cat(argmax) == self.draft_argmax[vb, label_t]
        return loss_sum, n_valid, hits[:-1].view(b, t), step_loss

    def whole(self, j: int, hidden: torch.Tensor):
        valid = self.valid_steps[j]
        logits = self.draft.compute_logits(hidden).float()
        target_p = shift_left(self.teacher.draft_logits, 1 + j).float().softmax(-1)
        logp = logits.log_softmax(-1)
        token_loss = -(target_p * logp).sum(-1)
        loss_sum = (token_loss * valid).sum()
        n_valid = valid.sum()
        step_loss = loss_sum / _denominator(self.denominators, j, n_valid)
        with torch.no_grad():
            correct = (logits.argmax(-1) == shift_left(self.draft_argmax, 1 + j)) & valid
        return loss_sum, n_valid, correct, step_loss


class _StepTally:
    """The per-step counts, kept on the device (a StepCounts over one [6, steps] tensor), and
    without gradients (validation) each step's hits for the chain walk, which reads them."""

    def __init__(self, scored_steps: torch.Tensor):
        self.scored_steps = scored_steps
        self.walking = not torch.is_grad_enabled()  # validation: walk each sequence as a chain decode would
        self.correct_steps: list[torch.Tensor] = []
        self.chain_ok = torch.ones(scored_steps.shape[1:], dtype=torch.bool, device=scored_steps.device)
        self.per_step: list[torch.Tensor] = []

    def add(self, j: int, loss_sum: torch.Tensor, n_valid: torch.Tensor, correct: torch.Tensor) -> None:
        if self.walking:
            self.correct_steps.append(correct)
        with torch.no_grad():
            scored = self.scored_steps[j]
            chain_valid = self.chain_ok & scored
            self.chain_ok = chain_valid & correct
            self.per_step.append(
                torch.stack(
                    [
                        loss_sum.detach().double(),
                        n_valid.double(),
                        correct.sum().double(),
                        chain_valid.sum().double(),
                        self.chain_ok.sum().double(),
                        scored.sum().double(),
                    ]
                )
            )

    def counts(self, loss_mask: torch.Tensor) -> StepCounts:
        counts = StepCounts(len(self.per_step), torch.stack(self.per_step, dim=1))  # [field, step]
        if self.walking:
            flags = torch.stack(self.correct_steps).cpu().tolist()  # [steps][b][t]
            for i, mask in enumerate(loss_mask.cpu().tolist()):
                walked = chain_walk([f[i] for f in flags], mask)
                counts.walk_rounds += len(walked)
                counts.walk_accepted += sum(walked)
        return counts
