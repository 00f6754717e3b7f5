"""How the decode engine runs: one frozen set of options for the target, the draft and the
benches that build them, with "auto" resolved in one place (``EngineOptions.resolve``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from draftling.config import AUTO, ENGINE_ATTENTION
from draftling.errors import ConfigError

# The config checks these names when it loads, and it cannot import the engine: it keeps them.
ATTENTION_KINDS = ENGINE_ATTENTION
# "auto" attention on CUDA: "exact" for a padded engine (the speculative engine and its padded
# plain twin, the identity reference); an unpadded one takes the faster bf16 "matmul". Exact
# attention only pays together with padding: unpadded, the weight matmuls already differ per
# query count, so output is not bitwise plain's either way (a plain reference, the concurrency
# sweep and select run unpadded, against the fastest plain engine).
GPU_ATTENTION, GPU_UNPADDED_ATTENTION = "exact", "matmul"


@dataclass(frozen=True)
class EngineOptions:
    """``cuda_graphs``: replay decode passes as CUDA graphs (a no-op for CPU tensors).
    ``compile``: compile the decode passes (the fast path: each decoder layer as two compiled
    halves around the eager cache write; the general path: the whole forward).
    ``query_pad``: pad every target pass of 1..query_pad queries to query_pad rows, 0 = off
    (see ``CachedTarget``). ``attention``: one of ATTENTION_KINDS; the draft only proposes, so
    "exact" gives it plain matmul attention. Each may be "auto" until ``resolve``; the engine's
    classes take resolved options only. The defaults are the plain eager engine.
    ``fuse``: run each layer's q/k/v and gate/up projections as one matmul each (see
    engine.fused); on by default wherever the model allows it, False only to measure without.
    ``compile_prefill``: run an admission's prefill (target and draft, on the fast path; the
    general path prefills eagerly) through the same layer halves compiled with dynamic shapes,
    one graph for a single prompt and one for several, of any length. A prefill on a GPU is
    bound by the host's operator calls, not the device's work, and the compiled halves' guards
    and wrappers cost the host about what the eager calls they replace did (BENCHMARKS.md), so
    "auto" (the default) resolves to eager everywhere; True turns it on.
    ``prefill_graphs``: pad an admission's prefill (target and draft, on the fast path) to a
    power of two of prompts and of tokens and replay it as a CUDA graph per padded shape, so the
    host pays one replay instead of its operator calls (on a CPU only the padding runs). Long
    prompts, past ``target_model.PREFILL_GRAPH_LEN`` tokens or ``PREFILL_GRAPH_TOKENS`` in all,
    prefill eagerly. "auto" (the default) resolves to off until a GPU has timed it."""

    cuda_graphs: bool | str = False
    compile: bool | str = False
    query_pad: int | str = 0
    attention: str = "sdpa"
    fuse: bool = True
    compile_prefill: bool | str = AUTO
    prefill_graphs: bool | str = AUTO

    def __post_init__(self):
        if self.attention not in (AUTO, *ATTENTION_KINDS):
            raise ConfigError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        pad = self.query_pad
        if pad != AUTO and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
            raise ConfigError(f"query_pad must be an integer >= 0 or 'auto', got {pad!r}")
        if self.fuse not in (True, False):
            raise ConfigError(f"fuse must be true or false, got {self.fuse!r}")
        for name in ("cuda_graphs", "compile", "compile_prefill", "prefill_graphs"):
            if getattr(self, name) not in (AUTO, True, False):
                raise ConfigError(f"{name} must be true, false or 'auto', got {getattr(self, name)!r}")

    @classmethod
    def auto(cls) -> EngineOptions:
        """Every option "auto": the GPU settings on CUDA, the plain eager engine elsewhere."""
        return cls(AUTO, AUTO, AUTO, AUTO)

    @classmethod
    def of(cls, options: EngineOptions | None = None, **fields) -> EngineOptions:
        """``options`` (default: plain eager) with ``fields`` replaced: where the keyword form
        (``cuda_graphs=``, ``compile=``, ``query_pad=``, ``attention=``) becomes options."""
        return dataclasses.replace(options or cls(), **fields)

    @property
    def prefill_compiled(self) -> bool:
        return self.compile_prefill is True

    @property
    def prefill_graphed(self) -> bool:
        return self.prefill_graphs is True

    @property
    def resolved(self) -> bool:
        return AUTO not in (self.cuda_graphs, self.compile, self.query_pad, self.attention)

    def resolve(self, device, max_draft_tokens: int = 0) -> EngineOptions:
        """These options for ``device`` without "auto": on CUDA graphs, compiled layers, every
        pass padded to ``max_draft_tokens`` (the largest verify pass) and exact attention when
        padded, bf16 matmul attention when not; elsewhere eager SDPA, unpadded. A pad below
        ``max_draft_tokens`` is refused: the larger verify passes would run other kernels than
        plain decoding."""
        gpu = torch.device(device).type == "cuda"

        def pick(value, auto):
            return auto if value == AUTO else value

        pad = int(pick(self.query_pad, max_draft_tokens if gpu else 0))
        gpu_attention = GPU_ATTENTION if pad else GPU_UNPADDED_ATTENTION
        compiled = bool(pick(self.compile, gpu))
        out = EngineOptions(
            cuda_graphs=bool(pick(self.cuda_graphs, gpu)),
            compile=compiled,
            query_pad=pad,
            attention=pick(self.attention, gpu_attention if gpu else "sdpa"),
            fuse=self.fuse,
            compile_prefill=bool(pick(self.compile_prefill, False)),
            prefill_graphs=bool(pick(self.prefill_graphs, False)),
        )
        if out.query_pad and out.query_pad < max_draft_tokens:
            raise ConfigError(
                f"query_pad {out.query_pad} is below the largest config's {max_draft_tokens} draft tokens"
            )
        return out

    def unpadded(self, device) -> EngineOptions:
        """The unpadded plain reference beside a padded engine: these options without padding,
        resolved ("auto" attention is then the faster bf16 matmul on CUDA)."""
        return dataclasses.replace(self, query_pad=0).resolve(device)

    def check_resolved(self) -> EngineOptions:
        if not self.resolved:
            raise ConfigError(f"{self} still holds 'auto': resolve it for a device first (EngineOptions.resolve)")
        return self
