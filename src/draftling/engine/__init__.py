"""Decode engine: own-KV-cache target, draft runner, plain and speculative generation."""

from draftling.engine.draft_runner import DraftRunner
from draftling.engine.general_target import GeneralCachedTarget, build_target
from draftling.engine.generate import SpecOptions, SpecStats, greedy_generate, process_logits, speculative_generate
from draftling.engine.options import EngineOptions
from draftling.engine.spec_round import RoundTimer, SpecRound
from draftling.engine.target_model import CachedTarget, StaticFn, UnsupportedArchitecture, causal_mask

__all__ = [
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
    "build_target",
    "causal_mask",
    "greedy_generate",
    "process_logits",
    "speculative_generate",
]
