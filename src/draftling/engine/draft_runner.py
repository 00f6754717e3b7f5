"""The EAGLE-3 draft over its own static KV cache.

Cache layout, one layer: ``[B, nkv, max_seq_len + max_spec_nodes, d]``.

* Slots ``0 .. max_seq_len-1`` are the committed context, slot = position. Position t
  holds the draft's K/V for (embed(x_{t+1}), fused target feature at t). They are written
  only by ``extend`` with real target features, after each verification.
* Slots from ``max_seq_len`` on are scratch for speculative tree nodes. A tree step writes
  there and nowhere else, so a rejected branch never touches the committed context; the
  next round simply overwrites the scratch. Queries see the scratch only through the mask.

``extend`` may be padded to a fixed length (for graphs): the padded rows write past the
committed length, where nothing reads until the next ``extend`` overwrites them.

A draft with a sliding window (its config's ``sliding_window``; see draft/model.py) sees only
the committed slots within W positions of each query (scratch is as the mask says: the
query's own branch). Each pass gathers those W + T - 1 slots and the scratch out of the cache
and attends over them alone, so a draft step costs O(W) whatever the context length; the
cache itself still holds every position (slot = position), as the commit path needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftling.draft.model import Eagle3DecoderLayer, Eagle3Draft, draft_window
from draftling.engine.options import EngineOptions
from draftling.engine.target_model import (
    StaticFn,
    causal_mask,
    compile_once,
    matmul_attention,
    padded_prefill,
    row_mask,
    write_kv,
)
from draftling.errors import ConfigError


def draft_outputs(draft: Eagle3Draft, hidden, q, k_cache, v_cache, attn_mask, use_matmul: bool, last=None):
    """The draft layer after its cache write: attention, o_proj, MLP, then the head.
    Returns (the carried hidden state, draft logits). ``last`` [B]: those of that query only
    per row, [B,H] and [B,Vd] (a ragged prefill needs its last real token's, not a
    [B,T,Vd] block of logits)."""
    if use_matmul:
        o = matmul_attention(q, k_cache, v_cache, attn_mask, q.shape[-1] ** -0.5)
    else:
        o = F.scaled_dot_product_attention(
            q, k_cache, v_cache, attn_mask=row_mask(attn_mask), enable_gqa=k_cache.shape[1] != q.shape[1]
        )
    out = draft.carry(draft.midlayer.attention_to_output(hidden, o))
    if last is not None:
        out = out[torch.arange(out.shape[0], device=out.device), last]
    return out, draft.compute_logits(out)


class DraftRunner(nn.Module):
    """``options``: the engine's EngineOptions, resolved (the target's, so both run alike; its
    query_pad is the target's alone); its fields may also come as keywords (``compile=True``)."""

    def __init__(
        self,
        draft: Eagle3Draft,
        embed: nn.Embedding,
        max_seq_len: int,
        max_spec_nodes: int = 64,
        batch_size: int = 1,
        options: EngineOptions | None = None,
        **engine,
    ):
        super().__init__()
        if not isinstance(draft, Eagle3Draft):
            raise ConfigError(
                f"DraftRunner runs EAGLE-3 heads; a {getattr(draft.config, 'draft_method', '?')} head runs on "
                "engine.block_round.BlockRunner (bench.simple.build_runner picks the runner)"
            )
        options = EngineOptions.of(options, **engine).check_resolved()
        self.draft = draft
        self.embed = embed  # the target's, frozen and shared
        self.max_seq_len = int(max_seq_len)
        self.max_spec_nodes = int(max_spec_nodes)
        cfg = draft.config
        self.window = draft_window(cfg)
        w = draft.fc.weight
        shape = (batch_size, cfg.num_key_value_heads, self.max_seq_len + self.max_spec_nodes, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=w.dtype, device=w.device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=w.dtype, device=w.device), persistent=False)
        self.register_buffer("cols", torch.arange(shape[2], device=w.device), persistent=False)
        self.graphed = options.cuda_graphs or options.compile
        # Compiled like the target's layers: the two halves around the eager cache write.
        # The draft only proposes: "exact" buys it nothing over plain matmul attention.
        self.compile, self.use_matmul = options.compile, options.attention in ("matmul", "exact")
        self.compile_prefill = options.prefill_compiled  # extend_rows, like the target's prefill
        self.prefill_graphs = options.prefill_graphed
        self._extend_rows_fn = StaticFn(self._extend_rows, cuda_graphs=options.cuda_graphs)
        self._extend_fn = StaticFn(self._extend, cuda_graphs=options.cuda_graphs)
        self._step_fn = StaticFn(self.forward, cuda_graphs=options.cuda_graphs)
        # spec_round.SpecRound per (target, steps, topk, num_draft_tokens): its graphs are
        # captured once and replayed by every later generation with that config.
        self.rounds: dict = {}

    @property
    def batch_size(self) -> int:
        return self.k_cache.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_cache.dtype

    @property
    def state_sizes(self) -> tuple[int, int]:
        """The per-row state a round hands the next: the draft's hidden state and logits
        for the root's children."""
        return self.draft.config.hidden_size, self.draft.config.draft_vocab_size

    @property
    def spec_base(self) -> int:
        return self.max_seq_len

    @property
    def cache_size(self) -> int:
        return self.k_cache.shape[2]

    def forward(self, input_ids, hidden, positions, cache_positions, attn_mask, compiled=None, kv=None, last=None):
        """One draft layer pass. ``hidden`` is the fused target feature or the draft's own
        previous output. Returns (carried hidden [B,T,H], draft logits [B,T,Vd]).
        ``cache_positions`` [T] or [B,T], ``attn_mask`` [T,C] or [B,T,C] (see ``write_kv``).
        ``compiled``: default ``self.compile``; the prompt's extend passes False (its length
        varies). ``kv``: (K, V) scratch buffers instead of the cache (``extend_rows``, whose
        compiled halves take any shape). ``last`` [B]: the outputs at that query only per row."""
        b, t = input_ids.shape
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(b, t)
        layer = self.draft.midlayer
        fast = self.compile if compiled is None else compiled
        rows = self.k_cache.shape[0]
        prefill = kv is not None
        attn_in = (
            compile_once(Eagle3DecoderLayer.attention_inputs, rows, prefill) if fast else type(layer).attention_inputs
        )
        attn_out = compile_once(draft_outputs, rows, prefill) if fast else draft_outputs
        cos, sin = self.draft.rotary_emb(hidden, positions)
        q, k, v = attn_in(layer, self.embed(input_ids).to(hidden.dtype), hidden, cos, sin)
        k_cache, v_cache = kv if kv is not None else (self.k_cache, self.v_cache)
        write_kv(k_cache, cache_positions, k)
        write_kv(v_cache, cache_positions, v)
        if self.window:
            context = k_cache.shape[2] - (self.max_spec_nodes if kv is None else 0)
            k_cache, v_cache, attn_mask = self._windowed(positions, k_cache, v_cache, attn_mask, context)
        return attn_out(self.draft, hidden, q, k_cache, v_cache, attn_mask, self.use_matmul, last)

    def _windowed(self, positions, k_cache, v_cache, attn_mask, context: int):
        """(K, V, mask) of the sliding window: the context slots (< ``context``; slot = position)
        in positions p-W+1 .. p of each query at p, and the scratch slots as the mask has them.
        Gathered into W + T - 1 + scratch slots when that is fewer than the whole cache."""
        b, t = positions.shape
        mask = attn_mask.expand(b, -1, -1) if attn_mask.dim() == 2 else attn_mask
        band = self.window + t - 1
        if band >= context:  # a short cache: the window is a mask over all of it
            cols = self.cols[: mask.shape[-1]]
            near = (cols >= context) | (cols > positions[..., None] - self.window)
            return k_cache, v_cache, mask & near
        dev = positions.device
        band_cols = (positions.min(1).values - self.window + 1)[:, None] + torch.arange(band, device=dev)
        real = (band_cols >= 0) & (band_cols < context)
        idx = torch.cat([band_cols.clamp(0, context - 1), self.cols[context : k_cache.shape[2]].expand(b, -1)], 1)
        near = real[:, None] & (band_cols[:, None] > positions[..., None] - self.window)  # [B,T,band]
        mask = mask.gather(2, idx[:, None].expand(-1, t, -1))
        mask = torch.cat([mask[..., :band] & near, mask[..., band:]], 2)
        rows = idx[:, None, :, None].expand(-1, k_cache.shape[1], -1, k_cache.shape[3])
        return k_cache.gather(2, rows), v_cache.gather(2, rows), mask

    def _extend(self, input_ids, aux, start, compiled=None):
        """Commit rows at ``start`` [B] (each batch row its own start). Slots and mask come from
        the device tensor: nothing here depends on host values."""
        slots = start[:, None] + torch.arange(input_ids.shape[1], device=input_ids.device)
        mask = self.cols[None, None] <= slots[:, :, None]
        return self.forward(input_ids, self.draft.fuse(aux), slots, slots, mask, compiled)

    @torch.no_grad()
    def extend_rows(self, rows: torch.Tensor, next_ids: torch.Tensor, aux: torch.Tensor, lengths: torch.Tensor):
        """The prompts of new requests into batch rows ``rows`` [g] (right-padded [g,T], as
        ``CachedTarget.prefill_rows``; compiled or graphed as it is), through a scratch cache.
        Returns each row's (hidden [g,H], logits [g,Vd]) at its last real position."""
        if self.prefill_graphs:
            out = padded_prefill(self._extend_rows_fn, rows, lengths, next_ids, aux, max_len=self.max_seq_len)
            if out is not None:
                return out
        return self._extend_rows(rows, next_ids, aux, lengths)

    def _extend_rows(self, rows: torch.Tensor, next_ids: torch.Tensor, aux: torch.Tensor, lengths: torch.Tensor):
        g, t = next_ids.shape
        shape = (g, self.k_cache.shape[1], t, self.k_cache.shape[3])
        kv = tuple(torch.zeros(shape, dtype=self.k_cache.dtype, device=self.k_cache.device) for _ in range(2))
        pos = torch.arange(t, device=next_ids.device)
        mask = causal_mask(0, t, t, next_ids.device)
        hidden, logits = self.forward(
            next_ids, self.draft.fuse(aux), pos, pos, mask, self.compile_prefill, kv, lengths - 1
        )
        self.k_cache[rows, :, :t] = kv[0]
        self.v_cache[rows, :, :t] = kv[1]
        return hidden, logits

    @torch.no_grad()
    def extend(self, next_ids: torch.Tensor, aux: torch.Tensor, start, pad_to: int | None = None):
        """Commit positions ``start .. start+T-1``: ``next_ids`` [B,T] are the tokens one
        ahead (x_{t+1}), ``aux`` [B,T,3H] the target's aux states at t. ``start`` is an int or
        a [1] long tensor on the device (no host sync). Returns the last row's
        (hidden [B,H], logits [B,Vd]), which propose the token at start+T+1."""
        b, t = next_ids.shape
        n = t
        if pad_to is not None and self.graphed and t < pad_to:
            # Fixed length for graphs; padded rows are causal too, so real rows never see them.
            next_ids = F.pad(next_ids, (0, pad_to - t))
            aux = F.pad(aux, (0, 0, 0, pad_to - t))
            t = pad_to
        if not torch.is_tensor(start):
            start = torch.full((1,), start, dtype=torch.long, device=next_ids.device)
        if pad_to is not None:
            hidden, logits = self._extend_fn(next_ids, aux, start)
        else:  # the prompt: eager, uncompiled (its length varies)
            hidden, logits = self._extend(next_ids, aux, start, compiled=False)
        return hidden[:, n - 1], logits[:, n - 1]

    @torch.no_grad()
    def tree_step(
        self, ids: torch.Tensor, hidden: torch.Tensor, position: int, slots: torch.Tensor, mask: torch.Tensor
    ):
        """Draft one level for K frontier nodes of one sequence: ``ids`` [K] (target ids),
        ``hidden`` [K,H] (each parent's output), all at ``position``; K/V go to scratch
        ``slots`` [K]; ``mask`` [K, cache_size]. Returns (hidden [K,H], logits [K,Vd])."""
        pos = torch.full((ids.shape[0],), position, device=ids.device, dtype=torch.long)
        h, logits = self._step_fn(ids[None], hidden[None], pos, slots, mask)
        return h[0], logits[0]
