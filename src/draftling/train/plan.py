"""Peak device memory of one draft training step, estimated from shapes and options alone.

``estimate_step_memory`` is a pure function of a ``TrainStep`` (the draft's shape, which is
the target's width: hidden, intermediate, heads, kv heads, head_dim, vocab; the draft vocab,
batch, sequence length, TTT steps, the teacher's share) and the memory options;
``estimate_train_memory`` takes the same as loose arguments. It counts what ``ttt_unroll``
actually keeps for backward under each option (see the per-term comments), walks the phases
of a step (draft placement, teacher forward, the loss backward of the last TTT step, the layer
backward, the optimizer step) and reports the components at the peak phase, in bytes. Each
component has its own function giving its bytes in every phase; the estimate adds them up.

``draftling plan`` (``add_plan_parser`` / ``cmd_plan``) reads only the target's config, adds
the teacher's weights (param count from the config x bytes per param) and prints whether a
run fits on a GPU of a given size, without loading any weights.

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
- The teacher's weights: param count from its config x bytes per param of the run's dtype
  (a GGUF file is dequantized to that dtype by transformers on load) or of its on-load
  quantization (~4.5 bits for 4-bit, ~8.5 for 8-bit; embedding and head stay unquantized).

``lab/benches/train_bench.py`` measures these numbers on a GPU and records the estimate's error
beside each measurement.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from draftling.config import parse_size

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
# Bits per quantized weight including scales (e.g. nf4 with blockwise absmax ~ 4.5).
QUANT_BITS = {"bnb-4bit": 4.5, "quanto-int4": 4.5, "bnb-8bit": 8.5, "quanto-int8": 8.5,
              "torchao-int8": 8.5}
# What max_memory_allocated does not see but the device still needs: the CUDA context and
# the caching allocator's fragmentation.
RESERVE_FIXED_BYTES = int(0.5 * GIB)
RESERVE_SHARE = 0.05
# Bytes per (row x draft-vocab entry) of one loss chunk at its widest: eager, four fp32
# [C, V_draft] tensors (logits, log-softmax, teacher softmax, product); compiled, the head's
# logits and their gradient in the draft dtype plus one fp32 buffer (EXTRA).
EAGER_CHUNK_BYTES = 16
COMPILED_CHUNK_EXTRA_BYTES = 4


def _dtype_bytes(name: str) -> int:
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class DraftShape:
    """The draft's shape: one decoder layer of the target's width over a draft vocab."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # the TARGET vocab (the embedding table)
    draft_vocab: int
    target_hidden: int | None = None  # the aux states' width; the draft's hidden by default
    window: int = 0  # draft.window: the sdpa TTT attention then runs banded (train/ttt.py)

    @classmethod
    def from_config(cls, config, draft_vocab: int, window: int = 0) -> "DraftShape":
        """From a draft's config, or from a target's (the draft's default shape)."""
        config = getattr(config, "text_config", None) or config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(hidden=config.hidden_size, intermediate=config.intermediate_size, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   vocab=config.vocab_size, draft_vocab=min(int(draft_vocab), config.vocab_size),
                   window=int(window))

    @property
    def ht(self) -> int:
        return self.target_hidden or self.hidden

    def param_counts(self) -> dict[str, int]:
        """Trainable params by module, as ``Eagle3Draft`` builds them (no biases)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "fc": 3 * self.ht * h,
            "attention": 2 * h * q + 2 * (2 * h * kv) + q * h,
            "mlp": 3 * h * self.intermediate,
            "layer_norms": 3 * h,
            "norm": h,
            "lm_head": h * self.draft_vocab,
        }

    def num_params(self) -> int:
        return sum(self.param_counts().values())

    def largest_param(self) -> int:
        h, q = self.hidden, self.heads * self.head_dim
        return max(3 * self.ht * h, 2 * h * q, h * self.intermediate, h * self.draft_vocab)


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
    def from_unroll_options(cls, mem: dict, *, optimizer_offload: bool, draft_dtype, embed_dtype,
                            embedding_on_host: bool, fsdp: bool = False,
                            build_on_cpu: bool = True) -> "MemoryOptions":
        """From ``trainer.memory_options``'s dict plus the choices made outside the unroll;
        dtypes may be torch dtypes or their names."""
        def name(dtype) -> str:
            return str(dtype).replace("torch.", "")

        return cls(optimizer_offload=bool(optimizer_offload), build_on_cpu=build_on_cpu, fsdp=fsdp,
                   embedding_on_host=embedding_on_host, loss_chunk_tokens=mem["loss_chunk_tokens"],
                   grad_checkpoint=mem["grad_checkpoint"], attention=mem["attention"],
                   compile=mem.get("compile", False), compile_layer=mem.get("compile_layer", False),
                   draft_dtype=name(draft_dtype), embed_dtype=name(embed_dtype))


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
PHASES = ("build", "fsdp_unshard", "teacher_forward", "loss_backward", "layer_backward",
          "layer_backward_2", "fsdp_reduce", "optimizer_step")


def estimate_train_memory(shape: DraftShape, batch: int, seq: int, ttt_steps: int,
                          options: MemoryOptions = MemoryOptions(), **step) -> dict:
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
    saved = _activations(z)
    opt_state, opt_step = _optimizer(z)
    embedding = 0 if (o.embedding_on_host or step.embedding_in_teacher) else z.s.vocab * z.H * z.e
    # Each component's bytes by phase (absent: 0), in the result's order.
    columns = {"draft_params": _draft_params(z), "draft_grads": _draft_grads(z),
               "optimizer_state": {p: opt_state for p in PHASES if p != "build"},
               "embedding": dict.fromkeys(PHASES, embedding),
               "teacher_weights": dict.fromkeys(PHASES, step.teacher_weight_bytes),
               "teacher_outputs": _teacher_outputs(z), "activations": _activations_by_phase(z, saved),
               "transient": _transients(z, opt_step)}
    phases = {}
    for name in _phases(z):
        parts = {k: int(column.get(name, 0)) for k, column in columns.items()}
        phases[name] = {**parts, "total": sum(parts.values())}
    peak_phase = max(phases, key=lambda k: phases[k]["total"])
    return {**phases[peak_phase], "peak_phase": peak_phase,
            "activations_saved": int(saved.total),  # all steps' saved state at the end of forward
            "phases": {k: v["total"] for k, v in phases.items()}, "num_params": z.P,
            "host": {"optimizer": 16 * z.P if o.optimizer_offload else 0,
                     "embedding": z.s.vocab * z.H * z.e if o.embedding_on_host else 0}}


class _Sizes:
    """A step's sizes in the terms' notation: a, e bytes per element of the draft and the
    embedding dtype; widths H, I, Ht (aux), Vd (draft vocab), q and kv (projections); nh heads;
    S TTT steps, T sequence length, tok tokens, n_valid of them with a loss; P params."""

    def __init__(self, step: TrainStep, options: MemoryOptions):
        s = self.s = step.shape
        self.step, self.o = step, options
        self.a, self.e = _dtype_bytes(options.draft_dtype), _dtype_bytes(options.embed_dtype)
        self.S, self.T, self.batch = step.ttt_steps, step.seq, step.batch
        self.H, self.I, self.Ht, self.Vd = s.hidden, s.intermediate, s.ht, s.draft_vocab
        self.nh, self.q, self.kv = s.heads, s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.tok = step.batch * step.seq
        self.n_valid = int(self.tok * step.valid_fraction)
        self.counts = s.param_counts()
        self.P = sum(self.counts.values())


def _phases(z: _Sizes) -> list[str]:
    present = {"fsdp_unshard": z.o.fsdp, "fsdp_reduce": z.o.fsdp,
               "teacher_forward": bool(z.step.teacher_forward_bytes), "layer_backward_2": z.S > 1}
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
    return {"loss_backward": a * head,
            # The last step's layer: of its grads the MLP's exist once its backward is under way.
            "layer_backward": a * (head + counts["mlp"]),
            "layer_backward_2": a * (P - counts["fc"]),  # the next one down: every layer grad exists
            "fsdp_reduce": a * P, "optimizer_step": 0 if z.o.fsdp else a * P}


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
    out = {"teacher_forward": z.step.teacher_forward_bytes, "loss_backward": _loss_transient(z),
           "layer_backward": _layer_transient(z, z.S - 1), "optimizer_step": optimizer_step}
    if z.S > 1:
        out["layer_backward_2"] = _layer_transient(z, z.S - 2)
    if o.fsdp:
        # The cast all-gather inputs beside the gathered output, plus (offload) one fp32 shard
        # on its way from the host; then the grads cast to fp32 for the reduce.
        out["fsdp_unshard"] = a * P + (4 * largest if o.optimizer_offload else 0)
        out["fsdp_reduce"] = max(4 * P, 8 * P - a * P)
    else:  # place_draft casts the fp32 weights one param at a time
        out["build"] = a * largest if a != 4 else 0
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
    grad_flow = max(z.tok * (2 * a * H + 2 * a * I) + weight_grad,
                    z.tok * (2 * a * H + attn_grads - freed_by_attention))
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
    blocks of train/ttt.banded_ttt_attention."""
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


# --- the teacher -----------------------------------------------------------------------------

def _first(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def target_param_counts(config) -> dict[str, int]:
    """Params of an HF causal LM from its config: embedding, output head (0 when tied) and
    the decoder layers (dense or mixture-of-experts MLPs, biases where the config has them)."""
    c = getattr(config, "text_config", None) or config
    h, layers, v = c.hidden_size, c.num_hidden_layers, c.vocab_size
    nh = c.num_attention_heads
    nkv = _first(c, "num_key_value_heads", default=nh)
    d = _first(c, "head_dim", default=h // nh)
    model_type = getattr(c, "model_type", "")
    attn = 2 * h * nh * d + 2 * h * nkv * d
    if getattr(c, "attention_bias", False):  # Llama-style: on all four projections
        attn += nh * d + 2 * nkv * d + h
    elif model_type in ("qwen2", "qwen2_moe"):  # q/k/v biases, not configurable
        attn += nh * d + 2 * nkv * d
    if model_type.startswith("qwen3"):  # per-head RMSNorm of q and k
        attn += 2 * d
    dense_mlp = 3 * h * c.intermediate_size + (2 * c.intermediate_size + h if getattr(c, "mlp_bias", False) else 0)
    experts = _first(c, "num_local_experts", "num_experts", "n_routed_experts")
    if experts:
        moe_i = _first(c, "moe_intermediate_size", default=c.intermediate_size)
        shared = _first(c, "n_shared_experts", default=0) * 3 * h * moe_i
        shared += 3 * h * _first(c, "shared_expert_intermediate_size", default=0)
        moe_mlp = experts * 3 * h * moe_i + h * experts + shared
        n_dense = min(layers, _first(c, "first_k_dense_replace", default=0))
        mlp = n_dense * dense_mlp + (layers - n_dense) * moe_mlp
    else:
        mlp = layers * dense_mlp
    tied = getattr(config, "tie_word_embeddings", getattr(c, "tie_word_embeddings", False))
    return {"embedding": v * h, "lm_head": 0 if tied else v * h,
            "layers": layers * (attn + 2 * h) + mlp, "final_norm": h}


def teacher_weight_bytes(config, dtype: str, quantization: str | None = None,
                         bits: float | None = None) -> int:
    """Device bytes of the teacher's weights. A GGUF target is dequantized by transformers on
    load, so it takes ``dtype`` bytes per param like any other. ``quantization`` (the run's
    on-load quantization) or ``bits`` set the bits of the decoder weights; the embedding and
    output head stay in ``dtype`` (the quantizers skip them)."""
    counts = target_param_counts(config)
    dense = _dtype_bytes(dtype)
    bits = _decoder_bits(quantization, bits)
    if bits is None:
        return sum(counts.values()) * dense
    kept = counts["embedding"] + counts["lm_head"] + counts["final_norm"]
    return int(counts["layers"] * bits / 8 + kept * dense)


def _decoder_bits(quantization: str | None, bits: float | None) -> float | None:
    """Bits per decoder weight: ``bits``, else the on-load quantization's, else None (the dtype's)."""
    if bits is None and quantization:
        bits = QUANT_BITS.get(quantization)
        if bits is None:
            raise ValueError(f"quantization {quantization!r}: no bits-per-weight estimate; pass bits")
    return bits


@dataclass(frozen=True)
class TeacherSplit:
    """Where a device map puts the teacher's weights (``device_map``, target/devmap.py)."""

    source: str  # the run config's device_map
    by_device: dict  # {GPU index, "cpu" or "disk": bytes}
    training_device: int  # the GPU the draft trains on
    # The largest module's weights that stream through the training device per call: accelerate
    # offloads a GPU map's "cpu" and "disk" modules and runs them there, one module at a time.
    streamed: int

    @property
    def on_training_device(self) -> int:
        return self.by_device.get(self.training_device, 0)


def teacher_split(cfg, target_config, gpu_bytes: int, bits: float | None = None) -> TeacherSplit:
    """The teacher's bytes per device under ``cfg.device_map``: a FILE as it is; auto and balanced
    as accelerate infers them, over ``cfg.max_memory`` or (unset) 90% of one GPU of ``gpu_bytes``
    (what transformers leaves itself on a lone GPU) and then host RAM. Params by the dtype, decoder
    weights by the quantization's bits as ``teacher_weight_bytes`` counts them."""
    from draftling.config import device_map_value, device_name, max_memory_bytes
    from draftling.target.aux import decoder_layers
    from draftling.target.devmap import empty_model, expand_device_map, infer_device_map
    from draftling.target.load import DTYPES

    dtype = cfg.dtype if cfg.dtype in DTYPE_BYTES else "float32"
    gpu = device_name(cfg.device, "device") if str(cfg.device).startswith("cuda") else 0
    model = empty_model(target_config, DTYPES[dtype])
    device_map = device_map_value(cfg.device_map)
    if isinstance(device_map, str):
        budget = max_memory_bytes(cfg.max_memory) or {gpu: int(0.9 * gpu_bytes), "cpu": 2**60}
        # accelerate warns of each GPU in the budget this machine lacks: planning, that is expected.
        quiet = logging.getLogger("accelerate.utils.modeling")
        level, _ = quiet.level, quiet.setLevel(logging.ERROR)
        try:
            device_map = infer_device_map(model, device_map, budget)
        finally:
            quiet.setLevel(level)
    placed = expand_device_map(model, device_map, cfg.device_map)
    layers = {id(p) for p in decoder_layers(model).parameters()}
    bits = _decoder_bits(getattr(cfg, "quantization", None), bits)
    by_device: dict = {}
    by_module: dict = {}
    for name, p in model.named_parameters():
        size = int(p.numel() * (bits / 8 if bits is not None and id(p) in layers else _dtype_bytes(dtype)))
        by_device[placed[name]] = by_device.get(placed[name], 0) + size
        if placed[name] in ("cpu", "disk"):
            by_module[name.rpartition(".")[0]] = by_module.get(name.rpartition(".")[0], 0) + size
    runs_on_gpu = any(isinstance(d, int) for d in by_device)  # else accelerate runs it on the CPU
    return TeacherSplit(cfg.device_map, by_device, gpu, max(by_module.values(), default=0) if runs_on_gpu else 0)


def teacher_forward_bytes(config, batch: int, seq: int, draft_vocab: int, dtype: str,
                          chunk_tokens: int = 2048) -> int:
    """Working memory of ``teacher_forward`` (no grad, no KV cache): one decoder layer's
    temporaries, or the output head's chunk of full-vocab logits and the draft-vocab rows."""
    c = getattr(config, "text_config", None) or config
    e = _dtype_bytes(dtype)
    tok = batch * seq
    nh = c.num_attention_heads
    d = _first(c, "head_dim", default=c.hidden_size // nh)
    nkv = _first(c, "num_key_value_heads", default=nh)
    inter = _first(c, "moe_intermediate_size", default=c.intermediate_size) \
        if _first(c, "num_local_experts", "num_experts", "n_routed_experts") else c.intermediate_size
    layer = tok * e * (3 * c.hidden_size + 2 * nh * d + 2 * nkv * d + 3 * inter)
    head = min(chunk_tokens, tok) * (c.vocab_size * e + 8) + draft_vocab * c.hidden_size * e
    assemble = tok * draft_vocab * 2 * e  # chunks, then their concatenation
    aux_capture = 3 * tok * c.hidden_size * e
    return int(max(layer, head, assemble) + aux_capture)


# --- resolving a run config ------------------------------------------------------------------

def resolve_options(tc, gpu_bytes: int, n_params: int, embed_dtype: str) -> MemoryOptions:
    """The trainer's choices for one CUDA process (train/settings.py), with the device's size
    given instead of queried."""
    from draftling.train.settings import draft_param_dtype, memory_options, optimizer_offload

    offload = optimizer_offload(tc, "cuda", n_params, device_bytes=gpu_bytes)
    dtype = draft_param_dtype(tc, "cuda", n_params, device_bytes=gpu_bytes)
    mem = memory_options(tc, "cuda", param_dtype=dtype)
    draft_dtype = str(dtype).removeprefix("torch.")
    return MemoryOptions.from_unroll_options(mem, optimizer_offload=offload, draft_dtype=draft_dtype,
                                             embed_dtype=embed_dtype, embedding_on_host=tc.embedding_on_host)


def plan_run(cfg, target_config, gpu_bytes: int, seq: int, batch: int, *, offline: bool = False,
             teacher_bits: float | None = None, split: TeacherSplit | None = None) -> dict:
    """The estimate for ``draftling train`` with this run config on one GPU of ``gpu_bytes``. With
    ``cfg.device_map`` only the teacher's share on that GPU counts (``split``: computed if None)."""
    from draftling.train.settings import FAST_MEMORY_SHARE, fast_train_config

    embed_dtype = cfg.dtype if cfg.dtype in DTYPE_BYTES else "float32"
    shape = DraftShape.from_config(target_config, cfg.vocab.size, cfg.draft.window)
    if cfg.draft.intermediate_size:  # the draft's own MLP width (lab/configs/gpu_smollm2.yaml: 4096)
        shape = dataclasses.replace(shape, intermediate=cfg.draft.intermediate_size)
    quantization = getattr(cfg, "quantization", None)
    if cfg.device_map and split is None:
        split = teacher_split(cfg, target_config, gpu_bytes, teacher_bits)
    weights = split.on_training_device if split else teacher_weight_bytes(target_config, embed_dtype,
                                                                          quantization, teacher_bits)
    tc, policy, options = cfg.train, "as configured", None
    if tc.memory_policy == "auto":
        # The trainer's rule (trainer.resolve_memory_policy), with the memory free after
        # loading the teacher taken as the GPU's size less the teacher's weights.
        fast = fast_train_config(tc)
        fast_options = resolve_options(fast, gpu_bytes, shape.num_params(), embed_dtype)
        need = estimate_train_memory(shape, batch, seq, tc.ttt_steps, fast_options)["total"]
        if need <= FAST_MEMORY_SHARE * (gpu_bytes - weights - RESERVE_FIXED_BYTES):
            tc, policy, options = fast, "fast (memory_policy auto: it fits without recompute)", fast_options
    options = options or resolve_options(tc, gpu_bytes, shape.num_params(), embed_dtype)
    forward = 0 if offline else teacher_forward_bytes(target_config, batch, seq, shape.draft_vocab, embed_dtype)
    forward += split.streamed if split and not offline else 0
    est = estimate_train_memory(shape, batch, seq, cfg.train.ttt_steps, options,
                                teacher_weight_bytes=weights, teacher_forward_bytes=forward,
                                embedding_in_teacher=True)
    reserve = RESERVE_FIXED_BYTES + int(RESERVE_SHARE * est["total"])
    return {"shape": shape, "options": options, "estimate": est, "reserve": reserve,
            "gpu_bytes": gpu_bytes, "headroom": gpu_bytes - est["total"] - reserve,
            "fits": est["total"] + reserve <= gpu_bytes, "batch": batch, "seq": seq,
            "teacher_params": sum(target_param_counts(target_config).values()), "policy": policy,
            "quantization": quantization, "teacher_dtype": embed_dtype, "split": split}


def largest_fitting_batch(cfg, target_config, gpu_bytes: int, seq: int, offline: bool = False,
                          teacher_bits: float | None = None, limit: int = 4096) -> int:
    """The largest batch size that fits at this sequence length (0 if none)."""
    split = teacher_split(cfg, target_config, gpu_bytes, teacher_bits) if cfg.device_map else None

    def fits(b: int) -> bool:
        return plan_run(cfg, target_config, gpu_bytes, seq, b, offline=offline, teacher_bits=teacher_bits,
                        split=split)["fits"]

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --- the CLI ---------------------------------------------------------------------------------

def _gib(x: float) -> str:
    return f"{x / GIB:8.2f}"


def format_plan(plan: dict, target_name: str, max_batch: int | None = None) -> str:
    est, opts, shape = plan["estimate"], plan["options"], plan["shape"]
    on = {True: "on", False: "off"}
    q = plan["quantization"] or plan["teacher_dtype"]
    lines = [
        f"target {target_name}: {plan['teacher_params'] / 1e6:.1f}M params ({q}), hidden {shape.hidden}, "
        f"vocab {shape.vocab}",
        f"draft: {est['num_params'] / 1e6:.1f}M params ({opts.draft_dtype}), draft vocab {shape.draft_vocab}; "
        f"batch {plan['batch']} x seq {plan['seq']}",
        f"options: optimizer_offload {on[opts.optimizer_offload]}, grad_checkpoint {on[opts.grad_checkpoint]}, "
        f"attention {opts.attention}, loss_chunk_tokens {opts.loss_chunk_tokens}, compile {on[opts.compile]}, "
        f"embedding_on_host {on[opts.embedding_on_host]}; memory policy: {plan['policy']}",
        "",
        f"  {'GiB':>43}",
    ]
    rows = [("teacher weights", est["teacher_weights"]), ("draft params", est["draft_params"]),
            ("draft grads", est["draft_grads"]), ("optimizer state (device)", est["optimizer_state"]),
            ("embedding (device, beyond the teacher)", est["embedding"]),
            ("teacher outputs", est["teacher_outputs"]), ("activations", est["activations"]),
            ("transient", est["transient"])]
    for name, value in rows:
        lines.append(f"  {name:<38}{_gib(value)}")
    lines += [f"  {'total (peak: ' + est['peak_phase'].replace('_', ' ') + ')':<38}{_gib(est['total'])}",
              f"  {'reserve (CUDA context, fragmentation)':<38}{_gib(plan['reserve'])}",
              f"  {'GPU memory':<38}{_gib(plan['gpu_bytes'])}",
              f"  {'headroom':<38}{_gib(plan['headroom'])}"]
    lines.append("  phases (GiB): " + ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in est["phases"].items()))
    lines.append(f"  activations saved for backward over all TTT steps: {est['activations_saved'] / GIB:.2f} GiB")
    host = est["host"]["optimizer"] + est["host"]["embedding"]
    if host:
        lines.append(f"  (host RAM for offloaded state: {host / GIB:.2f} GiB)")
    if plan["split"]:
        lines.append(split_line(plan["split"]))
    lines.append("")
    need = (est["total"] + plan["reserve"]) / GIB
    if plan["fits"]:
        lines.append(f"fits: {need:.2f} GiB needed of {plan['gpu_bytes'] / GIB:.2f} GiB "
                     f"({plan['headroom'] / GIB:.2f} GiB headroom)")
    else:
        lines.append(f"does NOT fit: {need:.2f} GiB needed of {plan['gpu_bytes'] / GIB:.2f} GiB "
                     f"(short by {-plan['headroom'] / GIB:.2f} GiB)")
    split = plan["split"]
    if split and split.source in ("auto", "balanced") and not plan["fits"] and split.on_training_device > -plan["headroom"]:
        cap = (split.on_training_device + plan["headroom"]) / GIB
        lines.append(f"to fit, keep at most ~{cap:.1f} GiB of the teacher on cuda:{split.training_device}: "
                     f"max_memory={{{split.training_device}: {cap:.1f}GiB, cpu: ...}}")
    if max_batch == 0:
        lines.append(f"no batch size fits at seq {plan['seq']}")
    elif max_batch is not None:
        lines.append(f"largest batch size that fits at seq {plan['seq']}: {max_batch}")
    return "\n".join(lines)


def split_line(split: TeacherSplit) -> str:
    """The teacher's share per device, and what streams through the training GPU."""
    def name(device) -> str:
        return f"cuda:{device}" if isinstance(device, int) else device

    parts = ", ".join(f"{name(d)} {b / GIB:.2f}" for d, b in sorted(split.by_device.items(), key=lambda x: str(x[0])))
    line = f"  teacher weights by device_map {split.source} (GiB): {parts}; cuda:{split.training_device} holds its share"
    if split.streamed:
        line += f", and streams offloaded modules through, up to {split.streamed / GIB:.2f} GiB at a time (transient)"
    return line


def options_dict(options: MemoryOptions) -> dict:
    return dataclasses.asdict(options)


__all__ = ["DraftShape", "MemoryOptions", "TrainStep", "estimate_train_memory", "estimate_step_memory",
           "teacher_weight_bytes", "teacher_split", "TeacherSplit", "target_param_counts", "teacher_forward_bytes",
           "parse_size", "plan_run", "format_plan", "largest_fitting_batch"]
