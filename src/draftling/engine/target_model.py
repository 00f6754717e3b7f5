"""The target's forward pass over an own, static KV cache (gpt-fast style).

``CachedTarget`` reuses the HF modules of a Llama-family causal LM (weights shared, not
copied) but owns the KV cache: ``[layers, B, nkv, max_seq_len, d]`` for K and for V, written
with ``index_copy_`` at caller-given slots and read whole through a boolean mask. Every tensor
shape depends only on the query length, so the same code runs eagerly, with compiled layers
(``compile_once``) and inside a CUDA graph (``StaticFn``). HF's own
StaticCache broke under manual graph capture on the GPU machine, hence owning it.

The caller decides where K/V go (``cache_positions``) and what each query sees
(``attn_mask``), which is all tree verification and cache compaction need.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from draftling.dynamo import allow_recompiles
from draftling.engine.fused import FusedLayer, fuse_layer
from draftling.engine.options import EngineOptions
from draftling.errors import ConfigError, TargetError
from draftling.target.aux import decoder_layers, validate_aux_layer_ids

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LAYER_TYPES = {"full_attention", "sliding_attention"}  # config.layer_types the engine serves


class UnsupportedArchitecture(TargetError, NotImplementedError):
    """The target's architecture has no own-cache port in the engine."""


def _check_architecture(model, max_seq_len: int) -> None:
    cfg = model.config
    arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitecture(
            f"the decode engine supports {', '.join(SUPPORTED_MODEL_TYPES)} targets; "
            f"got {arch} (model_type {cfg.model_type!r})"
        )
    for i, layer in enumerate(decoder_layers(model)):
        attn = getattr(layer, "self_attn", None)
        need = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if (
            attn is None
            or any(m is None for m in need)
            or not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp"))
        ):
            raise UnsupportedArchitecture(f"{arch}: decoder layer {i} is not Llama-shaped")
    types = set(getattr(cfg, "layer_types", None) or ())
    if types - LAYER_TYPES:
        raise UnsupportedArchitecture(f"{arch}: layer types {sorted(types)}")
    # A window shorter than the cache would need a banded mask (the general path has one).
    window = getattr(cfg, "sliding_window", None)
    sliding = cfg.model_type == "mistral" or "sliding_attention" in types
    if window is not None and sliding and window < max_seq_len:
        raise UnsupportedArchitecture(
            f"{arch}: sliding-window attention ({window}) shorter than max_seq_len {max_seq_len}"
        )


def attention_inputs(layer, x, cos, sin, fused: FusedLayer | None = None):
    """A decoder layer up to attention: normed q [B,nh,q,d], RoPE'd k and v [B,nkv,q,d].
    ``fused``: the layer's fused projections (engine.fused), where it has them."""
    attn = layer.self_attn
    b, q, _ = x.shape
    d = attn.head_dim
    h = layer.input_layernorm(x)
    if fused is not None and fused.qkv is not None:
        qs, ks, vs = fused.qkv(h)
    else:
        qs, ks, vs = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    qs, ks = qs.view(b, q, -1, d), ks.view(b, q, -1, d)
    vs = vs.view(b, q, -1, d).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
        qs, ks = attn.q_norm(qs), attn.k_norm(ks)
    qs, ks = apply_rotary_pos_emb(qs.transpose(1, 2), ks.transpose(1, 2), cos, sin)
    return qs, ks, vs


def matmul_attention(q, k, v, mask, scale, exact: bool = False, sinks=None, softcap=None):
    """Attention as two batched matmuls and a softmax, GQA by grouping the query heads (no K/V
    repeat). Under torch.compile this is a few fused kernels, while SDPA with a boolean mask
    falls back to a generic kernel for short queries over a long cache.

    ``exact``: fp32 scores, then the softmax sum and probs @ V in float64 before rounding back.
    A tree node's ancestors sit at scattered cache slots while plain decoding has them in a
    row; summed in low precision, the same terms in a different order round differently and
    can flip a near-tied argmax. In float64 the order no longer shows after rounding.

    For the general path (engine/general_target.py): ``sinks`` [h], one extra logit per head
    that takes probability mass and carries no value (attention sinks); ``softcap``, scores
    squashed by tanh; and values as wide as they are (MLA's differ from the keys')."""
    b, h, t, d = q.shape
    nkv, s, dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = h // nkv
    qg = q.reshape(b, nkv, rep * t, d)
    if exact:
        scores = torch.matmul(qg.float(), k.float().transpose(-1, -2)) * scale
    else:
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dim() == 3:  # a mask per batch row: [B, t, s]
        mask = mask[:, None, None]
    scores = scores.view(b, nkv, rep, t, s).masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, nkv, rep, 1, 1).expand(b, -1, -1, t, 1)], -1)
    if exact:
        e = (scores - scores.amax(-1, keepdim=True)).exp().double()
        probs = (e / e.sum(-1, keepdim=True))[..., :s].reshape(b, nkv, rep * t, s)
        return torch.matmul(probs, v.double()).to(v.dtype).view(b, h, t, dv)
    probs = scores.softmax(-1)[..., :s].to(v.dtype).reshape(b, nkv, rep * t, s)
    return torch.matmul(probs, v).view(b, h, t, dv)


def attention_outputs(layer, x, q, k_cache, v_cache, attn_mask, kind: str, fused: FusedLayer | None = None):
    """The rest of a decoder layer: attention (``kind``, see engine.options.ATTENTION_KINDS)
    over the whole static cache, o_proj, MLP (gate and up as one matmul when ``fused`` has them)."""
    attn = layer.self_attn
    if kind != "sdpa":
        o = matmul_attention(q, k_cache, v_cache, attn_mask, attn.scaling, exact=kind == "exact")
    else:
        # Whole static cache + boolean mask: shapes never depend on the context length.
        o = F.scaled_dot_product_attention(
            q,
            k_cache,
            v_cache,
            attn_mask=row_mask(attn_mask),
            scale=attn.scaling,
            enable_gqa=k_cache.shape[1] != q.shape[1],
        )
    b, _, t, _ = q.shape
    x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
    h = layer.post_attention_layernorm(x)
    if fused is None or fused.gate_up is None:
        return x + layer.mlp(h)
    gate, up = fused.gate_up(h)
    return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)


def row_mask(attn_mask):
    """An SDPA mask: [q, S] for every batch row, or [B, q, S] (one per row) made [B, 1, q, S]."""
    return attn_mask[:, None] if attn_mask.dim() == 3 else attn_mask


def write_kv(cache, cache_positions, rows) -> None:
    """Write K or V ``rows`` [B, nkv, q, d] into ``cache`` [B, nkv, S, d] at ``cache_positions``:
    [q] (the same slots in every batch row) or [B, q] (each row its own, as a ragged batch needs)."""
    if cache_positions.dim() == 1:
        cache.index_copy_(2, cache_positions, rows)
    else:
        cache.scatter_(2, cache_positions[:, None, :, None].expand(-1, rows.shape[1], -1, rows.shape[3]), rows)


# Compiled once per process as plain functions of (layer, ...): one graph serves every layer
# of a model (the weights are inputs), so compiling costs two small graphs per query shape.
# An engine of one row compiles each shape it meets on its own (the batch-1 kernels). An
# engine of several rows takes dynamo's automatic dynamic shapes: a size that changes between
# calls (row count, query count) becomes symbolic, so one graph serves every level of a
# concurrency sweep where static shapes would compile a set per level (size 1 stays special).
# A prefill (``dynamic``) takes symbolic sizes from its first call: every prompt length differs.
_COMPILED: dict = {}


def compile_once(fn, rows: int = 1, dynamic: bool = False):
    dynamic = True if dynamic else False if rows == 1 else None
    if (fn, dynamic) not in _COMPILED:
        allow_recompiles()  # a shape per query count and tree config, and more than 8 of them is fine
        _COMPILED[fn, dynamic] = torch.compile(fn, dynamic=dynamic)
    return _COMPILED[fn, dynamic]


class TargetEngine(nn.Module):
    """What the decoding loops use of a target engine: ``forward`` / ``decode`` passes over
    its own cache, ``greedy_step``, ``move_kv`` and the ``StaticFn`` wrappers. Subclasses
    (``CachedTarget``, engine.general_target's ``GeneralCachedTarget``) provide ``_run``,
    ``prefill_rows``, ``gather_kv`` and ``scatter_kv``."""

    @classmethod
    def from_hf(
        cls,
        model,
        aux_layer_ids,
        max_seq_len: int,
        dtype=None,
        batch_size: int = 1,
        options: EngineOptions | None = None,
        **engine,
    ):
        """``engine``: EngineOptions fields as keywords (``compile=True``, ...), over ``options``."""
        return cls(model, aux_layer_ids, max_seq_len, batch_size, dtype, EngineOptions.of(options, **engine))

    @staticmethod
    def check_dtype(weights_dtype: torch.dtype, dtype) -> None:
        """The engine shares the target's weights: it cannot run them in another dtype."""
        if dtype is not None and dtype != weights_dtype:
            raise ConfigError(
                f"the engine shares the target's {weights_dtype} weights; convert the model "
                f"with model.to({dtype}) instead of asking for dtype={dtype}"
            )

    def _setup(self, options: EngineOptions, max_seq_len: int, batch_size: int, device) -> None:
        self.max_seq_len, self.batch_size = int(max_seq_len), int(batch_size)
        self.options = options
        self.compile, self.cuda_graphs = options.compile, options.cuda_graphs
        self.query_pad = options.query_pad
        self.attention = options.attention
        graphs = options.cuda_graphs
        self.fast = StaticFn(self.decode, cuda_graphs=graphs)
        self.register_buffer("cols", torch.arange(self.max_seq_len, device=device), persistent=False)
        self.fast_greedy = StaticFn(self.greedy_step, cuda_graphs=graphs)
        self._gather_fn = StaticFn(self.gather_kv, cuda_graphs=graphs)
        self._scatter_fn = StaticFn(self.scatter_kv, cuda_graphs=graphs)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def forward(self, input_ids, positions, cache_positions, attn_mask):
        return self._run(input_ids, positions, cache_positions, attn_mask, compiled=False)

    def decode(self, input_ids, positions, cache_positions, attn_mask):
        """A decode-sized pass (plain step or verify): compiled layers when ``compile``."""
        return self._run(input_ids, positions, cache_positions, attn_mask, compiled=self.compile)

    def greedy_step(self, token, position):
        """One plain greedy step as device work only: ``token`` [B,1] at ``position`` [B] ->
        (the argmax next token [B,1], position + 1). No host value goes in or out, so the host
        can queue many steps before it reads any token back. A batch row that has finished
        keeps stepping at the cache's last slot until the host refills it."""
        logits, _ = self.decode(
            token, position[:, None], position[:, None], self.cols[None, None] <= position[:, None, None]
        )
        return logits[:, -1].argmax(-1, keepdim=True), (position + 1).clamp(max=self.max_seq_len - 1)

    def pad_queries(self, input_ids, positions, cache_positions, attn_mask):
        """Pad a pass of 1..query_pad queries to ``query_pad`` rows (see ``CachedTarget``);
        positions come back [B, q']."""
        b, q = input_ids.shape
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(b, q)
        pad = self.query_pad - q if 0 < q < self.query_pad else 0
        if pad:
            input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(b, pad)], dim=1)
            positions = torch.cat([positions, positions[:, -1:].expand(b, pad)], dim=1)
            extra = cache_positions[..., -1:] + torch.arange(1, pad + 1, device=cache_positions.device)
            cache_positions = torch.cat([cache_positions, extra.clamp_(max=self.max_seq_len - 1)], dim=-1)
            # The last row's mask with its position: within a sliding window row 0's could be empty,
            # a NaN row whose K/V in the pad slots matmul attention then spreads (0 * NaN).
            attn_mask = torch.cat([attn_mask, attn_mask[..., -1:, :].expand(*attn_mask.shape[:-2], pad, -1)], dim=-2)
        return input_ids, positions, cache_positions, attn_mask

    @torch.no_grad()
    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy cache slots ``src`` to ``dst`` in every layer (accepted tree path -> contiguous).

        Two static functions (one graph each on a GPU), all rows read before any is written:
        src and dst overlap, so a single read-and-write function would not survive the repeat
        that graph warm-up makes; each half alone is safe to repeat."""
        k_rows, v_rows = self._gather_fn(src)
        self._scatter_fn(dst, k_rows, v_rows)


class CachedTarget(TargetEngine):
    """Own-KV-cache forward of an HF Llama/Mistral/Qwen2/Qwen3 causal LM.

    ``forward(input_ids [B,q], positions [B,q] or [q], cache_positions [q], attn_mask [q,S])``
    returns ``(logits [B,q,V], aux [B,q,3H])``; ``aux`` concatenates HF ``hidden_states[i]``
    (output of decoder layer i-1) for each aux id, in the given order.

    ``forward`` is always eager (prefill: its length varies); ``decode`` (and ``fast``, its
    CUDA graphs) runs each layer as two compiled halves around the eager cache write when
    ``compile`` is set. ``attention``: one of engine.options.ATTENTION_KINDS. These and
    ``cuda_graphs`` come in ``options``, an EngineOptions without "auto" (``from_hf`` also
    takes its fields as keywords).
    ``query_pad``: pad every pass of 1..query_pad queries to exactly ``query_pad`` rows. Then
    plain decode and every verify pass run the same kernels on the same shapes, so a token's
    logits do not depend on how many drafts were verified beside it: in bf16 a different
    matmul kernel per query count otherwise flips near-tied argmaxes and the speculative
    output drifts from plain greedy. Pad rows write K/V to the slots after the real ones,
    which every later pass overwrites before reading (the callers keep ``query_pad`` slots
    free at the end of the cache).
    """

    def __init__(
        self,
        model,
        aux_layer_ids,
        max_seq_len: int,
        batch_size: int = 1,
        dtype=None,
        options: EngineOptions | None = None,
    ):
        super().__init__()
        _check_architecture(model, max_seq_len)
        options = (options or EngineOptions()).check_resolved()
        cfg = model.config
        self.config = cfg
        base = model.get_decoder()
        # Plain attribute references: the HF modules (and their tensors) are shared.
        self.embed = model.get_input_embeddings()
        self.layers = decoder_layers(model)
        self.norm = base.norm
        self.lm_head = model.get_output_embeddings()
        self.rotary_emb = base.rotary_emb  # HF's class: rope scaling comes with it
        self.aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, len(self.layers))
        # Per layer: its fused projections, or None (a plain list: the tensors are the model's).
        self.fused = [fuse_layer(layer) if options.fuse else None for layer in self.layers]
        attn0 = self.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.num_kv_heads = cfg.num_key_value_heads
        wdtype = self.embed.weight.dtype
        self.check_dtype(wdtype, dtype)
        device = self.embed.weight.device
        # One buffer for all layers' K and one for V: moving the accepted path is then one
        # gather and one scatter per buffer instead of two per layer.
        shape = (len(self.layers), batch_size, self.num_kv_heads, int(max_seq_len), self.head_dim)
        self.register_buffer("k_all", torch.zeros(shape, dtype=wdtype, device=device), persistent=False)
        self.register_buffer("v_all", torch.zeros(shape, dtype=wdtype, device=device), persistent=False)
        self._setup(options, max_seq_len, batch_size, device)  # batch_size: requests, one cache row each
        self._prefill_fn = StaticFn(self._prefill, cuda_graphs=options.cuda_graphs)  # options.prefill_graphs

    def kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_all[i], self.v_all[i]

    def _run(self, input_ids, positions, cache_positions, attn_mask, compiled: bool, kv=None, last=None):
        """``cache_positions`` [q] or [B,q], ``attn_mask`` [q,S] or [B,q,S] (see ``write_kv``).
        ``kv``: (K, V) buffers to use instead of the cache (a prefill's scratch). ``last`` [B]:
        the logits of that query only per row, [B,1,V] (a ragged prefill's last real token).
        ``compiled`` with ``kv``: the layer halves compiled for any shape (a prefill)."""
        q = input_ids.shape[1]
        input_ids, positions, cache_positions, attn_mask = self.pad_queries(
            input_ids, positions, cache_positions, attn_mask
        )
        x = self.embed(input_ids)
        cos, sin = self.rotary_emb(x, positions)
        prefill = kv is not None
        attn_in = compile_once(attention_inputs, self.batch_size, prefill) if compiled else attention_inputs
        attn_out = compile_once(attention_outputs, self.batch_size, prefill) if compiled else attention_outputs
        k_all, v_all = kv if prefill else (self.k_all, self.v_all)
        want = set(self.aux_layer_ids)
        aux = {}
        for i, layer in enumerate(self.layers):
            fused = self.fused[i]
            qs, ks, vs = attn_in(layer, x, cos, sin, fused)
            write_kv(k_all[i], cache_positions, ks)
            write_kv(v_all[i], cache_positions, vs)
            x = attn_out(layer, x, qs, k_all[i], v_all[i], attn_mask, self.attention, fused)
            if i + 1 in want:
                aux[i + 1] = x
        x = x[:, :q] if last is None else x.gather(1, last[:, None, None].expand(-1, 1, x.shape[-1]))
        return self.lm_head(self.norm(x)), torch.cat([aux[i][:, :q] for i in self.aux_layer_ids], dim=-1)

    @torch.no_grad()
    def prefill_rows(self, rows: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor):
        """Prefill new requests into batch rows ``rows`` [g] while the other rows keep their
        state: ``input_ids`` [g,T] right-padded, ``lengths`` [g]. Eager (or compiled for any
        shape, ``options.compile_prefill``; or padded and graphed, ``options.prefill_graphs``),
        through a scratch cache of the prompts' width (a fresh prompt attends only to itself);
        pad queries write slots past a row's length, which decoding overwrites before any query
        sees them. Returns (logits at each row's last token [g,1,V], aux [g,T,3H])."""
        if self.options.prefill_graphed:
            out = padded_prefill(self._prefill_fn, rows, lengths, input_ids, max_len=self.max_seq_len)
            if out is not None:
                return out[0], out[1][:, : input_ids.shape[1]]
        return self._prefill(rows, input_ids, lengths)

    def _prefill(self, rows: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor):
        g, t = input_ids.shape
        width = max(t, self.query_pad)
        shape = (len(self.layers), g, self.num_kv_heads, width, self.head_dim)
        kv = tuple(torch.zeros(shape, dtype=self.k_all.dtype, device=self.device) for _ in range(2))
        pos = torch.arange(t, device=self.device)
        mask = causal_mask(0, t, width, self.device)
        logits, aux = self._run(input_ids, pos, pos, mask, self.options.prefill_compiled, kv, lengths - 1)
        self.k_all[:, rows, :, :t] = kv[0][:, :, :, :t]
        self.v_all[:, rows, :, :t] = kv[1][:, :, :, :t]
        return logits, aux

    def gather_kv(self, src):
        """Cache slots ``src`` of every layer (K and V): [p] in every batch row, or [B,p] per
        row. With ``scatter_kv``, a move in two halves: ``move_kv`` graphs each;
        ``SpecRound.device_round`` runs both in its graph."""
        if src.dim() == 1:
            return self.k_all.index_select(3, src), self.v_all.index_select(3, src)
        idx = self._row_index(src)
        return self.k_all.gather(3, idx), self.v_all.gather(3, idx)

    def scatter_kv(self, dst, k_rows, v_rows):
        if dst.dim() == 1:
            self.k_all.index_copy_(3, dst, k_rows)
            self.v_all.index_copy_(3, dst, v_rows)
        else:
            idx = self._row_index(dst)
            self.k_all.scatter_(3, idx, k_rows)
            self.v_all.scatter_(3, idx, v_rows)
        return ()

    def _row_index(self, slots):
        """[B,p] slots -> a gather/scatter index into [layers, B, nkv, S, d]."""
        layers, _, nkv, _, d = self.k_all.shape
        return slots[None, :, None, :, None].expand(layers, -1, nkv, -1, d)


# A graphed prefill is padded to powers of two: at least PREFILL_GRAPH_MIN tokens, at most
# PREFILL_GRAPH_LEN, and PREFILL_GRAPH_TOKENS prompts x tokens. Past them it runs eagerly: its
# device work then outweighs the host's calls, and its scratch would stay in the graphs' pool.
PREFILL_GRAPH_MIN, PREFILL_GRAPH_LEN, PREFILL_GRAPH_TOKENS = 16, 512, 8192


def padded_prefill(fn, rows: torch.Tensor, lengths: torch.Tensor, *seqs: torch.Tensor, max_len: int):
    """``fn(rows, *seqs, lengths)`` for g prompts (each of ``seqs`` [g,T,...]) on a padded
    shape: T up to a power of two with zeros past every prompt (slots past a row's length, which
    decoding overwrites before reading), g up to a power of two by repeating the last prompt into
    its own row again (the same values written twice). Returns fn's outputs of the g real rows,
    or None where the padded shape is past the bounds above or ``max_len``."""
    g, t = seqs[0].shape[:2]
    gb, tb = 1 << (g - 1).bit_length(), max(PREFILL_GRAPH_MIN, 1 << (t - 1).bit_length())
    if tb > min(PREFILL_GRAPH_LEN, max_len) or gb * tb > PREFILL_GRAPH_TOKENS:
        return None
    rep = torch.arange(gb, device=rows.device).clamp(max=g - 1)
    padded = [F.pad(s, (0, 0) * (s.dim() - 2) + (0, tb - t))[rep] for s in seqs]
    return tuple(o[:g] for o in fn(rows[rep], *padded, lengths[rep]))


def causal_mask(start, q: int, size: int, device) -> torch.Tensor:
    """[q, size] bool: query i (at slot start+i) sees slots 0..start+i (start: int or [1] tensor)."""
    return torch.arange(size, device=device)[None, :] <= (start + torch.arange(q, device=device))[:, None]


class StaticFn:
    """Run ``fn(*tensors) -> tuple of tensors`` eagerly or as CUDA graphs.

    One graph per input signature (shapes and dtypes); inputs are copied into static
    buffers before replay and outputs cloned after it. ``fn`` may write to caches but must be
    safe to repeat: the warm-up calls repeat the real call's writes (so it must not read slots
    it overwrote, see ``move_kv``). ``cuda_graphs`` is a no-op for CPU tensors. Compiling is
    up to ``fn`` (the engine compiles per layer, inside it).
    """

    def __init__(self, fn, cuda_graphs: bool = False):
        self.fn = fn
        self.cuda_graphs = cuda_graphs
        self.graphs: dict = {}
        self.pool = None  # one memory pool per StaticFn: a handle must not outlive its graphs

    @torch.no_grad()
    def __call__(self, *args):
        if not (self.cuda_graphs and args[0].is_cuda):
            return self.fn(*args)
        key = tuple((a.shape, a.dtype) for a in args)
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
        graph, static_in, static_out = self.graphs[key]
        for buf, a in zip(static_in, args):
            buf.copy_(a)
        graph.replay()
        return tuple(o.clone() for o in static_out)

    def _capture(self, args):
        static_in = [a.clone() for a in args]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up (and compile) outside the capture
                self.fn(*static_in)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = self.fn(*static_in)
        return graph, static_in, tuple(static_out)
