"""The shapes the memory estimate (train/memory.py) reads: an EAGLE-3 head's (``DraftShape``,
the target's width) and a dflash head's (``BlockShape``), each with its parameter count."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


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
    window: int = 0  # draft.window: the sdpa TTT attention then runs banded (train/attention.py)

    @classmethod
    def from_config(cls, config, draft_vocab: int, window: int = 0) -> DraftShape:
        """From a draft's config, or from a target's (the draft's default shape)."""
        config = getattr(config, "text_config", None) or config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            draft_vocab=min(int(draft_vocab), config.vocab_size),
            window=int(window),
        )

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
class BlockShape(DraftShape):
    """A dflash head's shape (draft/block.py): ``layers`` decoder layers over ``anchors`` blocks
    of ``block_size`` tokens per row (block_loss.row_anchors pads every row to MAX_ANCHORS)."""

    layers: int = 1
    block_size: int = 2
    anchors: int = 64

    @classmethod
    def from_block_config(cls, config, anchors: int) -> BlockShape:
        """From a ``block_config_from_target`` config (the built head's)."""
        base = dataclasses.asdict(DraftShape.from_config(config, config.draft_vocab_size))
        base.update(target_hidden=config.target_hidden_size, layers=config.num_hidden_layers)
        return cls(**base, block_size=config.block_size, anchors=anchors)

    def param_counts(self) -> dict[str, int]:
        """Trainable params by module, as ``BlockDraft`` builds them (no biases)."""
        h, d, q, kv = self.hidden, self.head_dim, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "fc": 3 * self.ht * h,
            "hidden_norm": h,
            "attention": self.layers * (2 * h * q + 2 * h * kv + 2 * d),  # with q_norm and k_norm
            "mlp": self.layers * 3 * h * self.intermediate,
            "layer_norms": self.layers * 2 * h,
            "norm": h,
            "lm_head": h * self.draft_vocab,
        }

    def largest_param(self) -> int:
        h = self.hidden
        return max(3 * self.ht * h, h * self.heads * self.head_dim, h * self.intermediate, h * self.draft_vocab)
