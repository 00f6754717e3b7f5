"""Replies of an HF model through the decode loop's plain path: how `draftling data`
regenerates on a GPU (data/regen.py's ``replies`` hook), and the one place that decides it."""

from __future__ import annotations

import logging

import torch

from draftling.engine.accept import eos_set
from draftling.engine.general_target import build_target
from draftling.engine.generate import batch_generate
from draftling.engine.target_model import SUPPORTED_MODEL_TYPES, TargetEngine
from draftling.errors import ConfigError
from draftling.target.aux import decoder_layers, default_aux_layer_ids
from draftling.target.devmap import dispatched_devices

log = logging.getLogger(__name__)


class ReplyEngine:
    """Replies of an HF model through the batched plain engine, greedy or sampled: how
    `draftling data` regenerates on a GPU (data/regen.py's ``replies`` hook). ``rows`` requests decode at once;
    the cache grows (in steps of 256 slots, so rarely) to the longest prompt asked so far, and
    the graphs of one size are replayed for every later call. A reply stops before its eos,
    as data/regen.py cuts HF generate's rows."""

    def __init__(self, model, rows: int, options=None):
        from draftling.engine.options import EngineOptions

        self.model, self.rows = model, int(rows)
        dev = model.get_input_embeddings().weight.device
        # Graphs on CUDA; no compile (a fresh shape per cache size) and no padding (plain only).
        default = EngineOptions(
            cuda_graphs="auto", compile=False, query_pad=0, attention="matmul" if dev.type == "cuda" else "sdpa"
        )
        self.options = (options or default).resolve(dev)
        self.target: TargetEngine | None = None

    def _engine(self, size: int) -> TargetEngine:
        if self.target is None or self.target.max_seq_len < size:
            self.target = None  # free the old cache first
            size = -(-size // 256) * 256
            aux = default_aux_layer_ids(len(decoder_layers(self.model)))  # computed, not used
            self.target = build_target(self.model, aux, size, batch_size=self.rows, options=self.options)
        return self.target

    @torch.no_grad()
    def __call__(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        eos_ids,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[tuple[list[int], str]]:
        """(reply, "eos" or "length") per prompt; above temperature 0 sampled (after top_p) from a
        generator seeded with ``seed``, so a rerun of the same prompts gives the same replies."""
        target = self._engine(max(map(len, prompts)) + max_new_tokens + 8)
        eos = eos_set(eos_ids)
        gen = torch.Generator(target.device).manual_seed(seed) if temperature > 0 else None
        out = []
        for r in batch_generate(
            target, prompts, max_new_tokens, eos_ids=eos_ids, temperature=temperature, top_p=top_p, generator=gen
        ):
            hit = bool(r.tokens) and r.tokens[-1] in eos
            out.append((r.tokens[:-1], "eos") if hit else (r.tokens, "length"))
        return out


def reply_engine_for(dc, target):
    """data.regen.engine resolved for ``target`` (``dc``: the data config): RegenRun.replies,
    a ReplyEngine per generating model, or None for HF generate. The one place it is decided."""
    mode, rc = dc.regen.engine, dc.regen
    if mode == "off" or rc.server_url or not hasattr(target, "model"):
        return None
    devices = dispatched_devices(target.model)
    if devices:
        spread = f"the target is spread over {', '.join(map(str, devices))} by a device map"
        if mode == "on":
            raise ConfigError(
                f"data.regen.engine=on: {spread}, and the batched engine runs a target on one "
                "device; use data.regen.engine=auto (HF generate)"
            )
        log.info(f"regenerate: {spread}, so replies come from HF generate (the batched engine needs one device)")
        return None
    why = "kept teacher states (data.keep_teacher_states)" if dc.keep_teacher_states else None
    if mode == "on" and why:
        raise ConfigError(
            f"data.regen.engine=on: the batched engine writes replies without states; this run asks for {why}"
        )
    # "auto" takes the fast path only: the general path's regeneration is unmeasured against HF.
    if mode == "auto" and target.config.model_type not in SUPPORTED_MODEL_TYPES:
        why = (
            f"model_type {target.config.model_type!r} "
            "(the general path's regeneration is unmeasured against HF generate)"
        )
    if why or (mode == "auto" and target.device.type != "cuda"):
        return None
    engines: dict = {}

    def replies(model):
        if id(model) not in engines:
            engines[id(model)] = ReplyEngine(model, rc.batch_size)
        return engines[id(model)]

    return replies
