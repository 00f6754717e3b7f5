"""Block-drafter rounds (draft/block.py) in the batched engine: one drafting pass per round,
verified as a chain, with the shapes, graphs and host protocol of ``spec_round.SpecRound``, so
engine/generate.py decodes an EAGLE-3 head and a block drafter through one loop.

A round, per row, with ``n`` tokens in the target's cache and ``root`` the last emitted token
(at position n, in neither cache): the drafter reads ``[root, MASK x K]`` at n..n+K against its
context cache (slot = position; the context keys and values of positions < n) and proposes K
tokens at once; the target verifies ``[root, d_1..d_K]`` at n..n+K, writing its K/V to slots
n..n+K in order. A chain's accepted path is always a prefix, so nothing moves: the round only
advances n. The verify pass's aux states extend the drafter's context at n..n+K for all K+1
queries; those past the accepted prefix sit at slots >= the next n, which no query sees and
the next round overwrites first.

``BlockTreeRound`` verifies a tree instead: the same one drafting pass gives each slot's
distribution, the best ``topk`` tokens of slot d are the children of depth d, and EAGLE-2's
selection keeps the ``q - 1`` best paths by summed log-probability. It is ``SpecRound`` with
that drafting and a commit that writes the drafter's context along the accepted path.
"""

from __future__ import annotations

import torch
from torch import nn

from draftling.draft.block import BlockDraft
from draftling.engine.options import EngineOptions
from draftling.engine.spec_round import RoundTimer, SpecRound
from draftling.engine.target_model import CachedTarget, StaticFn, matmul_attention, write_kv
from draftling.errors import ConfigError


def _attend(q, k, v, visible):
    """The engine's grouped matmul attention (no K/V repeat) over a [B, 1, Q, S] mask."""
    return matmul_attention(q, k, v, visible[:, 0], q.shape[-1] ** -0.5)


class BlockRunner(nn.Module):
    """A block drafter's side of the engine: each layer's context K and V [B, nkv, S, d]."""

    def __init__(
        self,
        draft: BlockDraft,
        embed: nn.Embedding,
        max_seq_len: int,
        batch_size: int = 1,
        options: EngineOptions | None = None,
        **engine,
    ):
        super().__init__()
        self.options = EngineOptions.of(options, **engine).check_resolved()
        self.draft, self.embed = draft, embed
        self.max_seq_len, self.batch_size = int(max_seq_len), int(batch_size)
        cfg, w = draft.config, draft.fc.weight
        shape = (self.batch_size, int(cfg.num_key_value_heads), self.max_seq_len, int(cfg.head_dim))
        self.k_ctx = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in draft.layers]
        self.v_ctx = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in draft.layers]
        self.rounds: dict = {}  # BlockRound per target, made once (its graphs are replayed)

    @property
    def dtype(self) -> torch.dtype:
        return self.draft.fc.weight.dtype

    @property
    def state_sizes(self) -> tuple[int, int]:
        """The per-row state the loop carries between rounds: none (EAGLE-3 carries two)."""
        return 0, 0

    @property
    def cache_size(self) -> int:  # SpecRound's names; a block drafter has no scratch slots
        return self.max_seq_len

    @property
    def spec_base(self) -> int:
        return self.max_seq_len

    def is_chain(self, steps: int, topk: int, num_draft_tokens: int) -> bool:
        """The head's own round: its whole block as one chain (``block-B``)."""
        k = self.draft.block_size - 1
        return (steps, topk, num_draft_tokens) == (k, 1, k + 1)

    def check_config(self, steps: int, topk: int, num_draft_tokens: int) -> None:
        """Its chain, or a tree no deeper than its block (a depth-d node is a slot-d token)."""
        k = self.draft.block_size - 1
        if self.is_chain(steps, topk, num_draft_tokens):
            return
        if not (1 <= steps <= k and topk >= 1 and 2 <= num_draft_tokens <= 1 + topk + (steps - 1) * topk * topk):
            raise ConfigError(
                f"a block drafter of block size {k + 1} decodes chain-{k}-1-{k + 1} (block-{k + 1}) or trees of at "
                f"most {k} levels; got steps={steps} topk={topk} num_draft_tokens={num_draft_tokens}"
            )

    def write_context(self, aux: torch.Tensor, slots: torch.Tensor, rows=None) -> None:
        """The context K/V of the target's aux states [B, T, K*H_t] at ``slots`` [B, T]
        (slot = position), into batch ``rows`` [B] (default: every row, in order)."""
        kv = self.draft.context_kv(self.draft.context(aux), slots)
        for cache_k, cache_v, (k, v) in zip(self.k_ctx, self.v_ctx, kv):
            if rows is None:
                write_kv(cache_k, slots, k)
                write_kv(cache_v, slots, v)
            else:
                t = slots.shape[1]
                cache_k[rows, :, :t], cache_v[rows, :, :t] = k, v

    @torch.no_grad()
    def extend_rows(self, rows: torch.Tensor, next_ids: torch.Tensor, aux: torch.Tensor, lengths: torch.Tensor):
        """New requests' prompts into batch rows ``rows`` (right-padded aux [g, T, K*H_t], as
        ``CachedTarget.prefill_rows``): their context at 0..T-1. Pad slots lie past each row's
        length, where the first round writes before anything reads. Returns the (empty) state."""
        g, t = next_ids.shape
        self.write_context(aux, torch.arange(t, device=aux.device).expand(g, -1), rows)
        empty = aux.new_zeros(g, 0)
        return empty, empty


def block_logits(runner: BlockRunner, shape: BlockShape, n, root):
    """One drafting pass over ``[root, MASK x K]`` at n..n+K against the context cache: the
    draft logits of slots 1..K [B, K, Vd]."""
    b = n.shape[0]
    tokens = torch.cat([root[:, None], shape.mask_ids.expand(b, -1)], 1)
    pos = n[:, None] + shape.offsets
    before = (shape.cols[None, None] < n[:, None, None]).expand(-1, tokens.shape[1], -1)
    visible = torch.cat([before, shape.own.expand(b, -1, -1)], -1)[:, None]
    kv = list(zip(runner.k_ctx, runner.v_ctx))
    hidden = runner.draft.block_hidden(runner.embed(tokens), pos, kv, visible, _attend)
    return runner.draft.compute_logits(hidden[:, 1:])


class BlockShape:
    """The tensors ``block_logits`` reads, made once per round object (graphs read them in place)."""

    def __init__(self, runner: BlockRunner, dev):
        k, draft = runner.draft.block_size - 1, runner.draft
        self.offsets = torch.arange(k + 1, device=dev)
        self.mask_ids = torch.full((k,), int(draft.config.mask_token_id), dtype=torch.long, device=dev)
        self.cols = torch.arange(runner.max_seq_len, device=dev)
        own = torch.ones(k + 1, k + 1, dtype=torch.bool, device=dev)
        self.own = own.tril() if draft.causal else own


class BlockRound:
    """The device side of a block drafter's rounds on one engine: ``fused_round``, ``propose``
    and ``commit`` as ``SpecRound`` has them, for the chain (K, 1, K+1)."""

    def __init__(self, target: CachedTarget, runner: BlockRunner):
        self.target, self.runner, self.draft = target, runner, runner.draft
        k, dev = self.draft.block_size - 1, target.device
        self.steps, self.topk, self.q = k, 1, k + 1
        self.path_len = k + 1
        self.n_cap = target.max_seq_len - max(k + 1, int(target.query_pad))
        self.shape = BlockShape(runner, dev)
        self.offsets, self.cols = self.shape.offsets, self.shape.cols
        self.parents = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), self.offsets[:-1]])
        self.graphs = bool(target.cuda_graphs)
        self.fused = StaticFn(self.draft_and_verify, self.graphs)
        self.fused_round = StaticFn(self.device_round, self.graphs)
        self.split: tuple[StaticFn, StaticFn] | None = None
        self.empty = torch.zeros(target.batch_size, 0, dtype=runner.dtype, device=dev)

    @classmethod
    def cached(cls, target: CachedTarget, runner: BlockRunner) -> BlockRound:
        if target not in runner.rounds:
            runner.rounds[target] = cls(target, runner)
        return runner.rounds[target]

    # ------------------------------------------------------------------ device functions

    def draft_block(self, n, root):
        """Each row's K drafts [B, K] (target ids) from one pass over ``[root, MASK x K]``."""
        return self.draft.draft_to_target(block_logits(self.runner, self.shape, n, root).argmax(-1))

    def verify(self, n, root, drafts):
        """The target on ``[root, drafts]`` at n..n+K (K/V to those slots), and the drafter's
        context from its aux states there. Returns packed [B, 3, K+1] = (tokens, parents,
        target argmax), aux [B, K+1, K*H_t], logits [B, K+1, V]."""
        tokens = torch.cat([root[:, None], drafts], 1)
        pos = n[:, None] + self.offsets
        logits, aux = self.target.decode(tokens, pos, pos, self.cols[None, None] <= pos[..., None])
        self.runner.write_context(aux, pos)
        b = n.shape[0]
        return torch.stack([tokens, self.parents.expand(b, -1), logits.argmax(-1)], 1), aux, logits

    def drafts_only(self, n, root):
        return (self.draft_block(n, root),)  # a StaticFn returns a tuple of tensors

    def draft_and_verify(self, n, root, r_hidden, r_logits):
        return self.verify(n, root, self.draft_block(n, root))

    def advance(self, n, k, bonus):
        """(next n, next root): a row past ``n_cap`` (a finished request still stepping until
        the host refills it) stays where it is."""
        return torch.where(n + k > self.n_cap, n, n + k), bonus

    def device_round(self, n, root, r_hidden, r_logits):
        """A whole greedy round on the device (draft, verify, accept): no host value in or out.
        emitted [B, 2+K+1] holds per row (path length k, moved = 0, the k new tokens, padding):
        the accepted drafts equal the target's argmax, so the new tokens are its first k."""
        drafts = self.draft_block(n, root)
        packed, _, _ = self.verify(n, root, drafts)
        best = packed[:, 2]
        k = 1 + (drafts == best[:, :-1]).long().cumprod(1).sum(1)
        n_next, root_next = self.advance(n, k, best.gather(1, (k - 1)[:, None])[:, 0])
        return n_next, root_next, r_hidden, r_logits, torch.cat([k[:, None], torch.zeros_like(k)[:, None], best], 1)

    # ------------------------------------------------------------------ host side

    def propose(self, n, root, r_hidden, r_logits, timer: RoundTimer | None = None):
        if timer is None:
            return self.fused(n, root, r_hidden, r_logits)
        if self.split is None:
            self.split = (StaticFn(self.drafts_only, self.graphs), StaticFn(self.verify, self.graphs))
        draft_fn, verify_fn = self.split
        (drafts,) = draft_fn(n, root)
        timer.mark()
        out = verify_fn(n, root, drafts)
        timer.mark()
        return out

    def commit(self, n: list[int], paths: list[list[int]], news: list[list[int]], aux: torch.Tensor):
        """Advance each row by its accepted path (chosen on the host); nothing moves."""
        dev = self.target.device
        n_t = torch.tensor(n, dtype=torch.long, device=dev)
        k_t = torch.tensor([len(p) for p in paths], dtype=torch.long, device=dev)
        bonus = torch.tensor([x[-1] for x in news], dtype=torch.long, device=dev)
        n_next, root = self.advance(n_t, k_t, bonus)
        return [False] * len(paths), n_next, root, self.empty, self.empty


class BlockTreeRound(SpecRound):
    """A block drafter's tree round: ``SpecRound`` (verify, acceptance, the K/V move, graphs,
    host protocol) with one drafting pass building the tree and the commit extending the
    drafter's context instead of an EAGLE-3 draft's cache."""

    def __init__(self, target: CachedTarget, runner: BlockRunner, steps: int, topk: int, num_draft_tokens: int):
        super().__init__(target, runner, steps, topk, num_draft_tokens)  # type: ignore[arg-type]
        self.runner = runner
        self.shape = BlockShape(runner, target.device)
        self.empty = torch.zeros(target.batch_size, 0, dtype=runner.dtype, device=target.device)

    @classmethod
    def cached(cls, target, draft, steps, topk, num_draft_tokens):  # type: ignore[override]
        key = (target, steps, topk, num_draft_tokens)
        if key not in draft.rounds:
            draft.rounds[key] = cls(target, draft, steps, topk, num_draft_tokens)
        return draft.rounds[key]

    def draft_tree(self, n, root, r_hidden, r_logits):
        """Depth d's candidates: slot d's best ``topk`` tokens under each of the ``topk`` best
        depth d-1 nodes, scored by summed log-probability (slots are drafted together, so a
        node's children are the same tokens whoever the parent is); then ``_select``."""
        k, b, d2t = self.topk, n.shape[0], self.runner.draft.draft_to_target
        logp = torch.log_softmax(block_logits(self.runner, self.shape, n, root).float(), -1)
        score, ids = logp[:, 0].topk(k)
        c_tok, c_score, c_parent = [d2t(ids)], [score], [self.root_parent.expand(b, k)]
        front, f_score = self.rows.expand(b, k), score
        for level in range(1, self.steps):
            s, ids = logp[:, level].topk(k)
            child = torch.minimum(f_score[..., None] + s[:, None], f_score[..., None]).flatten(1)
            c_tok.append(d2t(ids)[:, None].expand(-1, k, -1).flatten(1))
            c_score.append(child)
            c_parent.append(front[..., None].expand(-1, -1, k).flatten(1))
            if level + 1 < self.steps:
                f_score, best = child.topk(k)
                front = self.first[level] + best
        return self._select(root, torch.cat(c_tok, 1), torch.cat(c_score, 1), torch.cat(c_parent, 1))

    def _commit(self, n, path, k, new, aux, rows):
        """The accepted path's target K/V to n.., and the drafter's context there from the
        path's aux states (pad rows past k land at slots no query sees before they are rewritten)."""
        half = len(rows) // 2
        k_rows, v_rows = (rows[0], rows[1]) if self.kv_one_tensor else (rows[:half], rows[half:])
        slots = n[:, None] + self.path_rows
        self.target.scatter_kv(slots, k_rows, v_rows)
        self.runner.write_context(aux.gather(1, path[..., None].expand(-1, -1, aux.shape[-1])), slots)
        moved = (path != self.path_rows).any(1).long()
        n_next = torch.where(n + k > self.n_cap, n, n + k)
        return n_next, new.gather(1, (k - 1)[:, None])[:, 0], self.empty, self.empty, moved
