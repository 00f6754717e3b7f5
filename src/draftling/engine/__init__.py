"""Decode engine: own-KV-cache target, draft runner, plain and speculative generation."""

from draftling.engine.draft_runner import DraftRunner
from draftling.engine.generate import (
    SpecStats,
    build_tree,
    greedy_generate,
    process_logits,
    speculative_generate,
)
from draftling.engine.target_model import CachedTarget, StaticFn, UnsupportedArchitecture, causal_mask

__all__ = ["CachedTarget", "DraftRunner", "SpecStats", "StaticFn", "UnsupportedArchitecture",
           "build_tree", "causal_mask", "greedy_generate", "process_logits", "speculative_generate"]
