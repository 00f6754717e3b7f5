"""The decode loop: plain and speculative (EAGLE-3, EAGLE-2 dynamic tree), greedy or
sampled, for B independent requests at once, each in its own cache row. One request is a
batch of one row: ``greedy_generate`` and ``speculative_generate`` are that case.

Every request keeps its own KV length, positions and accepted length: the target and the
draft write per-row slots (``write_kv``) and a round's tree, mask and commit are per row
(``SpecRound`` works on [B] rows). When a request finishes, its row takes the next waiting one
(continuous batching): the newcomers' prompts are prefilled into their rows alone, through a
scratch cache, and the static-shape steps go on replaying the same graphs. Free rows may wait
for the next row to free, so that one prefill serves both (``Admissions``). A row without a
request keeps stepping on what it holds; nothing reads it and the host drops what it emits.

Layout of one speculative round, with ``n`` = tokens in a row's target cache:
  root = the last emitted token, at position n, not yet in either cache;
  depth-d tree nodes are candidates for position n+d; the draft step that expands a
  depth-d node runs at position n+d-1 (EAGLE: position t sees embed(x_{t+1})).
  Verify feeds [root, nodes...] (``num_draft_tokens`` queries) at positions n+depth, writing
  K/V to slots n, n+1, ... in node order; the accepted path is then moved to n, n+1, ...
The device side of a round (drafting, tree, verify, commit) is ``spec_round.SpecRound``;
this loop holds the host side. Plain greedy steps and greedy speculative rounds run on the
device, several queued per read; sampling reads each step (plain) or each round's trees
(speculative) back to the host, where ``accept.accept_tree`` accepts them.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from draftling.engine.accept import (
    RUN_AHEAD,
    RUN_AHEAD_ROUNDS,
    Output,
    SpecOptions,
    SpecStats,
    accept_tree,
    check_tree,
    eos_set,
    pick_tokens,
)
from draftling.engine.adaptive import AdaptivePolicy
from draftling.engine.block_round import BlockRound, BlockRunner, BlockTreeRound
from draftling.engine.draft_runner import DraftRunner
from draftling.engine.spec_round import RoundTimer, SpecRound
from draftling.engine.target_model import TargetEngine
from draftling.errors import ConfigError
from draftling.timing import sync

# Attention-score elements one prefill may hold (rows x heads x T x T; 4 GiB in fp32).
PREFILL_SCORES = 2**30


@dataclass
class Admissions:
    """When free rows take waiting requests. An admission's prefill (eager, compiled or graphed:
    EngineOptions.compile_prefill, prefill_graphs) costs a fixed part (the host's operator calls,
    the draft's extension, a sync) and a part per request; a free row costs its share of every
    step the batch runs without it. Free rows wait for the next busy row to finish when that
    costs them less than the fixed part one prefill for both saves, and admit at once when no
    row is busy. The next finish is predicted from the rows' budgets and the tokens per row per
    ms of the step before (an eos only brings it sooner). The fixed part is the intercept of a
    line through the recent admissions' (requests, ms), so a host whose prefill grows with its
    requests and has little fixed cost admits at once; with fewer than two sizes seen it is
    taken as 0."""

    history: deque = field(default_factory=lambda: deque(maxlen=32))
    waits: int = 0  # steps free rows waited with a request waiting (a count for the tests)

    def fixed_ms(self) -> float:
        sizes = [k for k, _ in self.history]
        if len(set(sizes)) < 2:
            return 0.0
        times = [ms for _, ms in self.history]
        mk, mt = sum(sizes) / len(sizes), sum(times) / len(times)
        slope = sum((k - mk) * (t - mt) for k, t in self.history) / sum((k - mk) ** 2 for k in sizes)
        return min(max(0.0, mt - slope * mk), min(times))

    def due(self, free: int, rows: int, until_ms: float) -> bool:
        """Admit now, with ``free`` of ``rows`` rows free and the next busy row ``until_ms`` from
        finishing?"""
        if free == rows or free / rows * until_ms >= self.fixed_ms():
            return True
        self.waits += 1
        return False

    def record(self, requests: int, ms: float) -> None:
        self.history.append((requests, ms))


@dataclass
class Usage:
    """Where a run's batch passes went: ``passes``, plain steps and rounds of the whole batch;
    ``busy``, the row-passes that decoded an unfinished request (the rest stepped rows that were
    free, waiting, or done and not yet read back); ``prefills`` and the requests ``admitted``;
    ``admit_ms``, the host's wall time in admissions (they wait for the device only where
    deferral times them); ``wall_ms``, the run's, from its first admission."""

    passes: int = 0
    busy: int = 0
    prefills: int = 0
    admitted: int = 0
    admit_ms: float = 0.0
    wall_ms: float = 0.0

    def report(self, rows: int) -> dict:
        """These counts, with ``busy_row_fraction`` (busy over passes x rows) and ``admit_share``
        (admit_ms over wall_ms)."""
        fraction = self.busy / (self.passes * rows) if self.passes else None
        share = self.admit_ms / self.wall_ms if self.wall_ms else None
        return {**dataclasses.asdict(self), "busy_row_fraction": fraction, "admit_share": share}


@dataclass
class BatchResult:
    tokens: list[int]  # the new tokens (eos included if hit)
    stats: SpecStats  # per request; plain decoding counts no rounds


@torch.no_grad()
def batch_generate(
    target: TargetEngine,
    prompts,
    max_new_tokens,
    draft: DraftRunner | BlockRunner | None = None,
    tree: tuple[int, int, int] | None = None,
    adaptive: AdaptivePolicy | None = None,
    **options,
) -> list[BatchResult]:
    """Decode ``prompts`` (1-D token tensors or lists) ``target.batch_size`` at a time.
    ``max_new_tokens``: one budget or one per prompt. ``tree``: (steps, topk,
    num_draft_tokens) for speculative decoding with ``draft`` (a DraftRunner, or a BlockRunner
    with its one chain, with as many rows); None = plain. ``adaptive``: instead of one ``tree``, choose among the policy's
    trees and plain decoding per group of rounds (greedy only; see engine/adaptive.py).
    ``options``: SpecOptions fields (``eos_ids``, ``temperature``, ...).
    Speculative tokens equal plain decoding's at temperature 0, and follow the target's
    distribution above it; a request's tokens do not depend on the others in its batch."""
    o = SpecOptions(**options)
    prompts = [torch.as_tensor(p, dtype=torch.long).view(-1) for p in prompts]
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    _check_batch(target, draft, tree, prompts, budgets, adaptive, o)
    run = _Run(target, draft, tree, o, prompts, budgets, adaptive)
    start = time.perf_counter()
    run.admit()
    watch, full, emitted, t0 = None not in run.row_req, None, run.emitted(), time.perf_counter()
    while any(r is not None for r in run.row_req):
        # The step's pace decides when to admit: worth its count only while requests wait.
        busy = [r for _, r in run._active()] if run.waiting else []
        t, before = time.perf_counter(), run.emitted(busy)
        run.step()  # ends with a read-back: the device is done with what the host counts
        if watch and full is None and not run.waiting and None in run.row_req:
            full = (time.perf_counter() - t0, run.emitted() - emitted)
        if busy:
            ms = max((time.perf_counter() - t) * 1e3, 1e-6)
            run.admit((run.emitted(busy) - before) / (len(busy) * ms))
    run.usage.wall_ms = (time.perf_counter() - start) * 1e3
    usage = run.usage.report(target.batch_size)
    for out in run.outs:
        out.stats.tokens = len(out.tokens)
        out.stats.timing = run.timer.summary() if run.timer else None
        out.stats.full_batch, out.stats.usage = full, usage
    return [BatchResult(out.tokens, out.stats) for out in run.outs]


def _one(input_ids) -> torch.Tensor:
    """One request's prompt: [T] or [1,T]."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] != 1:
        raise ConfigError(f"one request at a time here (batch_generate takes many), got {ids.shape[0]} rows")
    return ids.view(-1).cpu()


def greedy_generate(
    target: TargetEngine,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_ids=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One request without speculation on the same own-cache target (the speedup baseline).
    Returns the new tokens, [1, m] with m <= max_new_tokens (eos included if hit)."""
    opts = dict(eos_ids=eos_ids, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    (res,) = batch_generate(target, [_one(input_ids)], max_new_tokens, **opts)
    return torch.tensor([res.tokens], dtype=torch.long)


def speculative_generate(
    target: TargetEngine,
    draft: DraftRunner,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    steps: int,
    topk: int,
    num_draft_tokens: int,
    **options,
):
    """One request with EAGLE speculative decoding. Returns (new tokens [1, m], SpecStats).
    ``options``: the fields of SpecOptions as keywords (``eos_ids=``, ``temperature=``,
    ``timing=``, ...). At temperature 0 the tokens equal ``greedy_generate``'s; above it they
    follow the target's processed distribution exactly (see ``accept.accept_tree``)."""
    tree = (steps, topk, num_draft_tokens)
    (res,) = batch_generate(target, [_one(input_ids)], max_new_tokens, draft=draft, tree=tree, **options)
    return torch.tensor([res.tokens], dtype=torch.long), res.stats


def _check_batch(target, draft, tree, prompts, budgets, adaptive, o: SpecOptions) -> None:
    if len(budgets) != len(prompts):
        raise ConfigError(f"{len(budgets)} budgets for {len(prompts)} prompts")
    headroom = target.query_pad
    if adaptive is not None and (tree is not None or o.temperature > 0 or not adaptive.trees):
        raise ConfigError("adaptive speculation takes its trees from the policy, decodes greedily and needs a tree")
    for t in adaptive.trees if adaptive else [tree] if tree else []:
        if draft is None:
            raise ConfigError("speculative decoding needs a draft")
        draft.check_config(*t) if isinstance(draft, BlockRunner) else check_tree(draft, *t)
        if draft.batch_size != target.batch_size or draft.max_seq_len < target.max_seq_len:
            raise ConfigError("the draft runner needs the target's batch rows and at least its cache length")
        headroom = max(headroom, t[2])
    for i, (p, m) in enumerate(zip(prompts, budgets)):
        if p.numel() == 0:
            raise ConfigError(f"prompt {i} is empty")
        if p.numel() + m + headroom > target.max_seq_len:
            raise ConfigError(
                f"prompt {i} ({p.numel()} tokens) + {m} new tokens do not fit the target cache of {target.max_seq_len}"
            )


def _round(target, draft, tree):
    """The engine's device round for a config, made once per (engine, config)."""
    if isinstance(draft, BlockRunner):
        return (
            BlockRound.cached(target, draft) if draft.is_chain(*tree) else BlockTreeRound.cached(target, draft, *tree)
        )
    return SpecRound.cached(target, draft, *tree)


def _mean_spread(xs: list[int]) -> tuple[float | None, tuple[float, int] | None]:
    """(mean, (variance, n)) of ``xs``; (None, None) when empty."""
    if not xs:
        return None, None
    mean = statistics.fmean(xs)
    return mean, (statistics.pvariance(xs, mean), len(xs))


class _Run:
    """The host side of a ragged batch: which request each row serves, and the rows' state
    tensors (tokens in the cache ``n``, the next root token, the draft's proposal for it)."""

    def __init__(self, target, draft, tree, o: SpecOptions, prompts, budgets, policy=None):
        self.target, self.draft, self.o, self.prompts, self.policy = target, draft, o, prompts, policy
        trees = policy.trees if policy else [tree] if tree else []
        self.rounds = {t: _round(target, draft, t) for t in trees}
        self.rnd = self.rounds[tree] if tree else None
        eos, steps = eos_set(o.eos_ids), max((t[0] for t in trees), default=1)
        self.outs = [Output(m, eos, SpecStats(accept_counts=[0] * steps)) for m in budgets]
        self.timer = RoundTimer(target.device) if o.timing and tree else None
        # Greedy rounds accept on the device unless asked otherwise or timed (timing splits
        # a round into phases, which the host marks).
        self.on_device = o.temperature <= 0 and o.device_rounds and self.timer is None
        self.waiting = deque(i for i, m in enumerate(budgets) if m > 0)
        b, dev = target.batch_size, target.device
        self.row_req: list[int | None] = [None] * b
        self.n = torch.zeros(b, dtype=torch.long, device=dev)
        self.root = torch.zeros(b, dtype=torch.long, device=dev)
        self.n_host = [0] * b
        self.synced = [True] * b  # the row's draft cache holds all it has committed
        self.group_end: float | None = None  # when the last adaptive group's read-back ended
        self.last_tree: tuple[int, int, int] | None = None  # the config that group ran
        self.admissions = Admissions()
        self.usage = Usage()
        if draft is not None:  # the state a round hands the next: EAGLE-3's proposal for the root
            h, v = draft.state_sizes
            self.r_hidden = torch.zeros(b, h, dtype=draft.dtype, device=dev)
            self.r_logits = torch.zeros(b, v, dtype=draft.dtype, device=dev)

    def admit(self, pace: float | None = None) -> None:
        """Fill free rows with waiting requests: prefills of the newcomers, as many at once as
        PREFILL_SCORES allows. A request whose first token already ends it frees its
        row again at once. ``pace``: tokens per busy row per ms in the step before; with it,
        free rows may wait for the next to free (``Admissions``). Admissions are timed for that."""
        free = self.row_req.count(None)
        if not (self.waiting and free):
            return
        # Sampling draws for all rows from one generator, so which step a request starts at
        # decides its draws: it admits at once, as a seeded run must repeat.
        timed = self.o.defer_admissions and self.o.temperature <= 0
        if timed and pace is not None and free < len(self.row_req):
            left = min(self.outs[r].max_new_tokens - len(self.outs[r].tokens) for _, r in self._active())
            if not self.admissions.due(free, len(self.row_req), left / pace if pace > 0 else float("inf")):
                return
        t0, admitted = time.perf_counter(), 0
        while self.waiting and None in self.row_req:
            rows = [i for i, r in enumerate(self.row_req) if r is None][: len(self.waiting)]
            reqs = [self.waiting.popleft() for _ in rows]
            admitted += len(reqs)
            for group in self._prefill_groups(reqs):
                self._prefill(rows[: len(group)], group)
                rows = rows[len(group) :]
        if timed:
            sync(self.target.device)
        ms = (time.perf_counter() - t0) * 1e3
        if timed:
            self.admissions.record(admitted, ms)
        self.usage.admit_ms += ms

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
        self.usage.prefills += 1
        self.usage.admitted += len(reqs)
        logits, aux = self.target.prefill_rows(rows_t, ids, lengths)
        first = pick_tokens(logits[:, 0], self.o)
        if self.draft is not None:
            # Position t of the draft sees token t+1: the prompt shifted, then the first token.
            next_ids = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter_(1, (lengths - 1)[:, None], first[:, None])
            h, lg = self.draft.extend_rows(rows_t, next_ids, aux, lengths)
            self.r_hidden[rows_t], self.r_logits[rows_t] = h, lg
        self.n[rows_t], self.root[rows_t] = lengths, first
        for row, req, tok, n in zip(rows, reqs, first.tolist(), lengths.tolist()):
            self.n_host[row] = self.outs[req].stats.cache_len = n
            self.synced[row] = self.draft is not None
            if not self.outs[req].emit([tok]):
                self.row_req[row] = req

    def emitted(self, reqs=None) -> int:
        """Tokens the requests ``reqs`` (default: all) have emitted so far."""
        return sum(len(self.outs[r].tokens) for r in (range(len(self.outs)) if reqs is None else reqs))

    def _active(self):
        return [(row, req) for row, req in enumerate(self.row_req) if req is not None]

    def _left(self) -> int:
        """The most tokens any active request still needs: a group queues steps (or rounds) up
        to it. A request that needs fewer ends inside the group and its row steps on unread
        until the read-back frees it: cheaper than one host read per step for the whole batch,
        which the fewest would cost whenever some row is near its end (rows finish at different
        steps). With one row it is that row's own need, so nothing is queued past it."""
        return max(self.outs[r].max_new_tokens - len(self.outs[r].tokens) for _, r in self._active())

    def _free_done(self) -> None:
        for row, req in self._active():
            if self.outs[req].done:
                self.row_req[row] = None

    def step(self) -> None:
        if self.policy is not None:
            self._adaptive_step()
        elif self.rnd is None:
            self._plain_greedy() if self.o.temperature <= 0 else self._plain_sampled()
        elif self.on_device:
            self._device_rounds()
        else:
            self._host_rounds()
        self._free_done()

    def _emit_rows(self, tokens: list[list[int]]) -> None:
        """Plain steps' tokens: a row is busy for each one its request takes."""
        for row, req in self._active():
            out = self.outs[req]
            if not out.done:
                had = len(out.tokens)
                out.emit(tokens[row])
                self.usage.busy += len(out.tokens) - had

    def _adaptive_step(self) -> None:
        """One group of rounds (or plain steps) of the config the policy picks, timed for it.
        The admissions since the group before (its finished rows' successors) are charged to
        the config that ran that group: its rows finishing is what made them. A group ends with
        its read-back, which waits for the device; a sync after admissions ends theirs."""
        policy, dev = self.policy, self.target.device
        if self.group_end is not None:
            sync(dev)
            policy.charge(self.last_tree, (time.perf_counter() - self.group_end) * 1e3)
        policy.measure_plain(lambda: self.target.fast_greedy(self.root[:, None], self.n), dev)
        tree = policy.choose(all(self.synced[row] for row, _ in self._active()))
        t0 = time.perf_counter()
        if tree is None:
            for row, _ in self._active():
                self.synced[row] = False  # the draft does not see plain steps
            count, tau, spread = self._plain_greedy(), 1.0, None
        else:
            self.rnd = self.rounds[tree]
            # A row without a request steps on through plain steps up to the cache's end; a
            # round there would write past it. Active rows never pass n_cap (_check_batch).
            self.n = self.n.clamp(max=self.rnd.n_cap)
            count, accepted = self._device_rounds()
            tau, spread = _mean_spread(accepted)
        self.group_end, self.last_tree = time.perf_counter(), tree
        policy.observe(tree, (self.group_end - t0) * 1e3 / count, tau, count, spread)

    def _plain_greedy(self) -> int:
        """A few plain greedy steps queued, then read back. Returns how many."""
        tok, pos, queued = self.root[:, None], self.n, []
        for _ in range(max(1, min(RUN_AHEAD, self._left()))):
            tok, pos = self.target.fast_greedy(tok, pos)
            queued.append(tok)
        self.root, self.n = tok[:, 0], pos
        self.usage.passes += len(queued)
        self._emit_rows(torch.cat(queued, 1).tolist())
        return len(queued)

    def _plain_sampled(self) -> None:
        t, pos = self.target, self.n
        mask = t.cols[None, None] <= pos[:, None, None]
        logits, _ = t.fast(self.root[:, None], pos[:, None], pos[:, None], mask)
        self.root = pick_tokens(logits[:, -1], self.o)
        self.n = (pos + 1).clamp(max=t.max_seq_len - 1)
        self.usage.passes += 1
        self._emit_rows([[x] for x in self.root.tolist()])

    def _device_rounds(self) -> tuple[int, list[int]]:
        """A few greedy rounds queued, then read back. Returns (rounds, the tokens each row
        still decoding emitted in each round: its acceptance, bonus included)."""
        rnd, queued, accepted = self.rnd, [], []
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
                accepted.append(k)
                if not out.emit(new):
                    out.stats.compactions += moved
                    out.stats.cache_len += k
        self.usage.passes += len(queued)
        self.usage.busy += len(accepted)
        return len(queued), accepted

    def _host_rounds(self) -> None:
        """One round whose trees the host reads back to accept (sampling, timing), then commits."""
        rnd, timer = self.rnd, self.timer
        if timer:
            timer.start()
        packed, aux, logits = rnd.propose(self.n, self.root, self.r_hidden, self.r_logits, timer)
        trees = packed.tolist()  # the round's one device->host sync
        paths, news = [[0]] * len(trees), [[0]] * len(trees)  # rows without a request: a no-op
        self.usage.passes += 1
        self.usage.busy += len(self._active())
        for row, req in self._active():
            paths[row], news[row] = accept_tree(trees[row], logits[row], self.o)
            self.outs[req].stats.add_round(len(paths[row]))
            self.outs[req].emit(news[row])
        if timer:
            timer.mark()
        moved, self.n, self.root, self.r_hidden, self.r_logits = rnd.commit(self.n_host, paths, news, aux)
        for row, req in self._active():
            k, stats = len(paths[row]), self.outs[req].stats
            self.n_host[row] += k if self.n_host[row] + k <= rnd.n_cap else 0
            if not self.outs[req].done:
                stats.compactions += int(moved[row])
                stats.cache_len += k
