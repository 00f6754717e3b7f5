"""Ragged batches: B independent requests decoded together, each in its own cache row.

Every request keeps its own KV length, positions and accepted length: the target and the
draft write per-row slots (``write_kv``) and a round's tree, mask and commit are per row
(``SpecRound`` works on [B] rows). When a request finishes, its row takes the next waiting one
(continuous batching): the newcomers' prompts are prefilled into their rows alone, through a
scratch cache, and the static-shape steps go on replaying the same graphs. A row without a
request keeps stepping on what it holds; nothing reads it and the host drops what it emits.

Plain greedy steps and greedy speculative rounds run on the device, several queued per read;
sampling reads each step (plain) or each round's trees (speculative) back to the host.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from draftling.engine.draft_runner import DraftRunner
from draftling.engine.general_target import build_target
from draftling.engine.generate import (
    RUN_AHEAD,
    RUN_AHEAD_ROUNDS,
    SpecOptions,
    SpecStats,
    _check_tree,
    _eos_set,
    _Output,
    accept_tree,
    process_logits,
)
from draftling.engine.spec_round import SpecRound
from draftling.engine.target_model import SUPPORTED_MODEL_TYPES, CachedTarget
from draftling.errors import ConfigError
from draftling.target.aux import decoder_layers, default_aux_layer_ids
from draftling.target.devmap import dispatched_devices

log = logging.getLogger(__name__)

# Attention-score elements one eager prefill may hold (rows x heads x T x T; 4 GiB in fp32).
PREFILL_SCORES = 2**30


@dataclass
class BatchResult:
    tokens: list[int]  # the new tokens (eos included if hit)
    stats: SpecStats  # per request; plain decoding counts no rounds


@torch.no_grad()
def batch_generate(
    target: CachedTarget,
    prompts,
    max_new_tokens,
    draft: DraftRunner | None = None,
    tree: tuple[int, int, int] | None = None,
    **options,
) -> list[BatchResult]:
    """Decode ``prompts`` (1-D token tensors or lists) ``target.batch_size`` at a time.
    ``max_new_tokens``: one budget or one per prompt. ``tree``: (steps, topk,
    num_draft_tokens) for speculative decoding with ``draft`` (a DraftRunner with as many
    rows); None = plain. ``options``: SpecOptions fields (``eos_ids``, ``temperature``, ...).
    Each request's tokens equal its batch-1 output at temperature 0, and follow the target's
    distribution above it."""
    o = SpecOptions(**options)
    prompts = [torch.as_tensor(p, dtype=torch.long).view(-1) for p in prompts]
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    _check_batch(target, draft, tree, prompts, budgets)
    run = _BatchRun(target, draft, tree, o, prompts, budgets)
    run.admit()
    while any(r is not None for r in run.row_req):
        run.step()
        run.admit()
    for out in run.outs:
        out.stats.tokens = len(out.tokens)
    return [BatchResult(out.tokens, out.stats) for out in run.outs]


def _check_batch(target, draft, tree, prompts, budgets) -> None:
    if len(budgets) != len(prompts):
        raise ConfigError(f"{len(budgets)} budgets for {len(prompts)} prompts")
    headroom = target.query_pad
    if tree is not None:
        if draft is None:
            raise ConfigError("speculative decoding (tree=...) needs a draft")
        _check_tree(draft, *tree)
        if draft.k_cache.shape[0] != target.batch_size or draft.max_seq_len < target.max_seq_len:
            raise ConfigError("the draft runner needs the target's batch rows and at least its cache length")
        headroom = max(headroom, tree[2])
    for i, (p, m) in enumerate(zip(prompts, budgets)):
        if p.numel() == 0:
            raise ConfigError(f"prompt {i} is empty")
        if p.numel() + m + headroom > target.max_seq_len:
            raise ConfigError(
                f"prompt {i} ({p.numel()} tokens) + {m} new tokens do not fit the target cache of {target.max_seq_len}"
            )


class _BatchRun:
    """The host side of a ragged batch: which request each row serves, and the rows' state
    tensors (tokens in the cache ``n``, the next root token, the draft's proposal for it)."""

    def __init__(self, target, draft, tree, o: SpecOptions, prompts, budgets):
        self.target, self.draft, self.o, self.prompts = target, draft, o, prompts
        self.rnd = SpecRound.cached(target, draft, *tree) if tree else None
        eos, steps = _eos_set(o.eos_ids), tree[0] if tree else 1
        self.outs = [_Output(m, eos, SpecStats(accept_counts=[0] * steps)) for m in budgets]
        self.waiting = deque(i for i, m in enumerate(budgets) if m > 0)
        b, dev = target.batch_size, target.device
        self.row_req: list[int | None] = [None] * b
        self.n = torch.zeros(b, dtype=torch.long, device=dev)
        self.root = torch.zeros(b, dtype=torch.long, device=dev)
        self.n_host = [0] * b
        if draft is not None:
            cfg, dtype = draft.draft.config, draft.k_cache.dtype
            self.r_hidden = torch.zeros(b, cfg.hidden_size, dtype=dtype, device=dev)
            self.r_logits = torch.zeros(b, cfg.draft_vocab_size, dtype=dtype, device=dev)

    def admit(self) -> None:
        """Fill free rows with waiting requests: eager prefills of the newcomers, as many at
        once as PREFILL_SCORES allows. A request whose first token already ends it frees its
        row again at once."""
        while self.waiting and None in self.row_req:
            rows = [i for i, r in enumerate(self.row_req) if r is None][: len(self.waiting)]
            reqs = [self.waiting.popleft() for _ in rows]
            for group in self._prefill_groups(reqs):
                self._prefill(rows[: len(group)], group)
                rows = rows[len(group) :]

    def _prefill_groups(self, reqs: list[int]) -> list[list[int]]:
        """``reqs`` in runs whose padded prefill scores (rows x heads x T x T) fit PREFILL_SCORES:
        a prefill's attention scores are materialised, and 96 prompts of 8k tokens would need
        hundreds of GiB at once."""
        heads = self.target.config.num_attention_heads
        groups: list[list[int]] = []
        width = 0
        for r in reqs:
            t = self.prompts[r].numel()
            if groups and (len(groups[-1]) + 1) * heads * max(width, t) ** 2 <= PREFILL_SCORES:
                groups[-1].append(r)
                width = max(width, t)
            else:
                groups.append([r])
                width = t
        return groups

    def _prefill(self, rows: list[int], reqs: list[int]) -> None:
        dev = self.target.device
        ids = pad_sequence([self.prompts[r] for r in reqs], batch_first=True).to(dev)
        lengths = torch.tensor([self.prompts[r].numel() for r in reqs], device=dev)
        rows_t = torch.tensor(rows, device=dev)
        logits, aux = self.target.prefill_rows(rows_t, ids, lengths)
        first = self._pick(logits[:, 0])
        if self.draft is not None:
            # Position t of the draft sees token t+1: the prompt shifted, then the first token.
            next_ids = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter_(1, (lengths - 1)[:, None], first[:, None])
            h, lg = self.draft.extend_rows(rows_t, next_ids, aux, lengths)
            self.r_hidden[rows_t], self.r_logits[rows_t] = h, lg
        self.n[rows_t], self.root[rows_t] = lengths, first
        for row, req, tok, n in zip(rows, reqs, first.tolist(), lengths.tolist()):
            self.n_host[row] = n
            if not self.outs[req].emit([tok]):
                self.row_req[row] = req

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """A token per row of ``logits`` [B,V]: argmax, or sampled from the processed law."""
        if self.o.temperature <= 0:
            return logits.argmax(-1)
        probs = process_logits(logits, self.o.temperature, self.o.top_k, self.o.top_p)
        return torch.multinomial(probs, 1, generator=self.o.generator)[:, 0]

    def _active(self):
        return [(row, req) for row, req in enumerate(self.row_req) if req is not None]

    def _left(self) -> int:
        """The fewest tokens any active request still needs: steps queued past it are wasted."""
        return min(self.outs[r].max_new_tokens - len(self.outs[r].tokens) for _, r in self._active())

    def _free_done(self) -> None:
        for row, req in self._active():
            if self.outs[req].done:
                self.row_req[row] = None

    def step(self) -> None:
        if self.rnd is None:
            self._plain_greedy() if self.o.temperature <= 0 else self._plain_sampled()
        elif self.o.temperature <= 0:
            self._device_rounds()
        else:
            self._host_rounds()
        self._free_done()

    def _emit_rows(self, tokens: list[list[int]]) -> None:
        for row, req in self._active():
            if not self.outs[req].done:
                self.outs[req].emit(tokens[row])

    def _plain_greedy(self) -> None:
        tok, pos, queued = self.root[:, None], self.n, []
        for _ in range(max(1, min(RUN_AHEAD, self._left()))):
            tok, pos = self.target.fast_greedy(tok, pos)
            queued.append(tok)
        self.root, self.n = tok[:, 0], pos
        self._emit_rows(torch.cat(queued, 1).tolist())

    def _plain_sampled(self) -> None:
        t, pos = self.target, self.n
        mask = t.cols[None, None] <= pos[:, None, None]
        logits, _ = t.fast(self.root[:, None], pos[:, None], pos[:, None], mask)
        self.root = self._pick(logits[:, -1])
        self.n = (pos + 1).clamp(max=t.max_seq_len - 1)
        self._emit_rows([[x] for x in self.root.tolist()])

    def _device_rounds(self) -> None:
        rnd, queued = self.rnd, []
        state = (self.n, self.root, self.r_hidden, self.r_logits)
        for _ in range(max(1, min(RUN_AHEAD_ROUNDS, self._left() // rnd.path_len))):
            *state, emitted = rnd.fused_round(*state)
            queued.append(emitted)
        self.n, self.root, self.r_hidden, self.r_logits = state
        for rows in torch.stack(queued).tolist():
            for row, req in self._active():
                out = self.outs[req]
                if out.done:
                    continue
                k, moved, new = rows[row][0], rows[row][1], rows[row][2 : 2 + rows[row][0]]
                out.stats.add_round(k)
                if not out.emit(new):
                    out.stats.compactions += moved

    def _host_rounds(self) -> None:
        """One round whose trees the host reads back to accept (sampling), then commits."""
        rnd = self.rnd
        packed, aux, logits = rnd.propose(self.n, self.root, self.r_hidden, self.r_logits)
        trees = packed.tolist()
        paths, news = [[0]] * len(trees), [[0]] * len(trees)  # rows without a request: a no-op
        for row, req in self._active():
            paths[row], news[row] = accept_tree(trees[row], logits[row], self.o)
            self.outs[req].stats.add_round(len(paths[row]))
            self.outs[req].emit(news[row])
        moved, self.n, self.root, self.r_hidden, self.r_logits = rnd.commit(self.n_host, paths, news, aux)
        for row, req in self._active():
            k = len(paths[row])
            self.n_host[row] += k if self.n_host[row] + k <= rnd.n_cap else 0
            self.outs[req].stats.compactions += int(moved[row] and not self.outs[req].done)


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
        self.target: CachedTarget | None = None

    def _engine(self, size: int) -> CachedTarget:
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
        eos = _eos_set(eos_ids)
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
