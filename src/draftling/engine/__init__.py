"""Decode engine: own-KV-cache target, draft runner, plain and speculative generation."""

from draftling.engine.accept import SpecOptions, SpecStats, process_logits
from draftling.engine.draft_runner import DraftRunner
from draftling.engine.general_target import GeneralCachedTarget, build_target
from draftling.engine.generate import BatchResult, batch_generate, greedy_generate, speculative_generate
from draftling.engine.options import EngineOptions
from draftling.engine.spec_round import RoundTimer, SpecRound
from draftling.engine.target_model import CachedTarget, StaticFn, UnsupportedArchitecture, causal_mask

__all__ = [
    "BatchResult",
    "CachedTarget",
    "DraftRunner",
    "EngineOptions",
    "GeneralCachedTarget",
    "RoundTimer",
    "SpecOptions",
    "SpecRound",
    "SpecStats",
    "StaticFn",
    "UnsupportedArchitecture",
    "batch_generate",
    "build_target",
    "causal_mask",
    "greedy_generate",
    "process_logits",
    "speculative_generate",
]
