"""The EAGLE-3 draft head.

Shape (see shared REFERENCE.md): ``fc`` fuses the three target aux states (3*H_t -> H);
one Llama decoder layer whose attention reads ``cat(input_layernorm(embed), hidden_norm(h))``
(width 2H) while the residual stream carries ``h``; a final ``norm``; and ``lm_head`` over
the draft vocabulary. Later draft steps feed the layer's own output (pre-norm) back in place
of the fused feature, so ``fc`` only ever sees target states.

The token embedding is the target's own and frozen; it is not a parameter of this module.
Parameter names match the SGLang/EAGLE export (``fc``, ``midlayer.*``, ``norm``, ``lm_head``).

EAGLE-3.1 options (config flags, as vLLM and speculators name them; each off by default):
``fc_norm`` normalizes each aux state before ``fc`` (weights ``fc_norm.{i}``),
``norm_before_fc`` normalizes their concatenation instead (``input_norm``), and
``norm_output`` feeds the normed output back to the next step, so the state a step carries
keeps one scale however deep the draft goes.

Attention is delegated to a callable ``attend(q, k, v) -> out`` (q: [B, nh, T, d], k/v:
[B, nkv, T, d], RoPE already applied), so the same layer serves the training-time-test
unroll, the engine's KV cache and tree masks without knowing about any of them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from draftling.errors import ConfigError
from draftling.target.devmap import resident_weight

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_COPIED_FROM_TARGET = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "hidden_act",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
)


# The EAGLE-3.1 flags (see the module docstring), under the names vLLM reads from the config.
NORM_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")


def norm_flags(config) -> dict[str, bool]:
    """The draft's EAGLE-3.1 flags from its config (absent = off); fc_norm and norm_before_fc
    are two ways to normalize the same input, so not both."""
    flags = {k: bool(getattr(config, k, False)) for k in NORM_FLAGS}
    if flags["fc_norm"] and flags["norm_before_fc"]:
        raise ConfigError("draft.fc_norm and draft.norm_before_fc are exclusive: set one of them")
    return flags


def draft_config_from_target(
    target_config, draft_vocab_size: int, aux_layer_ids: list[int], window: int = 0, **overrides
) -> LlamaConfig:
    """Derive a one-layer Llama config for the draft from the target's config.

    The hidden size equals the target's so the draft can reuse the target's embedding
    (and serve embedding-free). ``vocab_size`` stays the TARGET vocab, as engines expect.
    ``window`` > 0: sliding-window attention (see :func:`set_window`).
    """
    fields = {k: getattr(target_config, k) for k in _COPIED_FROM_TARGET if hasattr(target_config, k)}
    if "rope_parameters" in fields:
        fields["rope_parameters"] = draft_rope(fields["rope_parameters"])
    head_dim = getattr(target_config, "head_dim", None) or (
        target_config.hidden_size // target_config.num_attention_heads
    )
    if draft_vocab_size > target_config.vocab_size:
        raise ConfigError(
            f"draft_vocab_size {draft_vocab_size} is larger than the target vocab ({target_config.vocab_size})"
        )
    fields.update(
        head_dim=head_dim,
        num_hidden_layers=1,
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=int(draft_vocab_size),
        target_hidden_size=target_config.hidden_size,
        target_num_hidden_layers=target_config.num_hidden_layers,
        eagle_aux_hidden_state_layer_ids=[int(i) for i in aux_layer_ids],
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    # EAGLE-3.1 flags are written only when on: a plain head's config stays as it was.
    fields.update({k: v for k, v in overrides.items() if k not in NORM_FLAGS or v})
    config = LlamaConfig(**fields)
    norm_flags(config)
    if window:
        set_window(config, window)
    return config


def draft_rope(rope):
    """The draft's own copy of the target's RoPE parameters (LlamaConfig edits the dict it is
    given). A target with one set per layer type (Gemma 3: sliding and full) gives its full
    attention's: the draft attends over the whole context."""
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get("full_attention", next(iter(rope.values())))
    return copy.deepcopy(rope)


# The window lives in the draft's config, spelled as vLLM's Llama reads it (``layer_types[i] ==
# "sliding_attention"``, then ``sliding_window``): a query at position p sees the context keys at
# positions p-W+1 .. p. Training, the engine and the exports all read it from there.
def set_window(config, window: int) -> None:
    """Set the draft's sliding attention window in ``config`` (0 = full causal attention)."""
    if int(window) > 0:
        config.sliding_window, config.layer_types = int(window), ["sliding_attention"]
    elif draft_window(config):
        config.sliding_window, config.layer_types = None, ["full_attention"]


def draft_window(config) -> int:
    """The draft's sliding attention window from its config; 0 = full causal attention."""
    types = getattr(config, "layer_types", None) or ()
    if types and types[0] == "sliding_attention":
        return int(getattr(config, "sliding_window", None) or 0)
    return 0


class Eagle3Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads, d)
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def qkv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        # Under autocast the projections are bf16 but RoPE (fp32 tables) promotes q and k.
        return q.to(v.dtype), k.to(v.dtype), v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = out.shape  # [B, nh, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor, cos, sin, attend: Attend) -> torch.Tensor:
        return self.output(attend(*self.qkv(x, cos, sin)))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(config)

    # The layer in two attention-free halves around ``attend``, so training can compile them
    # (one graph each, whatever the attention does) and leave the attention to flex.
    def attention_inputs(self, embeds, hidden, cos, sin):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        return self.self_attn.qkv(x, cos, sin)

    def attention_to_output(self, hidden, attn_out):
        hidden = hidden + self.self_attn.output(attn_out)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, embeds, hidden, cos, sin, attend: Attend) -> torch.Tensor:
        return self.attention_to_output(hidden, attend(*self.attention_inputs(embeds, hidden, cos, sin)))


_Head = TypeVar("_Head", bound="DraftHead")


class DraftHead(nn.Module):
    """What every head type shares: the vocab maps that travel with its weights (``d2t``,
    ``t2d`` buffers its subclass registers), the draft-to-target id map, and the state a
    checkpoint or export saves."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ConfigError(
                f"vocab maps of shape d2t{tuple(d2t.shape)} t2d{tuple(t2d.shape)} do not "
                f"fit this draft (d2t{tuple(self.d2t.shape)} t2d{tuple(self.t2d.shape)})"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights plus vocab maps; no rotary cache, no embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}

    def cast_weights(self: _Head, dtype: torch.dtype) -> _Head:
        """Cast every weight to ``dtype`` in place. The rotary table stays fp32, as training
        and the serving engines compute it: rounded to bf16, its angles drift with distance."""
        for name, module in self.named_children():
            if name != "rotary_emb":
                module.to(dtype)
        return self


class Eagle3Draft(DraftHead):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        h, ht = config.hidden_size, getattr(config, "target_hidden_size", config.hidden_size)
        flags, eps = norm_flags(config), config.rms_norm_eps
        if flags["norm_before_fc"]:
            self.input_norm = LlamaRMSNorm(3 * ht, eps=eps)
        if flags["fc_norm"]:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(ht, eps=eps) for _ in range(3))
        self.norm_output = flags["norm_output"]
        self.fc = nn.Linear(3 * ht, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        # Vocab maps travel with the weights: a head without them serves garbage silently.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def fuse(self, aux_states: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Fuse the [low, mid, high] target states (in that order) into the draft width."""
        if isinstance(aux_states, (list, tuple)):
            aux_states = torch.cat(list(aux_states), dim=-1)
        x = aux_states.to(self.fc.weight.dtype)
        if hasattr(self, "input_norm"):
            x = self.input_norm(x)
        if hasattr(self, "fc_norm"):
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def step(
        self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """One draft step. Returns the state fed to the next step (see :meth:`carry`)."""
        cos, sin = self.rotary_emb(hidden, position_ids)
        return self.carry(self.midlayer(embeds.to(hidden.dtype), hidden, cos, sin, attend))

    def carry(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output as the next step reads it: as it is, or normed (norm_output)."""
        return self.norm(out) if self.norm_output else out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from a carried state: the final norm is applied once, here or in carry."""
        return self.lm_head(hidden if self.norm_output else self.norm(hidden))


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def init_from_target(draft: DraftHead, target_model, t2d: torch.Tensor) -> None:
    """Warm-start the output side from the target: its final norm and its output-head rows
    for the draft vocabulary. The draft then starts out predicting in the target's own
    output space, which cuts the steps needed to reach useful acceptance. Any head with an
    ``lm_head`` and a final ``norm`` (EAGLE-3's and the block drafter's)."""
    head = resident_weight(target_model.get_output_embeddings())  # a device map may have offloaded them
    norm = resident_weight(target_model.get_decoder().norm)
    with torch.no_grad():
        draft.lm_head.weight.copy_(head[t2d.to(head.device)].to(draft.lm_head.weight))
        draft.norm.weight.copy_(norm.to(draft.norm.weight))
