"""Plain and speculative (EAGLE-3, EAGLE-2 dynamic tree) decoding, batch size 1.

Layout of one speculative round, with ``n`` = tokens in the target cache:
  root = the last emitted token, at position n, not yet in either cache;
  depth-d tree nodes are candidates for position n+d; the draft step that expands a
  depth-d node runs at position n+d-1 (EAGLE: position t sees embed(x_{t+1})).
  Verify feeds [root, nodes...] (``num_draft_tokens`` queries) at positions n+depth, writing
  K/V to slots n, n+1, ... in node order; the accepted path is then moved to n, n+1, ...

SGLang names: ``steps`` = tree depth, ``topk`` = children per frontier node,
``num_draft_tokens`` = verified tokens including the root (chain 3-1-4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftling.engine.draft_runner import DraftRunner
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

    @property
    def tau(self) -> float:
        """Mean tokens per verify step, bonus included (1.0 = no speculation)."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    def as_dict(self) -> dict:
        return {"verify_steps": self.verify_steps, "tokens": self.tokens, "tau": self.tau,
                "accept_lengths": list(self.accept_lengths),
                "accept_counts": list(self.accept_counts), "compactions": self.compactions}


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
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
        raise ConfigError(f"prompt {input_ids.shape[1]} + {need} tokens do not fit the target "
                          f"cache of {target.max_seq_len}")
    return input_ids.to(target.device)


def _prefill(target: CachedTarget, input_ids: torch.Tensor):
    n = input_ids.shape[1]
    dev = input_ids.device
    pos = torch.arange(n, device=dev)
    return target(input_ids, pos, pos, causal_mask(0, n, target.max_seq_len, dev))


@torch.no_grad()
def greedy_generate(target: CachedTarget, input_ids: torch.Tensor, max_new_tokens: int,
                    eos_ids=None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Decode without speculation on the same own-cache target (the speedup baseline).
    Returns the new tokens, [1, m] with m <= max_new_tokens (eos included if hit)."""
    input_ids = _prepare(target, input_ids, max_new_tokens)
    eos, out = _eos_set(eos_ids), []
    if max_new_tokens <= 0:
        return torch.zeros(1, 0, dtype=torch.long)
    logits, _ = _prefill(target, input_ids)
    tok = _pick(logits[0, -1], temperature, top_k, top_p, generator)
    pos, dev, size = input_ids.shape[1], input_ids.device, target.max_seq_len
    while not _emit(out, [tok], max_new_tokens, eos):
        p = torch.tensor([pos], device=dev)
        mask = torch.arange(size, device=dev)[None] <= pos
        logits, _ = target.fast(torch.tensor([[tok]], device=dev), p, p, mask)
        tok = _pick(logits[0, -1], temperature, top_k, top_p, generator)
        pos += 1
    return torch.tensor([out], dtype=torch.long)


@dataclass
class Tree:
    tokens: torch.Tensor  # [q] target ids, node 0 = root
    parents: torch.Tensor  # [q] node index of the parent (root: 0)
    depths: torch.Tensor  # [q]


@torch.no_grad()
def build_tree(draft: DraftRunner, root_token: int, root_hidden: torch.Tensor,
               root_logits: torch.Tensor, n: int, steps: int, topk: int,
               num_draft_tokens: int) -> Tree:
    """EAGLE-2 dynamic tree: expand ``topk`` children per frontier node for ``steps``
    levels, score = cumulative draft log-prob, keep the best ``num_draft_tokens - 1``."""
    d2t = draft.draft.draft_to_target
    dev = root_logits.device
    logp = torch.log_softmax(root_logits.float(), -1)
    score, ids = logp.topk(topk)
    tok = d2t(ids)
    c_tok, c_score, c_parent, c_depth = [tok], [score], [torch.full_like(ids, -1)], [1]
    front = torch.arange(topk, device=dev)  # candidate index of each frontier node
    f_tok, f_score, f_hidden = tok, score, root_hidden.expand(topk, -1)
    f_mask = (torch.arange(draft.cache_size, device=dev) < n).expand(topk, -1).clone()
    n_cand, rows = topk, torch.arange(topk, device=dev)
    for level in range(1, steps):
        slots = draft.spec_base + (level - 1) * topk + rows
        f_mask[rows, slots] = True  # a node sees the context, its ancestors and itself
        h, logits = draft.tree_step(f_tok, f_hidden, n + level - 1, slots, f_mask)
        s, ids = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)  # [K, K]
        # min() keeps scores monotone along a path even under rounding; with the stable
        # sort below a parent then always ranks before its children: the kept set is connected.
        child = torch.minimum(f_score[:, None] + s, f_score[:, None]).flatten()
        child_tok = d2t(ids).flatten()
        c_tok.append(child_tok)
        c_score.append(child)
        c_depth.append(level + 1)
        c_parent.append(front.repeat_interleave(topk))
        if level + 1 < steps:
            f_score, best = child.topk(topk)
            parent_row = best // topk
            front, f_tok = n_cand + best, child_tok[best]
            f_hidden, f_mask = h[parent_row], f_mask[parent_row]
        n_cand += topk * topk
    scores = torch.cat(c_score)
    keep = num_draft_tokens - 1
    sel = torch.sort(scores, descending=True, stable=True).indices[:keep].sort().values
    depth = torch.cat([torch.full((len(t),), d, device=dev) for t, d in zip(c_tok, c_depth)])
    node_of = torch.full((n_cand + 1,), -1, device=dev, dtype=torch.long)  # -1: not kept
    node_of[n_cand] = 0  # the root, parent of the depth-1 candidates
    node_of[sel] = torch.arange(1, keep + 1, device=dev)
    cand_parent = torch.cat(c_parent)[sel]
    parents = node_of[torch.where(cand_parent < 0, n_cand, cand_parent)]
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    return Tree(tokens=torch.cat([torch.tensor([root_token], device=dev), torch.cat(c_tok)[sel]]),
                parents=torch.cat([zero, parents]), depths=torch.cat([zero, depth[sel]]))


def tree_mask(tree: Tree, n: int, size: int, steps: int) -> torch.Tensor:
    """[q, size]: every node sees slots < n and the slots n+j of its ancestors and itself."""
    q = tree.tokens.shape[0]
    eye = torch.eye(q, dtype=torch.bool, device=tree.tokens.device)
    anc = eye
    for _ in range(steps):
        anc = eye | anc[tree.parents]
    mask = torch.zeros(q, size, dtype=torch.bool, device=anc.device)
    mask[:, :n] = True
    mask[:, n:n + q] = anc
    return mask


def _accept_greedy(logits, toks, children):
    target = logits.argmax(-1).tolist()
    path, cur = [0], 0
    while True:
        nxt = next((c for c in children[cur] if toks[c] == target[cur]), None)
        if nxt is None:
            return path, target[cur]
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


@torch.no_grad()
def speculative_generate(target: CachedTarget, draft: DraftRunner, input_ids: torch.Tensor,
                         max_new_tokens: int, steps: int, topk: int, num_draft_tokens: int,
                         temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                         eos_ids=None, generator: torch.Generator | None = None):
    """EAGLE speculative decoding. Returns (new tokens [1, m], SpecStats).

    At temperature 0 the tokens equal ``greedy_generate``'s; above it they follow the
    target's processed distribution exactly (see ``_accept_sample``)."""
    if steps < 1 or topk < 1 or not 2 <= num_draft_tokens <= 1 + topk + (steps - 1) * topk * topk:
        raise ConfigError(f"tree steps={steps} topk={topk} num_draft_tokens={num_draft_tokens}: "
                          "need steps, topk >= 1 and 2 <= num_draft_tokens <= 1 + candidates")
    if (steps - 1) * topk > draft.max_spec_nodes:
        raise ConfigError(f"the draft cache has {draft.max_spec_nodes} scratch slots; "
                          f"steps={steps} topk={topk} needs {(steps - 1) * topk}")
    input_ids = _prepare(target, input_ids, max_new_tokens + num_draft_tokens)
    if draft.max_seq_len < target.max_seq_len:
        raise ConfigError("the draft cache must be at least as long as the target cache")
    eos, out = _eos_set(eos_ids), []
    stats = SpecStats(accept_counts=[0] * steps)
    if max_new_tokens <= 0:
        return torch.zeros(1, 0, dtype=torch.long), stats
    dev = input_ids.device
    logits, aux = _prefill(target, input_ids)
    root = _pick(logits[0, -1], temperature, top_k, top_p, generator)
    n = input_ids.shape[1]
    done = _emit(out, [root], max_new_tokens, eos)
    if not done:
        next_ids = torch.cat([input_ids[:, 1:], torch.tensor([[root]], device=dev)], dim=1)
        r_hidden, r_logits = draft.extend(next_ids, aux, 0)
    q = num_draft_tokens
    while not done:
        tree = build_tree(draft, root, r_hidden[0], r_logits[0], n, steps, topk, q)
        mask = tree_mask(tree, n, target.max_seq_len, steps)
        slots = n + torch.arange(q, device=dev)
        logits, aux = target.fast(tree.tokens[None], n + tree.depths, slots, mask)
        toks, parents = tree.tokens.tolist(), tree.parents.tolist()
        children = [[] for _ in range(q)]
        for i in range(1, q):
            assert 0 <= parents[i] < i, "tree must be connected, parents before children"
            children[parents[i]].append(i)
        if temperature <= 0:
            path, bonus = _accept_greedy(logits[0], toks, children)
        else:
            path, bonus = _accept_sample(logits[0], toks, children, temperature, top_k, top_p,
                                         generator)
        new = [toks[i] for i in path[1:]] + [bonus]
        stats.verify_steps += 1
        stats.accept_lengths.append(len(new))
        for d in range(len(path) - 1):
            stats.accept_counts[d] += 1
        done = _emit(out, new, max_new_tokens, eos)
        if done:
            break
        k = len(path)  # root + accepted drafts: the positions n .. n+k-1 to commit
        path_t = torch.tensor(path, device=dev)
        if path != list(range(k)):
            target.move_kv(n + path_t, n + torch.arange(k, device=dev))
            stats.compactions += 1
        r_hidden, r_logits = draft.extend(torch.tensor([new], device=dev), aux[:, path_t], n,
                                          pad_to=min(steps, q - 1) + 1)
        n += k
        root = bonus
    stats.cache_len = n
    stats.tokens = len(out)
    return torch.tensor([out], dtype=torch.long), stats
