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

    def __init__(self, target: CachedTarget, draft: DraftRunner, steps: int, topk: int,
                 num_draft_tokens: int):
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
        self.cand_depth = torch.cat([torch.full((k if d == 1 else k * k,), d, **long)
                                     for d in range(1, steps + 1)])
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
        n_ctrl = 3 + 2 * self.path_len
        self.cuda = dev.type == "cuda"
        self.ctrl_host = torch.zeros(n_ctrl, dtype=torch.long, pin_memory=self.cuda)
        self.ctrl = torch.zeros(n_ctrl, **long)
        # Capture the move graphs now, not inside a timed round: an identity move changes nothing.
        target.move_kv(self.path_rows, self.path_rows)

    @classmethod
    def cached(cls, target: CachedTarget, draft: DraftRunner, steps: int, topk: int,
               num_draft_tokens: int) -> "SpecRound":
        """This engine's round for the config, made once: later generations replay its graphs."""
        key = (target, steps, topk, num_draft_tokens)
        if key not in draft.rounds:
            draft.rounds[key] = cls(target, draft, steps, topk, num_draft_tokens)
        return draft.rounds[key]

    # ------------------------------------------------------------------ device functions

    def draft_tree(self, n, root, r_hidden, r_logits):
        """EAGLE-2 dynamic tree: expand ``topk`` children per frontier node for ``steps``
        levels, score = cumulative draft log-prob, keep the best ``q - 1`` candidates.

        ``n``, ``root``: [1] long; ``r_hidden`` [1,H], ``r_logits`` [1,Vd] propose the root's
        children. Returns tokens [q] (node 0 = root), parents [q] (root: 0), depths [q]; nodes
        are kept candidates in expansion order, so parents come before children."""
        k, d2t = self.topk, self.draft.draft.draft_to_target
        score, ids = torch.log_softmax(r_logits[0].float(), -1).topk(k)
        tok = d2t(ids)
        c_tok, c_score, c_parent = [tok], [score], [self.root_parent]
        front, f_tok, f_score, f_hidden = self.rows, tok, score, r_hidden.expand(k, -1)
        f_mask = (self.draft_cols < n).expand(k, -1).clone()  # frontier row -> visible draft slots
        for level in range(1, self.steps):
            slots = self.scratch[level - 1]
            f_mask[self.rows, slots] = self.true_k  # a node sees the context, its ancestors and itself
            h, logits = self.draft(f_tok[None], f_hidden[None], (n + level - 1).expand(k), slots,
                                   f_mask)
            s, ids = torch.log_softmax(logits[0].float(), -1).topk(k, dim=-1)  # [k, k]
            # min() keeps scores monotone along a path even under rounding; with the stable
            # sort below a parent then always ranks before its children: the kept set is connected.
            child = torch.minimum(f_score[:, None] + s, f_score[:, None]).flatten()
            child_tok = d2t(ids).flatten()
            c_tok.append(child_tok)
            c_score.append(child)
            c_parent.append(front[:, None].expand(-1, k).flatten())
            if level + 1 < self.steps:
                f_score, best = child.topk(k)
                parent_row = best // k
                front, f_tok = self.first[level] + best, child_tok[best]
                f_hidden, f_mask = h[0, parent_row], f_mask[parent_row]
        keep = self.q - 1
        sel = torch.sort(torch.cat(c_score), descending=True, stable=True).indices[:keep].sort().values
        node_of = self.node_of_init.clone()
        node_of[sel] = self.node_ids
        parents = node_of[torch.cat(c_parent)[sel]]
        return (torch.cat([root, torch.cat(c_tok)[sel]]), torch.cat([self.zero, parents]),
                torch.cat([self.zero, self.cand_depth[sel]]))

    def tree_mask(self, n, parents):
        """[q, max_seq_len]: every node sees slots < n and the slots n+j of its ancestors and itself."""
        anc = self.eye
        for _ in range(self.steps):  # depth <= steps: that many hops reach the root from any node
            anc = self.eye | anc[parents]
        mask = (self.target_cols < n).expand(self.q, -1).clone()
        return mask.index_copy_(1, n + self.nodes, anc)

    def verify(self, n, tokens, parents, depths):
        """The target on the whole tree (K/V to slots n..n+q-1). Returns packed [3, q] =
        (tokens, parents, target argmax per node), aux [1,q,3H], logits [1,q,V]."""
        logits, aux = self.target.decode(tokens[None], n + depths, n + self.nodes,
                                         self.tree_mask(n, parents))
        return torch.stack([tokens, parents, logits[0].argmax(-1)]), aux, logits

    def draft_and_verify(self, n, root, r_hidden, r_logits):
        return self.verify(n, *self.draft_tree(n, root, r_hidden, r_logits))

    def accept_and_commit(self, n, packed, depths, aux):
        """Greedy acceptance and the commit as device work, for rounds the host reads back
        later. Same result as ``generate._accept_greedy`` followed by ``commit``: siblings
        carry distinct tokens, so the nodes whose whole ancestry matches the target's argmax
        form one path from the root. Returns (next n, next root, r_hidden, r_logits,
        emitted [2+p] = (path length k, moved, k new tokens then padding))."""
        tokens, parents, best = packed[0], packed[1], packed[2]
        match = (tokens == best[parents]) | (self.nodes == 0)
        accepted = match
        for _ in range(self.steps):  # depth <= steps: that many hops reach the root
            accepted = match & accepted[parents]
        at_depth = accepted[None] & (depths[None] == self.path_rows[:, None])  # [p, q]
        found = at_depth.any(-1)
        k = found.sum().view(1)
        # Pad rows move a slot onto itself, as in ``commit``.
        path = torch.where(found, at_depth.float().argmax(-1), self.path_rows)
        bonus = best[path.gather(0, k - 1)]
        # Row j holds the token after path[j]: the next accepted draft, or the bonus at j = k-1.
        new = torch.where(self.path_rows == k - 1, bonus, tokens[path.roll(-1)])
        moved = (path != self.path_rows).any().view(1).long()
        k_rows, v_rows = self.target.gather_kv(n + path)
        self.target.scatter_kv(n + self.path_rows, k_rows, v_rows)
        hidden, logits = self.draft._extend(new[None], aux[:, path], n)
        last = k - 1
        r_hidden, r_logits = hidden.index_select(1, last)[:, 0], logits.index_select(1, last)[:, 0]
        return n + k, bonus, r_hidden, r_logits, torch.cat([k, moved, new])

    def device_round(self, n, root, r_hidden, r_logits):
        """A whole greedy round (draft, verify, accept, commit): one graph on a GPU, with no
        host value in or out, so the host can queue rounds before reading any back."""
        tokens, parents, depths = self.draft_tree(n, root, r_hidden, r_logits)
        packed, aux, _ = self.verify(n, tokens, parents, depths)
        return self.accept_and_commit(n, packed, depths, aux)

    # ------------------------------------------------------------------ host side

    def upload(self, values: list[int]) -> torch.Tensor:
        """Ints -> a device long tensor with one asynchronous copy (a view of ``self.ctrl``)."""
        m = len(values)
        if not self.cuda:
            return torch.tensor(values, dtype=torch.long)
        self.ctrl_host.numpy()[:m] = values
        return self.ctrl[:m].copy_(self.ctrl_host[:m], non_blocking=True)

    def propose(self, n, root, r_hidden, r_logits, timer: "RoundTimer | None" = None):
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

    def commit(self, n: int, path: list[int], new: list[int], aux: torch.Tensor):
        """Make the accepted ``path`` (node indices from the root) permanent: its target K/V
        move to slots n.., the draft extends over ``new`` (accepted tokens + bonus).

        Returns (moved, next n [1], next root [1], r_hidden [1,H], r_logits [1,Vd]), all on
        the device, ready for the next ``propose``."""
        k, p = len(path), self.path_len
        # The move has the fixed length p (one graph): its pad rows copy a slot onto itself.
        ctrl = self.upload([n + k, new[-1], n, *path, *range(k, p), *new])
        n_next, root, start = ctrl[0:1], ctrl[1:2], ctrl[2:3]
        path_t, new_t = ctrl[3:3 + p], ctrl[3 + p:]
        moved = path != list(range(k))
        if moved:
            self.target.move_kv(start + path_t, start + self.path_rows)
        r_hidden, r_logits = self.draft.extend(new_t[None], aux[:, path_t[:k]], start, pad_to=p)
        return moved, n_next, root, r_hidden, r_logits


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
