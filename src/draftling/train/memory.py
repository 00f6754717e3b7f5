"""Peak device memory of one draft training step, estimated from shapes and options alone.

``estimate_step_memory`` is a pure function of a ``TrainStep`` (the draft's shape, which is
the target's width: hidden, intermediate, heads, kv heads, head_dim, vocab; the draft vocab,
batch, sequence length, TTT steps, the teacher's share) and the memory options;
``estimate_train_memory`` takes the same as loose arguments. It counts what ``ttt_unroll``
actually keeps for backward under each option (see the per-term comments), walks the phases
of a step (draft placement, teacher forward, the loss backward of the last TTT step, the layer
backward, the optimizer step) and reports the components at the peak phase, in bytes. Each
component has its own function giving its bytes in every phase; the estimate adds them up.
For a ``BlockShape`` (a dflash head) it counts what ``block_loss`` keeps instead (the last
section): its peak is usually the forward's loss line, all slots' fp32 logits.

The teacher's side (its weights, its forward, a device map's split) and a run config resolved
into a step (``plan_run``, ``largest_fitting_batch``) are in memory_fit.py; ``draftling plan``
prints them (cli/plan_text.py), without loading any weights.

Accounting notes, all from reading the code paths the trainer runs:

- Params and grads are in the draft dtype ``a`` (2 bytes for bf16 over host fp32 masters,
  4 for fp32). ``RMSNorm`` upcasts to fp32 and saves that copy (4 bytes/element) plus its
  normalized output in ``a``.
- With ``grad_checkpoint`` a TTT step keeps only its inputs (token embeddings, the hidden
  state it reads, earlier steps' keys/values); its activations come back, for one step at
  a time, while that step is back-propagated (the "layer backward" phase).
- With ``loss_chunk_tokens`` a step keeps only the gathered valid rows [N, H] and indices;
  one chunk of [C, V_draft] softmax math exists at a time, in the loss backward.
- The optimizer's fp32 masters and moments are on the host with offload (16 bytes/param of
  pinned + pageable host RAM); otherwise AdamW keeps two moments in the param dtype on the
  device and its foreach step allocates one more param-sized buffer.

``lab/benches/train_bench.py`` measures these numbers on a GPU and records the estimate's error
beside each measurement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from draftling.dtypes import dtype_bytes, dtype_name
from draftling.train.memory_shapes import BlockShape, DraftShape

GIB = 2**30
# Bytes per (row x draft-vocab entry) of one loss chunk at its widest: eager, four fp32
# [C, V_draft] tensors (logits, log-softmax, teacher softmax, product); compiled, the head's
# logits and their gradient in the draft dtype plus one fp32 buffer (EXTRA).
EAGER_CHUNK_BYTES = 16
COMPILED_CHUNK_EXTRA_BYTES = 4


@dataclass(frozen=True)
class MemoryOptions:
    """The memory features, resolved (no auto values). Defaults: everything on."""

    optimizer_offload: bool = True
    # Draft built on the host and moved after the teacher. Either way place_draft holds the
    # fp32 weights on the device before the cast, so the estimate does not change with it.
    build_on_cpu: bool = True
    fsdp: bool = False  # an FSDP2 wrapper (mixed precision, fp32 grad reduce) even at world size 1
    embedding_on_host: bool = True
    loss_chunk_tokens: int = 2048
    grad_checkpoint: bool = True
    attention: str = "flex"  # "flex" or "sdpa"
    compile: bool = True  # the loss chunks compiled (only with loss_chunk_tokens)
    compile_layer: bool = True  # the decoder layer's two halves compiled (train.compile)
    draft_dtype: str = "bfloat16"
    embed_dtype: str = "bfloat16"  # the target's dtype: aux states and embedding rows

    @classmethod
    def from_unroll_options(
        cls,
        mem: dict,
        *,
        optimizer_offload: bool,
        draft_dtype,
        embed_dtype,
        embedding_on_host: bool,
        fsdp: bool = False,
        build_on_cpu: bool = True,
    ) -> MemoryOptions:
        """From ``settings.memory_options``'s dict plus the choices made outside the unroll;
        dtypes may be torch dtypes or their names."""

        def name(dtype) -> str:
            return dtype if isinstance(dtype, str) else dtype_name(dtype)

        return cls(
            optimizer_offload=bool(optimizer_offload),
            build_on_cpu=build_on_cpu,
            fsdp=fsdp,
            embedding_on_host=embedding_on_host,
            loss_chunk_tokens=mem["loss_chunk_tokens"],
            grad_checkpoint=mem["grad_checkpoint"],
            attention=mem["attention"],
            compile=mem.get("compile", False),
            compile_layer=mem.get("compile_layer", False),
            draft_dtype=name(draft_dtype),
            embed_dtype=name(embed_dtype),
        )


@dataclass(frozen=True)
class TrainStep:
    """One training step as the estimate sees it: the draft's shape, the batch and the
    teacher's share of the device."""

    shape: DraftShape
    batch: int
    seq: int
    ttt_steps: int
    valid_fraction: float = 1.0  # the share of positions with a loss (the chunked head sees only those)
    teacher_weight_bytes: int = 0  # the resident teacher (0 when it is stubbed or absent)
    teacher_forward_bytes: int = 0  # its forward's working memory (0: no teacher forward phase, e.g. offline)
    embedding_in_teacher: bool = False  # the token embedding is the teacher's own table: nothing extra


# The phases of a step, in order; _phases drops those the options do not have.
PHASES = (
    "build",
    "fsdp_unshard",
    "teacher_forward",
    "loss_forward",
    "loss_backward",
    "layer_backward",
    "layer_backward_2",
    "fsdp_reduce",
    "optimizer_step",
)


def estimate_train_memory(
    shape: DraftShape, batch: int, seq: int, ttt_steps: int, options: MemoryOptions = MemoryOptions(), **step
) -> dict:
    """``estimate_step_memory`` of ``TrainStep(shape, batch, seq, ttt_steps, **step)``: ``step``
    takes TrainStep's optional fields by name (valid_fraction, teacher_weight_bytes, ...)."""
    return estimate_step_memory(TrainStep(shape, batch, seq, ttt_steps, **step), options)


def estimate_step_memory(step: TrainStep, options: MemoryOptions = MemoryOptions()) -> dict:
    """Peak device bytes of one training step, with the components at the peak phase.

    Returns a dict of ints (bytes): draft_params, draft_grads, optimizer_state, embedding,
    teacher_weights, teacher_outputs, activations, transient, total: what is resident at the
    peak phase, so they add up to the total (e.g. in the layer backward the last step's loss
    rows are already freed, and in the teacher forward no grads exist yet). Plus
    peak_phase, phases (each phase's total), activations_saved (everything the forward keeps
    for backward), host (host RAM the options move there) and num_params.
    """
    o = options
    if o.attention not in ("flex", "sdpa"):
        raise ValueError(f"attention {o.attention!r}: expected flex or sdpa")
    z = _Sizes(step, o)
    saved = _block_saved(z) if z.block else _activations(z)
    by_phase = _block_activations_by_phase if z.block else _activations_by_phase
    opt_state, opt_step = _optimizer(z)
    embedding = 0 if (o.embedding_on_host or step.embedding_in_teacher) else z.s.vocab * z.H * z.e
    # Each component's bytes by phase (absent: 0), in the result's order.
    columns = {
        "draft_params": _draft_params(z),
        "draft_grads": _block_grads(z) if z.block else _draft_grads(z),
        "optimizer_state": {p: opt_state for p in PHASES if p != "build"},
        "embedding": dict.fromkeys(PHASES, embedding),
        "teacher_weights": dict.fromkeys(PHASES, step.teacher_weight_bytes),
        "teacher_outputs": _teacher_outputs(z),
        "activations": by_phase(z, saved),
        "transient": _transients(z, opt_step),
    }
    phases = {}
    for name in _phases(z):
        parts = {k: int(column.get(name, 0)) for k, column in columns.items()}
        phases[name] = {**parts, "total": sum(parts.values())}
    peak_phase = max(phases, key=lambda k: phases[k]["total"])
    return {
        **phases[peak_phase],
        "peak_phase": peak_phase,
        "activations_saved": int(saved.total),  # all steps' saved state at the end of forward
        "phases": {k: v["total"] for k, v in phases.items()},
        "num_params": z.P,
        "host": {
            "optimizer": 16 * z.P if o.optimizer_offload else 0,
            "embedding": z.s.vocab * z.H * z.e if o.embedding_on_host else 0,
        },
    }


class _Sizes:
    """A step's sizes in the terms' notation: a, e bytes per element of the draft and the
    embedding dtype; widths H, I, Ht (aux), Vd (draft vocab), q and kv (projections); nh heads;
    S TTT steps, T sequence length, tok tokens, n_valid of them with a loss; P params."""

    def __init__(self, step: TrainStep, options: MemoryOptions):
        s = self.s = step.shape
        self.step, self.o = step, options
        self.a, self.e = dtype_bytes(options.draft_dtype), dtype_bytes(options.embed_dtype)
        self.S, self.T, self.batch = step.ttt_steps, step.seq, step.batch
        self.H, self.I, self.Ht, self.Vd = s.hidden, s.intermediate, s.ht, s.draft_vocab
        self.nh, self.q, self.kv = s.heads, s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.tok = step.batch * step.seq
        self.n_valid = int(self.tok * step.valid_fraction)
        self.counts = s.param_counts()
        self.P = sum(self.counts.values())
        self.block = isinstance(s, BlockShape)
        if isinstance(s, BlockShape):  # block queries, their logit rows in the loss, keys per row
            self.L = s.layers
            self.n = step.batch * s.anchors * s.block_size
            self.n_loss = step.batch * s.anchors * (s.block_size - 1)
            self.row_keys = step.seq + s.anchors * s.block_size


def _phases(z: _Sizes) -> list[str]:
    present = {
        "fsdp_unshard": z.o.fsdp,
        "fsdp_reduce": z.o.fsdp,
        "teacher_forward": bool(z.step.teacher_forward_bytes),
        "loss_forward": z.block,
        "layer_backward_2": z.S > 1 and not z.block,
    }
    return [p for p in PHASES if present.get(p, True)]


# --- the components, by phase ----------------------------------------------------------------


def _draft_params(z: _Sizes) -> dict[str, int]:
    """Placed in fp32 (then cast, or sharded with FSDP), then in the draft dtype; FSDP frees
    the gathered params before the reduce, and with offload steps the host's shards."""
    out = dict.fromkeys(PHASES, z.a * z.P)
    out["build"] = 4 * z.P
    out["fsdp_reduce"] = 0
    if z.o.fsdp and z.o.optimizer_offload:
        out["optimizer_step"] = 0
    return out


def _draft_grads(z: _Sizes) -> dict[str, int]:
    a, P, counts = z.a, z.P, z.counts
    head = counts["lm_head"] + counts["norm"]
    return {
        "loss_backward": a * head,
        # The last step's layer: of its grads the MLP's exist once its backward is under way.
        "layer_backward": a * (head + counts["mlp"]),
        "layer_backward_2": a * (P - counts["fc"]),  # the next one down: every layer grad exists
        "fsdp_reduce": a * P,
        "optimizer_step": 0 if z.o.fsdp else a * P,
    }


def _optimizer(z: _Sizes) -> tuple[int, int]:
    """(state kept on the device, working memory of the optimizer step)."""
    o, a, P = z.o, z.a, z.P
    if o.fsdp:
        # distributed.wrap's layout: fp32 shards (on the host with offload, else on the device
        # with fp32 moments and sharded grads); the device holds the gathered params in the
        # compute dtype through forward and backward.
        return (0, 0) if o.optimizer_offload else ((4 + 8 + 4) * P, 4 * P)
    if o.optimizer_offload:  # each grad goes to the pinned fp32 buffer through an fp32 copy
        return 0, 4 * z.s.largest_param() if a != 4 else 0
    return 2 * a * P, a * P  # AdamW's two moments; its foreach step's sqrt of all second moments


def _teacher_outputs(z: _Sizes) -> dict[str, int]:
    """Aux states, draft logits, argmaxes and mask, from the teacher forward on (the previous
    batch's outputs died with its graph: run_batch's locals)."""
    outputs = z.tok * (3 * z.Ht * z.e + z.e * z.Vd + 8 + 1) + z.tok * 8
    return {p: outputs for p in PHASES if p != "build"}


@dataclass(frozen=True)
class _Saved:
    """What the forward leaves alive for backward: each TTT step's, one step's loss rows, all."""

    steps: list[float]
    loss: float
    total: float


def _activations(z: _Sizes) -> _Saved:
    a, e, H, S, tok = z.a, z.e, z.H, z.S, z.tok
    steps = []
    for j in range(S):
        if z.o.grad_checkpoint:  # the checkpoint's inputs only; positions + j is int64
            per_tok = e * H + a * H + 8 + (2 * a * z.kv if j < S - 1 else 0)
        else:
            per_tok = _layer_saved(z, j)
        steps.append(per_tok * tok)
    if z.o.loss_chunk_tokens > 0:  # gathered valid rows, their indices
        loss = z.n_valid * (a * H + 24)
    else:  # head norm (fp32 copy, y, output), log-softmax and teacher softmax in fp32
        loss = tok * (4 * H + 2 * a * H + 8 * z.Vd + 1)
    fuse = tok * 3 * z.Ht * a if a != e else 0  # fc's input cast to the draft dtype
    embed_rows = min(tok + 1, z.s.vocab) * (H * e + 8) if z.o.embedding_on_host else 0
    return _Saved(steps, loss, sum(steps) + S * loss + fuse + embed_rows)


def _activations_by_phase(z: _Sizes, saved: _Saved) -> dict[str, float]:
    """All of it in the loss backward; then the last step's loss rows are freed, and in the
    next layer down one more step's loss rows and saved state."""
    out = {"loss_backward": saved.total, "layer_backward": saved.total - saved.loss}
    if z.S > 1:
        out["layer_backward_2"] = saved.total - 2 * saved.loss - saved.steps[z.S - 1]
    return out


def _transients(z: _Sizes, optimizer_step: int) -> dict[str, float]:
    """Working memory of each phase, on top of what is resident."""
    o, a, P, largest = z.o, z.a, z.P, z.s.largest_param()
    out = {"teacher_forward": z.step.teacher_forward_bytes, "optimizer_step": optimizer_step}
    out.update(_block_transients(z) if z.block else _unroll_transients(z))
    if o.fsdp:
        # The cast all-gather inputs beside the gathered output, plus (offload) one fp32 shard
        # on its way from the host; then the grads cast to fp32 for the reduce.
        out["fsdp_unshard"] = a * P + (4 * largest if o.optimizer_offload else 0)
        out["fsdp_reduce"] = max(4 * P, 8 * P - a * P)
    else:  # place_draft casts the fp32 weights one param at a time
        out["build"] = a * largest if a != 4 else 0
    return out


def _unroll_transients(z: _Sizes) -> dict[str, float]:
    out = {"loss_backward": _loss_transient(z), "layer_backward": _layer_transient(z, z.S - 1)}
    if z.S > 1:
        out["layer_backward_2"] = _layer_transient(z, z.S - 2)
    return out


def _loss_transient(z: _Sizes) -> float:
    """The loss backward of the last TTT step: its softmax math (one chunk at a time when
    chunked), the head's weight grad, and the grads on their way to the hidden state."""
    a, H, Vd = z.a, z.H, z.Vd
    grad_of_hidden = a * H * (z.tok + z.n_valid)  # index backward's [B, T, H] and the rows' grads
    if z.o.loss_chunk_tokens > 0:
        c = min(z.o.loss_chunk_tokens, max(z.n_valid, 1))
        per_vocab = 2 * a + COMPILED_CHUNK_EXTRA_BYTES if z.o.compile else EAGER_CHUNK_BYTES
        return c * (4 * H + 2 * a * H + per_vocab * Vd) + a * H * Vd + grad_of_hidden
    # grads of log-softmax in fp32, of the logits in fp32 and in the draft dtype
    return z.tok * (8 + a) * Vd + a * H * Vd + grad_of_hidden


def _layer_transient(z: _Sizes, j: int) -> float:
    """Backward of step j's decoder-layer call, on top of what it saved (with grad_checkpoint,
    that comes back first): the MLP part (the grads of the output and of two [I]-wide tensors,
    and the weight grad being formed), then the attention part, by which time the MLP's saved
    tensors are gone."""
    a, H, I, q, S = z.a, z.H, z.I, z.q, z.S
    if z.o.attention == "flex":
        attn_grads = a * (q + 2 * S * z.kv) + 4 * z.nh  # dq, dk/dv of all concatenated steps, delta
    else:  # grads of the probabilities (draft dtype, fp32) and of the scores, dq/dk/dv repeated
        attn_grads = (8 + a) * z.nh * (_score_columns(z) + S) + a * (q + 2 * S * q)
    freed_by_attention = 4 * a * I + 4 * H + 2 * a * H
    weight_grad = a * max(H * I, 2 * H * q)
    grad_flow = max(
        z.tok * (2 * a * H + 2 * a * I) + weight_grad, z.tok * (2 * a * H + attn_grads - freed_by_attention)
    )
    return grad_flow + (_layer_saved(z, j) * z.tok if z.o.grad_checkpoint else 0)


def _layer_saved(z: _Sizes, j: int) -> float:
    """Bytes per token one decoder-layer call keeps for backward (no checkpointing)."""
    a, H, I, q, kv, d = z.a, z.H, z.I, z.q, z.kv, z.s.head_dim
    if z.o.compile_layer:
        # Compiled halves keep what the matmul backwards need and recompute the cheap rest:
        # the 2H-wide q/k/v input and the two norms' fp32 rstd; q, k, v, cos and sin; the
        # attention's own state; o_proj's input; the residual and the MLP input; gate and up.
        b = 2 * a * H + 8 + a * (q + 2 * kv) + 2 * a * d + _attention_saved(z, j)
        return b + a * q + 2 * a * H + 4 + 2 * a * I
    b = a * H  # input_layernorm(embeds): the normalized embeds (the embeds need no grad)
    b += 4 * H + a * H  # hidden_norm: fp32 copy of the hidden state, normalized output
    b += 2 * a * H  # cat(...) of width 2H, saved once by q/k/v_proj
    b += a * (q + 2 * kv) + 2 * a * d  # q, k after RoPE, v; cos and sin
    b += _attention_saved(z, j)
    b += a * q  # o_proj input (the attention output made contiguous)
    b += 4 * H + 2 * a * H  # post_attention_layernorm: fp32 copy, normalized, weighted
    return b + 4 * a * I  # MLP: gate, silu(gate), up, silu(gate) * up


def _score_columns(z: _Sizes) -> int:
    """Step-0 score columns per query with sdpa: the sequence, or with a window the two query
    blocks of train/attention.banded_ttt_attention."""
    return 2 * min(max(z.s.window, 64), z.T) if z.s.window else z.T


def _attention_saved(z: _Sizes, j: int) -> float:
    """Bytes per token the attention of step j saves for backward (beyond q, k, v)."""
    a, q, nh, T = z.a, z.q, z.nh, z.T
    if z.o.attention == "flex":
        out = a * q + 4 * nh  # output and logsumexp
        return out + (2 * (j + 1) * a * z.kv if j > 0 else 0)  # keys/values of steps 0..j, concatenated
    rep = z.s.heads > z.s.kv_heads  # GQA: keys/values repeated to the query heads
    if z.s.window:  # banded, every step: a block of queries sees its block and the one before
        cols = _score_columns(z)
        out = (2 * a * q if rep else 0) + (j * a * q if rep else 0) + j * a * q + a * q
        return out + (4 + (a if a != 4 else 0)) * nh * (cols + j) + cols / z.batch
    if j == 0:  # F.scaled_dot_product_attention, causal: repeated k/v, output, logsumexp
        return (2 * a * q if rep else 0) + a * q + 4 * nh
    out = 2 * a * q if rep else 0  # repeated step-0 keys/values
    out += (j * a * q if rep else 0) + j * a * q  # repeated diagonal keys, stacked diagonal values
    out += (4 + (a if a != 4 else 0)) * nh * (T + j)  # softmax probabilities in fp32, cast back
    return out + T / z.batch  # the [T, T] bool causal mask, per token


# --- a dflash head: block_loss (train/block_loss.py) ------------------------------------------
# It runs eager, unchunked, through sdpa with a bool mask and without autocast: grad_checkpoint,
# loss_chunk_tokens, attention, compile and compile_layer do not apply to it.


def _block_grads(z: _Sizes) -> dict[str, int]:
    """None at the loss's peaks; the head's in the top layer's backward (its own: a transient)."""
    a, head = z.a, z.counts["lm_head"] + z.counts["norm"]
    return {"layer_backward": a * head, "fsdp_reduce": a * z.P, "optimizer_step": 0 if z.o.fsdp else a * z.P}


def _block_layer_saved(z: _Sizes) -> float:
    """Bytes per block query one decoder layer keeps for backward (eager, as ``_layer_saved``)."""
    a, H, q, kv = z.a, z.H, z.q, z.kv
    b = 2 * (4 + a) * H  # the two RMSNorms: fp32 copy, normalized output
    b += (4 + a) * (q + kv) + 4 * (z.nh + z.s.kv_heads)  # q_norm, k_norm: the same, and rstd
    b += 3 * a * q + 4 * z.nh  # q after RoPE; the attention's output and logsumexp; o_proj's input
    return b + 4 * a * z.I  # MLP: gate, silu(gate), up, their product


def _block_head_saved(z: _Sizes) -> float:
    """The final norm (fp32 copy, normalized) and lm_head's input; the blocks' cos and sin."""
    return z.n * ((4 + 2 * z.a) * z.H + 2 * z.a * z.s.head_dim)


def _block_saved(z: _Sizes) -> _Saved:
    """What block_loss's forward leaves for backward: per layer its queries' state, the keys
    and values sdpa saves over context and blocks (repeated to the query heads under GQA) with
    the mask as a float bias, and the context keys' k_norm; the context feature (hidden_norm,
    its output, cos and sin, fc's input cast to the draft dtype); the head; the loss's rows:
    log-softmax and the teacher's softmax in fp32."""
    a, H, tok = z.a, z.H, z.tok
    keys = 2 * a * (z.q if z.nh > z.s.kv_heads else z.kv)
    layer = z.n * (_block_layer_saved(z) + z.row_keys * a) + z.batch * z.row_keys * keys + tok * (4 + a) * z.kv
    first = z.n * 4 * H  # layer 0's input norm keeps no fp32 copy: the embeddings need no grad
    context = tok * ((4 + 2 * a) * H + 2 * a * z.s.head_dim + (3 * z.Ht * a if a != z.e else 0))
    loss = 8 * z.n_loss * z.Vd
    return _Saved([layer] * z.L, loss, z.L * layer - first + context + _block_head_saved(z) + loss)


def _block_activations_by_phase(z: _Sizes, saved: _Saved) -> dict[str, float]:
    """All of it through the loss; in the top layer's backward the loss rows and head are gone."""
    top = saved.total - saved.loss - _block_head_saved(z)
    return {"loss_forward": saved.total, "loss_backward": saved.total, "layer_backward": top}


def _block_transients(z: _Sizes) -> dict[str, float]:
    """The loss line of the forward: all slots' logits in fp32 and the product with the teacher's
    softmax, beside each layer's context K/V and the bool mask, which block_loss still holds.
    Its backward: once the product's grad frees the teacher's softmax, the log-softmax's grad.
    The top layer's backward: ``_block_layer_transient``."""
    forward = 4 * (z.n + z.n_loss) * z.Vd + z.L * z.tok * 2 * z.a * z.kv + z.n * z.row_keys
    return {"loss_forward": forward, "loss_backward": 4 * z.n_loss * z.Vd, "layer_backward": _block_layer_transient(z)}


def _block_layer_transient(z: _Sizes) -> float:
    """The top layer's backward at its widest, with the weight grads formed by then: down_proj's
    beside the incoming grad, d(product) and the grads of silu(gate) and up (the product freed);
    then gate's and up's as the MLP's [I]-wide tensors go; then o_proj's, dq and dK/dV over
    every key (repeated, then summed)."""
    a, H, I, n, mlp = z.a, z.H, z.I, z.n, 3 * z.a * z.H * z.I
    down = n * a * (H + 2 * I) + a * H * I
    gate_up = mlp + 2 * a * n * (H - I)
    attn = mlp + a * H * z.q + n * a * (2 * H + z.q - 4 * I) + z.batch * z.row_keys * 2 * a * (z.q + z.kv)
    return max(down, gate_up, attn)


def options_dict(options: MemoryOptions) -> dict:
    return dataclasses.asdict(options)


__all__ = [
    "DraftShape",
    "BlockShape",
    "MemoryOptions",
    "TrainStep",
    "estimate_train_memory",
    "estimate_step_memory",
    "GIB",
]
