"""A block-parallel draft head (the published DFlash design): one forward pass proposes a
whole block of tokens, so drafting no longer grows with depth.

Shape, under the names speculators 0.9 writes and vLLM 0.32 loads for ``dflash``:
``fc`` fuses the target's aux states (K*H_t -> H) and ``hidden_norm`` norms the result: the
*context* feature of every position the target has processed. ``layers.{i}`` are Qwen3-style
decoder layers (q_norm/k_norm on the heads, SiLU MLP); each projects the context feature
through its own ``k_proj``/``v_proj`` (k_norm and RoPE on K; no input norm) into context
keys and values. A block is ``[anchor, MASK x (B-1)]`` at positions a..a+B-1, where the
anchor is the last token the target emitted (its own state is not known yet): the block's
queries see the context strictly before the anchor plus the whole block (bidirectional), and
slot j >= 1 predicts the token at a+j. A final ``norm`` and ``lm_head`` over the draft
vocabulary give the logits; ``d2t``/``t2d`` map it to the target vocabulary.

The token embedding is the target's own and frozen (not a parameter here), as in EAGLE-3.
Attention runs through ``attend(q, k, v, visible)`` with ``visible`` [.., Q, S] (True = may
attend), so training's many anchors and the engine's context cache share one layer.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from draftling.draft.model import DraftHead, draft_rope
from draftling.errors import ConfigError

METHOD = "dflash"
_COPIED: tuple[str, ...] = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
)
_COPIED += ("max_position_embeddings", "vocab_size", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id")


def block_config_from_target(
    target_config,
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    block_size: int,
    layers: int,
    mask_token_id: int,
    causal: bool = False,
) -> LlamaConfig:
    """The block drafter's config from the target's: its width, heads and RoPE, ``layers``
    decoder layers, ``block_size`` tokens a pass (anchor included: B-1 drafts), the token id
    whose embedding fills the block's unknown slots, and whether a slot sees the later slots
    of its block (the published design) or only the earlier ones (``causal``)."""
    if block_size < 2:
        raise ConfigError(f"draft.block_size={block_size}: expected >= 2 (the anchor and at least one draft)")
    if not 0 <= mask_token_id < target_config.vocab_size:
        raise ConfigError(
            f"draft.mask_token_id={mask_token_id}: not a token of the target ({target_config.vocab_size})"
        )
    fields: dict[str, Any] = {k: getattr(target_config, k) for k in _COPIED if hasattr(target_config, k)}
    if "rope_parameters" in fields:
        fields["rope_parameters"] = draft_rope(fields["rope_parameters"])
    head_dim = (
        getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    )
    fields.update(
        head_dim=head_dim,
        hidden_act="silu",
        num_hidden_layers=int(layers),
        architectures=["DFlashDraftModel"],
        draft_method=METHOD,
        draft_vocab_size=int(draft_vocab_size),
        target_hidden_size=target_config.hidden_size,
        target_num_hidden_layers=target_config.num_hidden_layers,
        eagle_aux_hidden_state_layer_ids=[int(i) for i in aux_layer_ids],
        block_size=int(block_size),
        mask_token_id=int(mask_token_id),
        block_causal=bool(causal),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**fields)


def sdpa_attend(q, k, v, visible):
    """Attention with an explicit visibility mask (grouped K/V heads repeated)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)


class BlockAttention(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.nh, self.nkv, self.d = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.nh * d, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nh * d, h, bias=False)
        self.q_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)

    def _heads(self, proj, x, n):
        b, t, _ = x.shape
        return proj(x).view(b, t, n, self.d).transpose(1, 2)

    def keys_values(self, x, cos, sin):
        """K (k_norm, RoPE) and V [B, nkv, T, d] of ``x`` (a context feature or the block)."""
        k = self.k_norm(self._heads(self.k_proj, x, self.nkv))
        v = self._heads(self.v_proj, x, self.nkv)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        return k.to(v.dtype), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, visible, attend=sdpa_attend):
        q = self.q_norm(self._heads(self.q_proj, x, self.nh))
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        out = attend(q.to(v.dtype), torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2), visible)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.d))


class BlockLayer(nn.Module):
    self_attn: BlockAttention

    def __init__(self, config: Any):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = BlockAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, ctx_k, ctx_v, visible, attend=sdpa_attend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, visible, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDraft(DraftHead):
    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        h, ht, k = config.hidden_size, config.target_hidden_size, len(config.eagle_aux_hidden_state_layer_ids)
        self.fc = nn.Linear(k * ht, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    @property
    def causal(self) -> bool:
        return bool(getattr(self.config, "block_causal", False))

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """The context feature [B, T, H] of the target's concatenated aux states [B, T, K*H_t]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's context keys and values [B, nkv, T, d] at ``positions`` [B, T]."""
        cos, sin = self.rotary_emb(ctx, positions)
        return [cast(BlockLayer, layer).self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def block_hidden(self, embeds, positions, ctx_kv, visible, attend=sdpa_attend) -> torch.Tensor:
        """The blocks' final states [B, Q, H]: ``embeds`` [B, Q, H] at ``positions`` [B, Q];
        ``visible`` [B, 1, Q, T + Q] over (context keys, block keys); ``attend(q, k, v,
        visible)`` computes attention (the engine passes its grouped matmul kernel)."""
        x = embeds.to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(x, positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, visible, attend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, A] anchor positions -> [B, A*block] positions of their blocks' slots."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[..., None] + offsets).flatten(-2)


def block_visibility(
    anchors: torch.Tensor, block_size: int, context_len: int, context_ok=None, causal: bool = False
) -> torch.Tensor:
    """[B, 1, A*block, T + A*block] bool: a block's slots see the context strictly before its
    anchor (and where ``context_ok`` [B, T] allows: padding) and their own block: whole, or
    up to themselves with ``causal`` (the head's ``block_causal``)."""
    b, a = anchors.shape
    dev = anchors.device
    before = torch.arange(context_len, device=dev)[None, None, :] < anchors[..., None]  # [B, A, T]
    if context_ok is not None:
        before = before & context_ok[:, None, :]
    ctx = before.repeat_interleave(block_size, dim=1)  # [B, A*block, T]
    owner = torch.arange(a, device=dev).repeat_interleave(block_size)
    own = owner[:, None] == owner[None, :]
    if causal:
        own = own & torch.ones_like(own).tril()
    own = own.expand(b, -1, -1)
    return torch.cat([ctx, own], dim=-1)[:, None]
