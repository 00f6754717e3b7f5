"""Decoding with a block drafter (draft/block.py) on the engine's own-cache target: one
drafting pass per round, verified as a chain. One request, eager. Greedy tokens equal plain
greedy decoding's; sampled ones follow the target's processed law (the drafts are the
drafter's argmax, accepted with the target's probability of them, as accept.accept_tree
accepts any deterministic draft).

A round, with ``n`` tokens in the target's cache and ``root`` the last emitted token (at
position n, in neither cache): the drafter reads ``[root, MASK x K]`` at n..n+K against its
context cache (the context keys and values of positions < n) and proposes K tokens at once;
the target verifies ``[root, d_1..d_K]`` at n..n+K in one pass; the drafts that match its
argmax are accepted, and its argmax after the last of them is the bonus token. The target's
aux states of root and the accepted drafts then extend the drafter's context cache: the
drafter never recomputes a position it has seen, as vLLM serves it.
"""

from __future__ import annotations

import torch

from draftling.draft.block import BlockDraft, block_visibility
from draftling.engine.accept import SpecOptions, SpecStats, accept_tree, emit_tokens, eos_set, pick_tokens
from draftling.engine.target_model import CachedTarget, causal_mask
from draftling.errors import ConfigError


class _Context:
    """The drafter's context keys and values, per layer, for positions 0..S-1."""

    def __init__(self, draft: BlockDraft, size: int, device, dtype):
        cfg = draft.config
        shape = (1, int(cfg.num_key_value_heads), size, int(cfg.head_dim))
        self.draft = draft
        self.kv = [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in draft.layers
        ]

    def extend(self, aux: torch.Tensor, start: int) -> None:
        """Add the context of aux states [1, m, K*H_t] at positions start..start+m-1."""
        m = aux.shape[1]
        pos = torch.arange(start, start + m, device=aux.device)[None]
        for (k, v), (nk, nv) in zip(self.kv, self.draft.context_kv(self.draft.context(aux), pos)):
            k[:, :, start : start + m] = nk
            v[:, :, start : start + m] = nv

    def upto(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, :n], v[:, :, :n]) for k, v in self.kv]


@torch.no_grad()
def block_generate(target: CachedTarget, draft: BlockDraft, input_ids, max_new_tokens: int, **options):
    """Decode one request: (new tokens, SpecStats: a round's path is its accepted drafts plus
    the bonus, as the EAGLE-3 rounds count theirs). ``input_ids``: [T] or [1, T];
    ``options``: SpecOptions fields (``eos_ids``, ``temperature``, ``generator``, ...)."""
    o = SpecOptions(**options)
    ids = torch.as_tensor(input_ids).view(1, -1).to(target.device)
    t, k = ids.shape[1], draft.block_size - 1
    if target.batch_size != 1 or t + max_new_tokens + k + 1 > target.max_seq_len:
        raise ConfigError(f"block decoding needs a 1-row target with room for {t + max_new_tokens + k + 1} tokens")
    row = torch.tensor([0], device=target.device)
    logits, aux = target.prefill_rows(row, ids, torch.tensor([t], device=target.device))
    ctx = _Context(draft, target.max_seq_len, target.device, draft.fc.weight.dtype)
    ctx.extend(aux, 0)
    root, n, eos = int(pick_tokens(logits[:, -1], o)), t, eos_set(o.eos_ids)
    out: list[int] = []
    stats = SpecStats(accept_counts=[0] * k)
    done = emit_tokens(out, [root], max_new_tokens, eos)
    while not done:
        drafts = _propose(draft, target, ctx, root, n)
        q = torch.tensor([[root, *drafts]], device=target.device)
        pos = torch.arange(n, n + k + 1, device=target.device)
        lg, ax = target.decode(q, pos, pos, causal_mask(n, k + 1, target.max_seq_len, target.device))
        chain = [[root, *drafts], [0, *range(k)], lg[0].argmax(-1).tolist()]  # tokens, parents, argmax
        path, new = accept_tree(chain, lg[0], o)
        ctx.extend(ax[:, : len(path)], n)
        stats.add_round(len(path))
        n, root = n + len(path), new[-1]
        done = emit_tokens(out, new, max_new_tokens, eos)
    stats.tokens = len(out)
    return out, stats


def _propose(draft: BlockDraft, target: CachedTarget, ctx: _Context, root: int, n: int) -> list[int]:
    """K drafts from one pass over ``[root, MASK x K]`` at n..n+K."""
    size, dev = draft.block_size, target.device
    tokens = torch.full((1, size), int(draft.config.mask_token_id), device=dev)
    tokens[0, 0] = root
    pos = torch.arange(n, n + size, device=dev)[None]
    visible = block_visibility(torch.tensor([[n]], device=dev), size, n, causal=draft.causal)
    hidden = draft.block_hidden(target.embed(tokens), pos, ctx.upto(n), visible)
    return draft.draft_to_target(draft.compute_logits(hidden[:, 1:]).argmax(-1))[0].tolist()
