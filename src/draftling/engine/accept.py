"""What a decode loop decides on the host: the options of a generation, its stats, how a
verified tree is accepted (greedy or lossless sampling), and when a generation stops.

SGLang names: ``steps`` = tree depth, ``topk`` = children per frontier node,
``num_draft_tokens`` = verified tokens including the root (chain 3-1-4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftling.engine.draft_runner import DraftRunner
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
    # The whole run's full-batch stretch (the same in every request's stats): from after the
    # first admissions until a row first finds no request waiting, its seconds and the tokens
    # all requests emitted in it. None when the first admissions left a row empty.
    full_batch: tuple[float, int] | None = None
    # The whole run's account of its batch passes and admissions (engine.generate.Usage.report),
    # the same in every request's stats.
    usage: dict | None = None

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


def pick_tokens(logits: torch.Tensor, o: SpecOptions) -> torch.Tensor:
    """A token per row of ``logits`` [B,V]: argmax at temperature 0, else sampled from the
    target's processed law (``o``'s temperature, top_k, top_p and generator)."""
    if o.temperature <= 0:
        return logits.argmax(-1)
    probs = process_logits(logits, o.temperature, o.top_k, o.top_p)
    return torch.multinomial(probs, 1, generator=o.generator)[:, 0]


def eos_set(eos_ids) -> set[int]:
    if eos_ids is None:
        return set()
    return {int(eos_ids)} if isinstance(eos_ids, int) else {int(e) for e in eos_ids}


def emit_tokens(out: list[int], new: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    """Append ``new`` up to eos / the budget; True when generation is over."""
    for tok in new:
        out.append(tok)
        if tok in eos or len(out) >= max_new_tokens:
            return True
    return False


# Greedy steps the host queues before reading their tokens back: no per-token device->host
# sync, so on a GPU the next step's launch overlaps the current one. Steps queued past an
# eos are discarded (at most RUN_AHEAD - 1 per generation, and they are counted in its time).
RUN_AHEAD = 8
RUN_AHEAD_ROUNDS = 4  # the same for speculative rounds (each emits up to steps + 1 tokens)


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
    children: list[list[int]] = [[] for _ in toks]
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
    """The keyword options of the decode loops (engine/generate.py). ``temperature`` 0 = greedy; above it
    tokens follow the target's distribution after ``top_k`` and ``top_p``. ``timing``: fill
    ``SpecStats.timing`` with the mean per-round phase split (see ``RoundTimer``).
    ``device_rounds``: greedy rounds accept and commit on the device and the host queues up
    to RUN_AHEAD_ROUNDS of them per read (``SpecRound.device_round``); False = the host
    accepts each round, as sampling does (both agree bit for bit). Sampling and ``timing``
    always take the host-side round. ``defer_admissions``: let free rows wait for the next row to
    finish when that costs less than the prefill it saves (``generate.Admissions``); False
    admits as soon as a row frees, as sampling always does (its draws follow the rows).
    Greedy tokens are the same either way."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eos_ids: int | list[int] | None = None
    generator: torch.Generator | None = None
    timing: bool = False
    device_rounds: bool = True
    defer_admissions: bool = True


@dataclass
class Output:
    """What a generation has emitted so far, and whether it is over (eos or the budget)."""

    max_new_tokens: int
    eos: set[int]
    stats: SpecStats
    tokens: list[int] = field(default_factory=list)
    done: bool = False

    def emit(self, new: list[int]) -> bool:
        self.done = emit_tokens(self.tokens, new, self.max_new_tokens, self.eos)
        return self.done


def check_tree(draft: DraftRunner, steps: int, topk: int, num_draft_tokens: int) -> None:
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
