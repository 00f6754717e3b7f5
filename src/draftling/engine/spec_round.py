"""One speculative round as static-shape device work, for a fixed tree config.

A round used to be dozens of small eager kernels (per tree level: topk, log_softmax, cat,
index, mask writes) plus several host syncs; on a GPU those, not the two forwards, set the
round time. Here the whole drafting phase (every tree level, the EAGLE-2 selection and the
tree's attention mask) and the target's verify pass are ONE function of device tensors with
shapes fixed by (steps, topk, num_draft_tokens): no host values, no syncs, no data-dependent
shapes. ``StaticFn`` runs it eagerly or as one CUDA graph (its layers compiled or not). A round is then

    propose (one replay) -> one .tolist() of a packed [3, q] tensor -> Python acceptance
    -> commit: move_kv of the accepted path (two replays, only when it is out of place)
       and the draft's extend (one replay), fed by one host->device copy.

Greedy decoding with graphs goes further: ``device_round`` also accepts and commits on the
device, so a round is one replay and the host reads the emitted tokens back every few rounds.

Layout (see generate.py): n = tokens in the target cache, root at position n; depth-d nodes
are candidates for position n+d; the draft step expanding depth-d nodes runs at n+d-1 and
writes scratch slots spec_base + (d-1)*topk + row.
"""

from __future__ import annotations

import time

import torch

from draftling.engine.draft_runner import DraftRunner
from draftling.engine.target_model import CachedTarget, StaticFn


class SpecRound:
    """The device side of speculative rounds for one engine and one (steps, topk, q)."""

    def __init__(self, target: CachedTarget, draft: DraftRunner, steps: int, topk: int, num_draft_tokens: int):
        self.target, self.draft = target, draft
        self.steps, self.topk, self.q = steps, topk, num_draft_tokens
        self.path_len = min(steps, num_draft_tokens - 1) + 1  # root + the longest acceptable path
        dev = target.device
        k, long = topk, dict(dtype=torch.long, device=dev)
        # Constants of the config, made once: the captured graph reads them in place.
        self.rows = torch.arange(k, **long)
        # Mask writes take this device tensor: a Python True would arrive as a CPU tensor.
        self.true_k = torch.ones(k, dtype=torch.bool, device=dev)
        self.draft_cols = torch.arange(draft.cache_size, **long)
        self.target_cols = torch.arange(target.max_seq_len, **long)
        self.scratch = [draft.spec_base + level * k + self.rows for level in range(steps - 1)]
        # Candidates: topk at depth 1, then topk*topk per further level, in expansion order.
        # ``first[d-1]`` is the index of depth d's first candidate; the root gets index n_cand.
        self.first = [0] + [k + level * k * k for level in range(steps - 1)]
        self.n_cand = k + (steps - 1) * k * k
        self.cand_depth = torch.cat([torch.full((k if d == 1 else k * k,), d, **long) for d in range(1, steps + 1)])
        self.root_parent = torch.full((k,), self.n_cand, **long)
        # Candidate -> node index; -1 (not kept) must never be looked up: the kept set is connected.
        self.node_of_init = torch.cat([torch.full((self.n_cand,), -1, **long), torch.zeros(1, **long)])
        self.node_ids = torch.arange(1, num_draft_tokens, **long)
        self.nodes = torch.arange(num_draft_tokens, **long)
        self.eye = torch.eye(num_draft_tokens, dtype=torch.bool, device=dev)
        self.path_rows = torch.arange(self.path_len, **long)
        self.zero = torch.zeros(1, **long)
        graphs = dict(cuda_graphs=target.cuda_graphs)
        self.fused = StaticFn(self.draft_and_verify, **graphs)
        self.fused_round = StaticFn(self.device_round, **graphs)
        # Timing needs an event between drafting and verifying: two graphs, made on demand.
        self.split = None
        self._graphs = graphs
        # Host->device control values go through one pinned buffer: only a copy from pinned
        # memory is truly asynchronous (torch.tensor(..., device=) waits for the stream).
        # Every upload is followed by a round's .tolist() before the next one, so the buffer
        # is never rewritten while a copy from it is in flight.
        b = target.batch_size
        n_ctrl = b * (2 + 2 * self.path_len)
        self.cuda = dev.type == "cuda"
        self.ctrl_host = torch.zeros(n_ctrl, dtype=torch.long, pin_memory=self.cuda)
        self.ctrl = torch.zeros(n_ctrl, **long)
        # A row whose next round would not fit the cache stops advancing (see commit_rows).
        self.n_cap = target.max_seq_len - max(num_draft_tokens, target.query_pad)
        # The host's commit as two graphs, gather then the rest (see commit_gathered). The fast
        # path keeps one K (and V) tensor for all layers, the general path one per layer.
        self.kv_one_tensor = torch.is_tensor(getattr(target, "k_all", None))
        # The gathered rows pass between the two graphs in buffers kept per (B, path_len): as
        # outputs and inputs they cost a host launch per tensor each way, 2 x 2 x layers on
        # the general path (Gemma 3 on the H200: commit 1.61 -> 0.67 ms, commit-ab results).
        self._moving: dict[tuple, list[torch.Tensor]] = {}
        self._gather_fn = StaticFn(self.gather_path, **graphs)
        self._commit_fn = StaticFn(self.commit_gathered, **graphs)

    @classmethod
    def cached(
        cls, target: CachedTarget, draft: DraftRunner, steps: int, topk: int, num_draft_tokens: int
    ) -> SpecRound:
        """This engine's round for the config, made once: later generations replay its graphs."""
        key = (target, steps, topk, num_draft_tokens)
        if key not in draft.rounds:
            draft.rounds[key] = cls(target, draft, steps, topk, num_draft_tokens)
        return draft.rounds[key]

    # ------------------------------------------------------------------ device functions

    def draft_tree(self, n, root, r_hidden, r_logits):
        """EAGLE-2 dynamic tree, per batch row: expand ``topk`` children per frontier node for
        ``steps`` levels, score = cumulative draft log-prob, keep the best ``q - 1`` candidates.

        ``n``, ``root``: [B] long; ``r_hidden`` [B,H], ``r_logits`` [B,Vd] propose the root's
        children. Returns tokens [B,q] (node 0 = root), parents [B,q] (root: 0), depths [B,q];
        nodes are kept candidates in expansion order, so parents come before children."""
        k, d2t, b = self.topk, self.draft.draft.draft_to_target, n.shape[0]
        score, ids = torch.log_softmax(r_logits.float(), -1).topk(k)  # [B,k]
        tok = d2t(ids)
        c_tok, c_score, c_parent = [tok], [score], [self.root_parent.expand(b, k)]
        front, f_tok, f_score, f_hidden = self.rows.expand(b, k), tok, score, r_hidden[:, None].expand(-1, k, -1)
        # frontier row -> visible draft slots
        f_mask = (self.draft_cols[None, None] < n[:, None, None]).expand(-1, k, -1).clone()
        for level in range(1, self.steps):
            slots = self.scratch[level - 1]
            f_mask[:, self.rows, slots] = self.true_k  # a node sees the context, its ancestors and itself
            h, logits = self.draft(f_tok, f_hidden, (n + level - 1)[:, None].expand(-1, k), slots, f_mask)
            s, ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # [B,k,k]
            # min() keeps scores monotone along a path even under rounding; with the stable
            # sort below a parent then always ranks before its children: the kept set is connected.
            child = torch.minimum(f_score[..., None] + s, f_score[..., None]).flatten(1)
            child_tok = d2t(ids).flatten(1)
            c_tok.append(child_tok)
            c_score.append(child)
            c_parent.append(front[..., None].expand(-1, -1, k).flatten(1))
            if level + 1 < self.steps:
                f_score, best = child.topk(k)
                parent_row = best // k
                front, f_tok = self.first[level] + best, child_tok.gather(1, best)
                f_hidden = h.gather(1, parent_row[..., None].expand(-1, -1, h.shape[-1]))
                f_mask = f_mask.gather(1, parent_row[..., None].expand(-1, -1, f_mask.shape[-1]))
        return self._select(root, torch.cat(c_tok, 1), torch.cat(c_score, 1), torch.cat(c_parent, 1))

    def _select(self, root, c_tok, c_score, c_parent):
        """The best ``q - 1`` candidates of each row as (tokens, parents, depths) [B,q]."""
        b = root.shape[0]
        keep = self.q - 1
        sel = torch.sort(c_score, dim=1, descending=True, stable=True).indices[:, :keep].sort(dim=1).values
        node_of = self.node_of_init.expand(b, -1).clone()
        node_of.scatter_(1, sel, self.node_ids.expand(b, -1))
        parents = node_of.gather(1, c_parent.gather(1, sel))
        zero = self.zero.expand(b, 1)
        return (
            torch.cat([root[:, None], c_tok.gather(1, sel)], 1),
            torch.cat([zero, parents], 1),
            torch.cat([zero, self.cand_depth[sel]], 1),
        )

    def tree_mask(self, n, parents):
        """[B, q, max_seq_len]: every node sees slots < n and the slots n+j of its ancestors and itself."""
        b, q = parents.shape
        anc = self.eye.expand(b, q, q)
        for _ in range(self.steps):  # depth <= steps: that many hops reach the root from any node
            anc = self.eye | anc.gather(1, parents[..., None].expand(-1, -1, q))
        mask = (self.target_cols[None, None] < n[:, None, None]).expand(-1, q, -1).clone()
        return mask.scatter_(2, (n[:, None] + self.nodes)[:, None].expand(-1, q, -1), anc)

    def verify(self, n, tokens, parents, depths):
        """The target on each row's tree (K/V to slots n..n+q-1). Returns packed [B, 3, q] =
        (tokens, parents, target argmax per node), aux [B,q,3H], logits [B,q,V]."""
        logits, aux = self.target.decode(
            tokens, n[:, None] + depths, n[:, None] + self.nodes, self.tree_mask(n, parents)
        )
        return torch.stack([tokens, parents, logits.argmax(-1)], 1), aux, logits

    def draft_and_verify(self, n, root, r_hidden, r_logits):
        return self.verify(n, *self.draft_tree(n, root, r_hidden, r_logits))

    def greedy_path(self, packed, depths):
        """Greedy acceptance on the device, per row: same result as ``generate._accept_greedy``
        (siblings carry distinct tokens, so the nodes whose whole ancestry matches the target's
        argmax form one path from the root). Returns (path [B,p] padded with its own rows,
        k [B] path length, new [B,p]: the accepted drafts then the bonus, then padding)."""
        tokens, parents, best = packed[:, 0], packed[:, 1], packed[:, 2]
        match = (tokens == best.gather(1, parents)) | (self.nodes == 0)
        accepted = match
        for _ in range(self.steps):  # depth <= steps: that many hops reach the root
            accepted = match & accepted.gather(1, parents)
        at_depth = accepted[:, None] & (depths[:, None] == self.path_rows[:, None])  # [B,p,q]
        found = at_depth.any(-1)
        k = found.sum(1)
        path = torch.where(found, at_depth.float().argmax(-1), self.path_rows)
        bonus = best.gather(1, path.gather(1, (k - 1)[:, None]))
        # Row j holds the token after path[j]: the next accepted draft, or the bonus at j = k-1.
        new = torch.where(self.path_rows == (k - 1)[:, None], bonus, tokens.gather(1, path.roll(-1, 1)))
        return path, k, new

    def commit_rows(self, n, path, k, new, aux):
        """Make each row's accepted ``path`` permanent: its target K/V move to slots n.. (pad
        rows move a slot onto itself) and the draft extends over ``new``. Returns (next n,
        next root, r_hidden, r_logits, moved [B]). A row past the cache's end (a finished
        request still stepping until the host refills it) stays where it is."""
        return self._commit(n, path, k, new, aux, self._gathered(n, path))

    def _gathered(self, n, path) -> list:
        """The target K/V of each row's accepted path, read before any slot is written: K then
        V, one tensor each (fast path) or one per layer."""
        k_rows, v_rows = self.target.gather_kv(n[:, None] + path)
        return [k_rows, v_rows] if self.kv_one_tensor else [*k_rows, *v_rows]

    def gather_path(self, n, path) -> tuple:
        """The host commit's first graph: ``_gathered`` into ``_moving``."""
        rows, key = self._gathered(n, path), tuple(path.shape)
        if key not in self._moving:  # at a graph's eager warm-up, never in its capture
            self._moving[key] = [torch.empty_like(r) for r in rows]
        for buf, r in zip(self._moving[key], rows):
            buf.copy_(r)
        return ()

    def commit_gathered(self, n, path, k, new, aux):
        """The host commit's second graph, from ``_moving``: each half alone is safe to repeat,
        as a graph's warm-up does; together they are not (the writes overlap the slots read)."""
        return self._commit(n, path, k, new, aux, self._moving[tuple(path.shape)])

    def _commit(self, n, path, k, new, aux, rows):
        half = len(rows) // 2
        k_rows, v_rows = (rows[0], rows[1]) if self.kv_one_tensor else (rows[:half], rows[half:])
        self.target.scatter_kv(n[:, None] + self.path_rows, k_rows, v_rows)
        hidden, logits = self.draft._extend(new, aux.gather(1, path[..., None].expand(-1, -1, aux.shape[-1])), n)
        last = (k - 1)[:, None, None]
        r_hidden = hidden.gather(1, last.expand(-1, 1, hidden.shape[-1]))[:, 0]
        r_logits = logits.gather(1, last.expand(-1, 1, logits.shape[-1]))[:, 0]
        moved = (path != self.path_rows).any(1).long()
        n_next = torch.where(n + k > self.n_cap, n, n + k)
        return n_next, new.gather(1, (k - 1)[:, None])[:, 0], r_hidden, r_logits, moved

    def device_round(self, n, root, r_hidden, r_logits):
        """A whole greedy round (draft, verify, accept, commit): one graph on a GPU, with no
        host value in or out, so the host can queue rounds before reading any back. The last
        output, emitted [B, 2+p], holds per row (path length k, moved, k new tokens, padding)."""
        tokens, parents, depths = self.draft_tree(n, root, r_hidden, r_logits)
        packed, aux, _ = self.verify(n, tokens, parents, depths)
        path, k, new = self.greedy_path(packed, depths)
        *state, moved = self.commit_rows(n, path, k, new, aux)
        return (*state, torch.cat([k[:, None], moved[:, None], new], 1))

    # ------------------------------------------------------------------ host side

    def upload(self, values: list[int]) -> torch.Tensor:
        """Ints -> a device long tensor with one asynchronous copy (a view of ``self.ctrl``)."""
        m = len(values)
        if not self.cuda:
            return torch.tensor(values, dtype=torch.long)
        self.ctrl_host.numpy()[:m] = values
        return self.ctrl[:m].copy_(self.ctrl_host[:m], non_blocking=True)

    def propose(self, n, root, r_hidden, r_logits, timer: RoundTimer | None = None):
        """Draft the tree and verify it: (packed, aux, logits) as in ``verify``."""
        if timer is None:
            return self.fused(n, root, r_hidden, r_logits)
        if self.split is None:
            self.split = (StaticFn(self.draft_tree, **self._graphs), StaticFn(self.verify, **self._graphs))
        draft_fn, verify_fn = self.split
        tree = draft_fn(n, root, r_hidden, r_logits)
        timer.mark()
        out = verify_fn(n, *tree)
        timer.mark()
        return out

    def commit(self, n: list[int], paths: list[list[int]], news: list[list[int]], aux: torch.Tensor):
        """Make each row's accepted path (node indices from the root), chosen on the host,
        permanent: ``commit_rows`` fed by one upload. ``news``: accepted tokens + bonus.

        Returns (moved per row, next n [B], next root [B], r_hidden [B,H], r_logits [B,Vd]), all
        but ``moved`` on the device, ready for the next ``propose``."""
        b, p = len(n), self.path_len
        flat = list(n) + [len(x) for x in paths]
        for x in paths:  # padded with its own rows: a pad row moves a slot onto itself
            flat += x + list(range(len(x), p))
        for x in news:
            flat += x + [0] * (p - len(x))
        ctrl = self.upload(flat)
        n_t, k_t = ctrl[:b], ctrl[b : 2 * b]
        path_t, new_t = ctrl[2 * b : 2 * b + b * p].view(b, p), ctrl[2 * b + b * p :].view(b, p)
        self._gather_fn(n_t, path_t)
        n_next, root, r_hidden, r_logits, _ = self._commit_fn(n_t, path_t, k_t, new_t, aux)
        return [x != list(range(len(x))) for x in paths], n_next, root, r_hidden, r_logits


class RoundTimer:
    """Mean milliseconds per speculative round, split into phases that add up to the round:
    draft (round start -> tree built), verify (-> target pass done), accept (-> host has
    read the tree and run acceptance), commit (-> next round starts: move_kv + extend).

    On CUDA a mark is an event recorded on the current stream: no sync, it fires when the GPU
    gets there, so a phase holds its GPU work plus any gap spent waiting for the host
    (launches, Python). ``summary`` syncs once, after decoding. On CPU marks are wall-clock
    times (eager CPU work is synchronous). Timing replays drafting and verifying as two graphs
    instead of one, so it costs one extra graph launch per round."""

    PHASES = ("draft", "verify", "accept", "commit")

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.rounds: list[list] = []

    def start(self) -> None:
        self.rounds.append([])
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.rounds[-1].append(event)
        else:
            self.rounds[-1].append(time.perf_counter())

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def summary(self) -> dict | None:
        if not self.rounds:
            return None
        if self.cuda:
            self.rounds[-1][-1].synchronize()
        totals = dict.fromkeys(self.PHASES, 0.0)
        for i, marks in enumerate(self.rounds):
            # A round's commit ends where the next round starts; the last round commits nothing.
            ends = marks[1:] + self.rounds[i + 1][:1] if i + 1 < len(self.rounds) else marks[1:]
            for phase, a, b in zip(self.PHASES, marks, ends):
                totals[phase] += self._ms(a, b)
        r = len(self.rounds)
        out = {f"{p}_ms": totals[p] / r for p in self.PHASES}
        out["round_ms"] = sum(out.values())
        out["rounds"] = r
        return out
