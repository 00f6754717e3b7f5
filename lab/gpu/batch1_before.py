"""The batch-1 decode loop as it stood at b979c01 (src/draftling/engine/generate.py), frozen
here only as the "before" side of lab/gpu/one_engine_sweep.py: the product now decodes one
request as a batch of one row (engine/generate.py). Nothing else imports it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftling.engine.draft_runner import DraftRunner
from draftling.engine.spec_round import RoundTimer, SpecRound
from draftling.engine.target_model import CachedTarget, causal_mask
from draftling.errors import ConfigError


@dataclass
class SpecStats:
    verify_steps: int = 0
    tokens: int = 0  # tokens emitted, including the one from prefill
    accept_lengths: list[int] = field(default_factory=list)  # per verify: accepted drafts + bonus
    accept_counts: list[int] = field(default_factory=list)  # [depth-1]: times depth was accepted
    compactions: int = 0  # verify steps whose accepted path had to be moved in the target cache
    cache_len: int = 0  # positions valid in both caches at the end (for checks)
    timing: dict | None = None  # mean ms per round by phase (RoundTimer.summary), if asked for

    def add_round(self, path_len: int) -> None:
        """One verify step whose accepted path (root included) has ``path_len`` nodes: it
        emitted path_len - 1 drafts plus the bonus token."""
        self.verify_steps += 1
        self.accept_lengths.append(path_len)
        for d in range(path_len - 1):
            self.accept_counts[d] += 1

    @property
    def tau(self) -> float:
        """Mean tokens per verify step, bonus included (1.0 = no speculation)."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    def as_dict(self) -> dict:
        return {
            "verify_steps": self.verify_steps,
            "tokens": self.tokens,
            "tau": self.tau,
            "accept_lengths": list(self.accept_lengths),
            "accept_counts": list(self.accept_counts),
            "compactions": self.compactions,
            "timing": self.timing,
        }


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Target probabilities after temperature, top-k and top-p (rows of ``logits``)."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits.softmax(-1)


def _pick(logits: torch.Tensor, temperature, top_k, top_p, generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = process_logits(logits, temperature, top_k, top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def _eos_set(eos_ids) -> set[int]:
    if eos_ids is None:
        return set()
    return {int(eos_ids)} if isinstance(eos_ids, int) else {int(e) for e in eos_ids}


def _emit(out: list[int], new: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    """Append ``new`` up to eos / the budget; True when generation is over."""
    for tok in new:
        out.append(tok)
        if tok in eos or len(out) >= max_new_tokens:
            return True
    return False


def _prepare(target: CachedTarget, input_ids: torch.Tensor, need: int) -> torch.Tensor:
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.shape[0] != 1:
        raise ConfigError(f"the engine decodes batch size 1, got {input_ids.shape[0]}")
    if input_ids.shape[1] + need > target.max_seq_len:
        raise ConfigError(
            f"prompt {input_ids.shape[1]} + {need} tokens do not fit the target cache of {target.max_seq_len}"
        )
    return input_ids.to(target.device)


def _prefill(target: CachedTarget, input_ids: torch.Tensor):
    n = input_ids.shape[1]
    dev = input_ids.device
    pos = torch.arange(n, device=dev)
    return target(input_ids, pos, pos, causal_mask(0, n, target.max_seq_len, dev))


# Greedy steps the host queues before reading their tokens back: no per-token device->host
# sync, so on a GPU the next step's launch overlaps the current one. Steps queued past an
# eos are discarded (at most RUN_AHEAD - 1 per generation, and they are counted in its time).
RUN_AHEAD = 8
RUN_AHEAD_ROUNDS = 4  # the same for speculative rounds (each emits up to steps + 1 tokens)


@torch.no_grad()
def greedy_generate(
    target: CachedTarget,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_ids=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Decode without speculation on the same own-cache target (the speedup baseline).
    Returns the new tokens, [1, m] with m <= max_new_tokens (eos included if hit)."""
    input_ids = _prepare(target, input_ids, max_new_tokens + target.query_pad)
    eos, out = _eos_set(eos_ids), []
    if max_new_tokens <= 0:
        return torch.zeros(1, 0, dtype=torch.long)
    logits, _ = _prefill(target, input_ids)
    tok = _pick(logits[0, -1], temperature, top_k, top_p, generator)
    pos, dev = input_ids.shape[1], input_ids.device
    done = _emit(out, [tok], max_new_tokens, eos)
    if temperature <= 0:
        tok_t, pos_t = torch.tensor([[tok]], device=dev), torch.tensor([pos], device=dev)
        while not done:
            queued = []
            for _ in range(min(RUN_AHEAD, max_new_tokens - len(out))):
                tok_t, pos_t = target.fast_greedy(tok_t, pos_t)
                queued.append(tok_t)
            done = _emit(out, torch.cat(queued).view(-1).tolist(), max_new_tokens, eos)
        return torch.tensor([out], dtype=torch.long)
    while not done:
        p = torch.tensor([pos], device=dev)
        mask = target.cols[None] <= pos
        logits, _ = target.fast(torch.tensor([[tok]], device=dev), p, p, mask)
        tok = _pick(logits[0, -1], temperature, top_k, top_p, generator)
        done = _emit(out, [tok], max_new_tokens, eos)
        pos += 1
    return torch.tensor([out], dtype=torch.long)


def _accept_greedy(best, toks, children):
    """Walk down while some child holds the target's argmax (``best``) at its parent."""
    path, cur = [0], 0
    while True:
        nxt = next((c for c in children[cur] if toks[c] == best[cur]), None)
        if nxt is None:
            return path, best[cur]
        path.append(nxt)
        cur = nxt


def _accept_sample(logits, toks, children, temperature, top_k, top_p, generator):
    """Lossless for deterministic drafts: try siblings in order, accept x with prob p(x);
    on rejection zero p(x) and renormalise; if all fail, sample the residual."""
    probs = process_logits(logits, temperature, top_k, top_p)
    path, cur = [0], 0
    while True:
        p = probs[cur].clone()
        for c in children[cur]:
            x = toks[c]
            if float(torch.rand((), generator=generator, device=p.device)) < float(p[x]):
                path.append(c)
                break
            p[x] = 0.0
            total = p.sum()
            p = p / total if total > 0 else probs[cur]  # all mass rejected: only by rounding
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
        cur = path[-1]


def accept_tree(packed: list, logits: torch.Tensor, o: SpecOptions) -> tuple[list[int], list[int]]:
    """Host-side acceptance of one row's verified tree: ``packed`` = (tokens, parents, target
    argmax) as lists, ``logits`` [q,V]. Returns (path: node indices from the root, new: the
    accepted drafts then the bonus token)."""
    toks, parents, best = packed
    children = [[] for _ in toks]
    for i in range(1, len(toks)):
        assert 0 <= parents[i] < i, "tree must be connected, parents before children"
        children[parents[i]].append(i)
    if o.temperature <= 0:
        path, bonus = _accept_greedy(best, toks, children)
    else:
        path, bonus = _accept_sample(logits, toks, children, o.temperature, o.top_k, o.top_p, o.generator)
    return path, [toks[i] for i in path[1:]] + [bonus]


@dataclass(frozen=True)
class SpecOptions:
    """The keyword options of ``speculative_generate``. ``temperature`` 0 = greedy; above it
    tokens follow the target's distribution after ``top_k`` and ``top_p``. ``timing``: fill
    ``SpecStats.timing`` with the mean per-round phase split (see ``RoundTimer``).
    ``device_rounds``: greedy rounds accept and commit on the device and the host queues up
    to RUN_AHEAD_ROUNDS of them per read (``SpecRound.device_round``); None = on when the
    draft runs graphed or compiled (then both paths pad the draft's extend alike and agree
    bit for bit). Sampling and ``timing`` always take the host-side round."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eos_ids: int | list[int] | None = None
    generator: torch.Generator | None = None
    timing: bool = False
    device_rounds: bool | None = None

    def pick(self, logits: torch.Tensor) -> int:
        return _pick(logits, self.temperature, self.top_k, self.top_p, self.generator)


@dataclass
class _Output:
    """What a generation has emitted so far, and whether it is over (eos or the budget)."""

    max_new_tokens: int
    eos: set[int]
    stats: SpecStats
    tokens: list[int] = field(default_factory=list)
    done: bool = False

    def emit(self, new: list[int]) -> bool:
        self.done = _emit(self.tokens, new, self.max_new_tokens, self.eos)
        return self.done


def _check_tree(draft: DraftRunner, steps: int, topk: int, num_draft_tokens: int) -> None:
    if steps < 1 or topk < 1 or not 2 <= num_draft_tokens <= 1 + topk + (steps - 1) * topk * topk:
        raise ConfigError(
            f"tree steps={steps} topk={topk} num_draft_tokens={num_draft_tokens}: "
            "need steps, topk >= 1 and 2 <= num_draft_tokens <= 1 + candidates"
        )
    if (steps - 1) * topk > draft.max_spec_nodes:
        raise ConfigError(
            f"the draft cache has {draft.max_spec_nodes} scratch slots; "
            f"steps={steps} topk={topk} needs {(steps - 1) * topk}"
        )


@torch.no_grad()
def speculative_generate(
    target: CachedTarget,
    draft: DraftRunner,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    steps: int,
    topk: int,
    num_draft_tokens: int,
    **options,
):
    """EAGLE speculative decoding. Returns (new tokens [1, m], SpecStats). ``options``: the
    fields of SpecOptions as keywords (``eos_ids=``, ``temperature=``, ``timing=``, ...).

    At temperature 0 the tokens equal ``greedy_generate``'s; above it they follow the
    target's processed distribution exactly (see ``_accept_sample``)."""
    o = SpecOptions(**options)
    _check_tree(draft, steps, topk, num_draft_tokens)
    input_ids = _prepare(target, input_ids, max_new_tokens + max(num_draft_tokens, target.query_pad))
    if draft.max_seq_len < target.max_seq_len:
        raise ConfigError("the draft cache must be at least as long as the target cache")
    stats = SpecStats(accept_counts=[0] * steps)
    if max_new_tokens <= 0:
        return torch.zeros(1, 0, dtype=torch.long), stats
    out = _Output(max_new_tokens, _eos_set(o.eos_ids), stats)
    logits, aux = _prefill(target, input_ids)
    root = o.pick(logits[0, -1])
    n = input_ids.shape[1]
    timer = RoundTimer(input_ids.device) if o.timing else None
    if not out.emit([root]):
        rnd = SpecRound.cached(target, draft, steps, topk, num_draft_tokens)
        next_ids = torch.cat([input_ids[:, 1:], torch.tensor([[root]], device=input_ids.device)], dim=1)
        r_hidden, r_logits = draft.extend(next_ids, aux, 0)
        ctrl = rnd.upload([n, root])
        state = (ctrl[0:1], ctrl[1:2], r_hidden, r_logits)  # the round's varying inputs live on the device
        on_device = draft.graphed if o.device_rounds is None else o.device_rounds
        if on_device and o.temperature <= 0 and timer is None:
            n = _device_rounds(rnd, state, n, out)
        else:
            n = _host_rounds(rnd, state, n, out, o, timer)
    stats.cache_len = n
    stats.tokens = len(out.tokens)
    stats.timing = timer.summary() if timer else None
    return torch.tensor([out.tokens], dtype=torch.long), stats


def _device_rounds(rnd: SpecRound, state, n: int, out: _Output) -> int:
    """Greedy rounds accepted and committed on the device, several queued per read of what
    they emitted. Returns the committed length."""
    while not out.done:
        # Queue only rounds the budget surely needs: none is wasted unless an eos comes.
        queued = []
        for _ in range(max(1, min(RUN_AHEAD_ROUNDS, (out.max_new_tokens - len(out.tokens)) // rnd.path_len))):
            *state, emitted = rnd.fused_round(*state)
            queued.append(emitted)
        for (row,) in torch.stack(queued).tolist():
            k, moved, new = row[0], row[1], row[2 : 2 + row[0]]
            out.stats.add_round(k)
            if out.emit(new):
                break
            out.stats.compactions += moved
            n += k
    return n


def _host_rounds(rnd: SpecRound, state, n: int, out: _Output, o: SpecOptions, timer: RoundTimer | None) -> int:
    """Rounds whose tree the host reads back (one sync per round) to accept in Python, greedy
    or sampled, before the commit. Returns the committed length."""
    n_t, root_t, r_hidden, r_logits = state
    while True:
        if timer:
            timer.start()
        packed, aux, logits = rnd.propose(n_t, root_t, r_hidden, r_logits, timer)
        path, new = accept_tree(packed[0].tolist(), logits[0], o)  # the round's one device->host sync
        out.stats.add_round(len(path))
        out.emit(new)
        if timer:
            timer.mark()
        if out.done:
            return n
        # root + accepted drafts: positions n .. n+len(path)-1 to commit; bonus is the next root
        moved, n_t, root_t, r_hidden, r_logits = rnd.commit([n], [path], [new], aux)
        out.stats.compactions += int(moved[0])
        n += len(path)
