"""Decode engine: own-cache target vs HF, speculative == greedy, lossless sampling, stops.

Tiny random fp32 models on CPU. The "oracle" draft is built by hand so acceptance is high
(see ``oracle_draft``); without it every round would accept nothing and the tree/compaction
code would go untested.
"""

import math

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from draftling.engine import (
    CachedTarget,
    DraftRunner,
    SpecRound,
    UnsupportedArchitecture,
    causal_mask,
    greedy_generate,
    process_logits,
    speculative_generate,
)
from draftling.engine import accept as gen_mod
from tests.helpers import AUX, TREES, H, oracle_draft, perm_target, prompt, random_draft, runners, sampling_target, tiny
from tests.helpers import chi2_p_value as _chi2_p_value

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_caches_consistent(model, target, draft_runner, input_ids, out, stats):
    """After decoding, the committed cache prefix must equal a fresh prefill of the emitted
    text: proves compaction moved the right K/V and tree scratch never leaked in."""
    n, dev = stats.cache_len, input_ids.device
    seq = torch.cat([input_ids, out.to(dev)], dim=1)
    assert n >= input_ids.shape[1] and seq.shape[1] > n
    fresh_t, fresh_d = runners(model, draft_runner.draft, target.max_seq_len)
    pos = torch.arange(n, device=dev)
    with torch.no_grad():
        _, aux = fresh_t(seq[:, :n], pos, pos, causal_mask(0, n, target.max_seq_len, dev))
        fresh_d.extend(seq[:, 1 : n + 1], aux, 0)
    # GPU matmul/attention kernels vary with the query count (tree verify vs fresh prefill).
    tol = dict(atol=1e-4, rtol=1e-4) if dev.type == "cpu" else dict(atol=1e-3, rtol=1e-3)
    for i in range(len(target.layers)):
        for got, want in zip(target.kv(i), fresh_t.kv(i)):
            torch.testing.assert_close(got[:, :, :n], want[:, :, :n], **tol)
    torch.testing.assert_close(draft_runner.k_cache[:, :, :n], fresh_d.k_cache[:, :, :n], **tol)
    torch.testing.assert_close(draft_runner.v_cache[:, :, :n], fresh_d.v_cache[:, :, :n], **tol)


# ---------------------------------------------------------------- CachedTarget vs HF

ARCHS = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 16}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),  # q/k/v bias
    "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": 4096}),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cached_target_matches_hf(arch):
    cls, cfg_cls, kw = ARCHS[arch]
    model = tiny(cls, cfg_cls, **kw)
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        with torch.no_grad():  # HF inits biases to zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if arch == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
                layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
    size = 32
    target = CachedTarget.from_hf(model, AUX, size)
    assert target.embed.weight is model.model.embed_tokens.weight  # shared, not copied
    seq = prompt(12)
    n = 7
    with torch.no_grad():
        ref = model(seq, output_hidden_states=True)
        pos = torch.arange(n)
        logits, aux = target(seq[:, :n], pos, pos, causal_mask(0, n, size, "cpu"))
        torch.testing.assert_close(logits, ref.logits[:, :n], atol=1e-4, rtol=0)
        want_aux = torch.cat([ref.hidden_states[i][:, :n] for i in AUX], -1)
        torch.testing.assert_close(aux, want_aux, atol=1e-4, rtol=0)
        for p in range(n, 12):  # single-token decode steps
            pp = torch.tensor([p])
            logits, aux = target(seq[:, p : p + 1], pp, pp, causal_mask(p, 1, size, "cpu"))
            torch.testing.assert_close(logits[:, 0], ref.logits[:, p], atol=1e-4, rtol=0)
            torch.testing.assert_close(aux[0, 0, 2 * H :], ref.hidden_states[3][0, p], atol=1e-4, rtol=0)


def test_unsupported_architecture_is_named():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=4, n_head=2))
    with pytest.raises(UnsupportedArchitecture, match="GPT2"):
        CachedTarget.from_hf(model, AUX, 16)
    with pytest.raises(NotImplementedError):
        CachedTarget.from_hf(model, AUX, 16)


# ---------------------------------------------------------------- trees

# Reference: the engine's original eager round (per-level kernels, host ints, Python loops),
# kept here to check that the static-shape ``SpecRound`` builds the same trees.


def ref_build_tree(draft, root_token, root_hidden, root_logits, n, steps, topk, num_draft_tokens):
    """EAGLE-2 dynamic tree -> (tokens, parents, depths), each [q]."""
    d2t = draft.draft.draft_to_target
    logp = torch.log_softmax(root_logits.float(), -1)
    score, ids = logp.topk(topk)
    tok = d2t(ids)
    c_tok, c_score, c_parent, c_depth = [tok], [score], [torch.full_like(ids, -1)], [1]
    front = torch.arange(topk)
    f_tok, f_score, f_hidden = tok, score, root_hidden.expand(topk, -1)
    f_mask = (torch.arange(draft.cache_size) < n).expand(topk, -1).clone()
    n_cand, rows = topk, torch.arange(topk)
    for level in range(1, steps):
        slots = draft.spec_base + (level - 1) * topk + rows
        f_mask[rows, slots] = True
        h, logits = draft.tree_step(f_tok, f_hidden, n + level - 1, slots, f_mask)
        s, ids = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)
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
    keep = num_draft_tokens - 1
    sel = torch.sort(torch.cat(c_score), descending=True, stable=True).indices[:keep].sort().values
    depth = torch.cat([torch.full((len(t),), d) for t, d in zip(c_tok, c_depth)])
    node_of = torch.full((n_cand + 1,), -1, dtype=torch.long)
    node_of[n_cand] = 0
    node_of[sel] = torch.arange(1, keep + 1)
    cand_parent = torch.cat(c_parent)[sel]
    parents = node_of[torch.where(cand_parent < 0, n_cand, cand_parent)]
    zero = torch.zeros(1, dtype=torch.long)
    return (
        torch.cat([torch.tensor([root_token]), torch.cat(c_tok)[sel]]),
        torch.cat([zero, parents]),
        torch.cat([zero, depth[sel]]),
    )


def ref_tree_mask(parents, n, size, steps):
    q = parents.shape[0]
    eye = torch.eye(q, dtype=torch.bool)
    anc = eye
    for _ in range(steps):
        anc = eye | anc[parents]
    mask = torch.zeros(q, size, dtype=torch.bool)
    mask[:, :n] = True
    mask[:, n : n + q] = anc
    return mask


@torch.no_grad()
def ref_speculative_rounds(target, draft, input_ids, max_new_tokens, steps, topk, q):
    """The original greedy loop; returns (tokens, per-round (n, tokens, parents, depths,
    target argmax, mask))."""
    t = input_ids.shape[1]
    pos = torch.arange(t)
    logits, aux = target(input_ids, pos, pos, causal_mask(0, t, target.max_seq_len, "cpu"))
    root, n, out, rounds = int(logits[0, -1].argmax()), input_ids.shape[1], [], []
    out.append(root)
    r_hidden, r_logits = draft.extend(torch.cat([input_ids[:, 1:], torch.tensor([[root]])], 1), aux, 0)
    while len(out) < max_new_tokens:
        tokens, parents, depths = ref_build_tree(draft, root, r_hidden[0], r_logits[0], n, steps, topk, q)
        mask = ref_tree_mask(parents, n, target.max_seq_len, steps)
        logits, aux = target.fast(tokens[None], n + depths, n + torch.arange(q), mask)
        best, toks = logits[0].argmax(-1).tolist(), tokens.tolist()
        rounds.append((n, toks, parents.tolist(), depths.tolist(), best, mask))
        path, cur = [0], 0
        while nxt := next((c for c in range(1, q) if parents[c] == cur and toks[c] == best[cur]), None):
            path.append(nxt)
            cur = nxt
        new = [toks[i] for i in path[1:]] + [best[cur]]
        out += new
        k = len(path)
        path_t = torch.tensor(path)
        if path != list(range(k)):
            target.move_kv(n + path_t, n + torch.arange(k))
        r_hidden, r_logits = draft.extend(torch.tensor([new]), aux[:, path_t], n, pad_to=min(steps, q - 1) + 1)
        n += k
        root = new[-1]
    return out[:max_new_tokens], rounds


def _prefilled(model, draft, root=5):
    target, dr = runners(model, draft)
    ids = prompt()
    with torch.no_grad():
        pos = torch.arange(ids.shape[1])
        _, aux = target(ids, pos, pos, causal_mask(0, ids.shape[1], target.max_seq_len, "cpu"))
        h, lg = dr.extend(torch.cat([ids[:, 1:], torch.tensor([[root]])], 1), aux, 0)
    return target, dr, ids.shape[1], h, lg


def test_tree_is_connected_and_masked():
    model = tiny(LlamaForCausalLM, LlamaConfig)
    target, dr, n, h, lg = _prefilled(model, random_draft(model))
    n_t, root_t = torch.tensor([n]), torch.tensor([5])
    for steps, topk, q in TREES:
        rnd = SpecRound(target, dr, steps, topk, q)
        with torch.no_grad():
            # The round's device functions work on batch rows: this test has one.
            tokens, parents_t, depths_t = (t[0] for t in rnd.draft_tree(n_t, root_t, h, lg))
            mask = rnd.tree_mask(n_t, parents_t[None])[0]
            want = ref_build_tree(dr, 5, h[0], lg[0], n, steps, topk, q)
        for got, ref in zip((tokens, parents_t, depths_t), want):
            assert torch.equal(got, ref)
        assert torch.equal(mask, ref_tree_mask(parents_t, n, target.max_seq_len, steps))
        parents, depths = parents_t.tolist(), depths_t.tolist()
        assert len(parents) == q and depths[0] == 0 and tokens[0] == 5
        for i in range(1, q):
            assert 0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1 <= steps
        assert mask[:, :n].all() and not mask[:, n + q :].any()
        for i in range(q):  # sees exactly itself and its ancestors
            anc, j = {i}, i
            while j:
                j = parents[j]
                anc.add(j)
            assert {j for j in range(q) if mask[i, n + j]} == anc
        if topk == 1:  # chain: the draft's greedy path, depths 1..steps
            assert depths == list(range(q))


@pytest.mark.parametrize("steps,topk,ndt", TREES)
@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_rounds_match_reference(kind, steps, topk, ndt, monkeypatch):
    """Whole generations, round by round: same trees (nodes, order, parents, depths), masks
    and target argmax as the original eager loop, on caches that evolve over many rounds
    (random draft: short paths, many rounds; oracle: long paths and compactions)."""
    model = perm_target() if kind == "oracle" else tiny(LlamaForCausalLM, LlamaConfig)
    draft = oracle_draft(model) if kind == "oracle" else random_draft(model)
    ids, m = prompt(), 48
    want, ref_rounds = ref_speculative_rounds(*runners(model, draft), ids, m, steps, topk, ndt)
    got_rounds = []
    tree_of = SpecRound.draft_tree
    mask_of = SpecRound.tree_mask

    def draft_tree(self, n, root, h, lg):
        out = tree_of(self, n, root, h, lg)
        got_rounds.append([int(n), *[t[0].tolist() for t in out]])  # batch row 0
        return out

    def tree_mask(self, n, parents):
        mask = mask_of(self, n, parents)
        got_rounds[-1].append(mask[0])
        return mask

    monkeypatch.setattr(SpecRound, "draft_tree", draft_tree)
    monkeypatch.setattr(SpecRound, "tree_mask", tree_mask)
    target, dr = runners(model, draft)
    out, stats = speculative_generate(target, dr, ids, m, steps, topk, ndt)
    assert out[0].tolist() == want
    assert len(got_rounds) == len(ref_rounds) == stats.verify_steps > 5
    for r, (got, ref) in enumerate(zip(got_rounds, ref_rounds)):
        n, toks, parents, depths, mask = got
        assert [n, toks, parents, depths] == list(ref[:4]), r
        assert torch.equal(mask, ref[5]), r
    if kind == "oracle" and topk > 1:
        assert stats.compactions > 0
    assert_caches_consistent(model, target, dr, ids, out, stats)


def test_fused_round_is_one_static_graph():
    """The fused round traces into ONE graph (no .item()/.tolist(), data-dependent shapes or
    Python branches on tensor values: any of those is a graph break, an error here) and does
    not retrace for new n/root values: what a CUDA graph capture needs."""
    model = tiny(LlamaForCausalLM, LlamaConfig)
    target, dr, n, h, lg = _prefilled(model, random_draft(model))
    for steps, topk, q in TREES:
        rnd = SpecRound(target, dr, steps, topk, q)
        traced = torch.compile(rnd.draft_and_verify, backend="eager", fullgraph=True, dynamic=False)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            for n_i, root in ((n, 5), (n + 3, 17)):
                args = (torch.tensor([n_i]), torch.tensor([root]), h, lg)
                for got, want in zip(traced(*args), rnd.draft_and_verify(*args)):
                    assert torch.equal(got, want)
        torch._dynamo.reset()
        # The whole greedy round (accept and commit too) traces into one graph as well.
        traced = torch.compile(rnd.device_round, backend="eager", fullgraph=True, dynamic=False)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            for n_i, root in ((n, 5), (n + 3, 17)):
                traced(torch.tensor([n_i]), torch.tensor([root]), h, lg)
        torch._dynamo.reset()


def test_round_timing_cpu():
    model = perm_target()
    target, dr = runners(model, oracle_draft(model))
    ids = prompt()
    out, stats = speculative_generate(target, dr, ids, 30, 3, 4, 8)
    assert stats.timing is None and stats.as_dict()["timing"] is None
    out_t, stats_t = speculative_generate(target, dr, ids, 30, 3, 4, 8, timing=True)
    assert torch.equal(out_t, out) and stats_t.accept_lengths == stats.accept_lengths
    t = stats_t.timing
    assert t["rounds"] == stats.verify_steps
    phases = ("draft_ms", "verify_ms", "accept_ms", "commit_ms")
    assert set(t) == {*phases, "round_ms", "rounds"}
    assert all(t[p] > 0 for p in phases)
    assert t["round_ms"] == pytest.approx(sum(t[p] for p in phases))


def test_spec_round_is_cached():
    model = tiny(LlamaForCausalLM, LlamaConfig)
    target, dr = runners(model, random_draft(model))
    a = SpecRound.cached(target, dr, 3, 4, 8)
    assert SpecRound.cached(target, dr, 3, 4, 8) is a and SpecRound.cached(target, dr, 3, 1, 4) is not a


# ---------------------------------------------------------------- greedy equivalence


@pytest.mark.parametrize("steps,topk,ndt", TREES)
def test_speculative_equals_greedy_random_draft(steps, topk, ndt):
    model = tiny(LlamaForCausalLM, LlamaConfig)
    target, dr = runners(model, random_draft(model))
    ids = prompt()
    want = greedy_generate(target, ids, 40)
    assert want.shape == (1, 40)
    out, stats = speculative_generate(target, dr, ids, 40, steps, topk, ndt)
    assert torch.equal(out, want)
    assert stats.tokens == 40 and stats.verify_steps == len(stats.accept_lengths)
    assert all(1 <= a <= steps + 1 for a in stats.accept_lengths)
    assert_caches_consistent(model, target, dr, ids, out, stats)


@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_device_rounds_equal_host_rounds(kind):
    """Rounds that accept and commit on the device (queued, read back every few rounds) give
    the host-side rounds' tokens, acceptance, compactions and caches; also with an eos and
    budgets that end mid-round."""
    model = perm_target() if kind == "oracle" else tiny(LlamaForCausalLM, LlamaConfig)
    target, dr = runners(model, oracle_draft(model) if kind == "oracle" else random_draft(model))
    ids = prompt()
    full = greedy_generate(target, ids, 40)
    for steps, topk, ndt in TREES:
        host, hs = speculative_generate(target, dr, ids, 40, steps, topk, ndt, device_rounds=False)
        dev, ds = speculative_generate(target, dr, ids, 40, steps, topk, ndt, device_rounds=True)
        assert torch.equal(host, full) and torch.equal(dev, full)
        assert ds.accept_lengths == hs.accept_lengths and ds.accept_counts == hs.accept_counts
        assert (ds.compactions, ds.cache_len) == (hs.compactions, hs.cache_len)
        assert_caches_consistent(model, target, dr, ids, dev, ds)
        if kind == "oracle":
            assert ds.tau > 2
        for m in (1, 5, 11):
            assert (
                speculative_generate(target, dr, ids, m, steps, topk, ndt, device_rounds=True)[0][0].tolist()
                == full[0, :m].tolist()
            )
        eos = full[0, 17].item()
        want = full[0, : full[0].tolist().index(eos) + 1].tolist()
        out, _ = speculative_generate(target, dr, ids, 40, steps, topk, ndt, eos_ids=eos, device_rounds=True)
        assert out[0].tolist() == want


def test_speculative_equals_greedy_oracle_draft():
    model = perm_target()
    target, dr = runners(model, oracle_draft(model))
    ids = prompt()
    want = greedy_generate(target, ids, 60)
    taus = {}
    for steps, topk, ndt in TREES:
        out, stats = speculative_generate(target, dr, ids, 60, steps, topk, ndt)
        assert torch.equal(out, want), (steps, topk, ndt)
        taus[(steps, topk, ndt)] = stats.tau
        assert stats.tau > 2.0, (steps, topk, ndt, stats.as_dict())  # long paths really accepted
        assert stats.accept_counts[steps - 1] > 0  # ... down to the deepest level
        assert min(stats.accept_lengths) < steps + 1  # ... and some drafts get rejected
        if topk > 1:
            assert stats.compactions > 0
        else:
            assert stats.compactions == 0  # chain nodes sit in depth order already
        assert_caches_consistent(model, target, dr, ids, out, stats)
    # The target sometimes takes its second choice: only a tree holds that branch.
    assert taus[(3, 4, 8)] > taus[(3, 1, 4)]


# ---------------------------------------------------------------- stopping


def test_eos_and_max_new_tokens():
    model = perm_target()
    target, dr = runners(model, oracle_draft(model))
    ids = prompt()
    full = greedy_generate(target, ids, 30)[0].tolist()
    for m in (1, 2, 3, 5, 11):  # exact budget, also mid-round (tau is > 2 here)
        out, stats = speculative_generate(target, dr, ids, m, 3, 4, 8)
        assert out[0].tolist() == full[:m] and stats.tokens == m
        assert greedy_generate(target, ids, m)[0].tolist() == full[:m]
    eos = full[9]
    stop = full.index(eos) + 1
    want = full[:stop]
    assert greedy_generate(target, ids, 30, eos_ids=[eos])[0].tolist() == want
    for steps, topk, ndt in TREES:
        out, _ = speculative_generate(target, dr, ids, 30, steps, topk, ndt, eos_ids=eos)
        assert out[0].tolist() == want


def test_greedy_run_ahead_equals_step_by_step_hf():
    """greedy_generate queues RUN_AHEAD device-only steps per host read: its tokens equal
    HF greedy decoding one step at a time, for budgets that end mid-queue and an eos inside
    a queue (the steps queued after it are dropped)."""
    model = perm_target()
    target, _ = runners(model, oracle_draft(model))
    ids = prompt()
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=29, do_sample=False, pad_token_id=0)[
        0, ids.shape[1] :
    ].tolist()
    assert len(ref) == 29
    for m in (1, gen_mod.RUN_AHEAD, gen_mod.RUN_AHEAD + 3, 29):
        assert greedy_generate(target, ids, m)[0].tolist() == ref[:m]
    stop = gen_mod.RUN_AHEAD + 4  # the eos is mid-queue
    eos = ref[stop - 1]
    want = ref[: ref.index(eos) + 1]
    assert greedy_generate(target, ids, 29, eos_ids=[eos])[0].tolist() == want


# ---------------------------------------------------------------- lossless sampling


def _sample_counts(target, dr, ids, n, vocab, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    c12 = torch.zeros(vocab * vocab, dtype=torch.long)
    c23 = torch.zeros(vocab * vocab, dtype=torch.long)
    accepted = [0, 0]
    for _ in range(n):
        out, stats = speculative_generate(target, dr, ids, 3, 2, 3, 5, generator=g, **kw)
        assert out.shape == (1, 3)
        a, b, c = out[0].tolist()
        c12[a * vocab + b] += 1
        c23[b * vocab + c] += 1
        accepted = [x + y for x, y in zip(accepted, stats.accept_counts)]
    return c12, c23, accepted


def test_sampling_matches_target_distribution(monkeypatch):
    """First three sampled tokens: joint laws of (t1, t2) and (t2, t3) against exact target
    probabilities. t2 comes from depth-1 acceptance or the residual, t3 also from depth 2."""
    vocab, n = 16, 2500
    kw = dict(temperature=1.3, top_k=12, top_p=0.95)  # top-p leaves ~8 tokens: some drafts have p=0
    model = sampling_target(vocab)
    # 12 of 16 tokens: the other 4 only ever come from the residual.
    draft = oracle_draft(model, draft_vocab=12, seed=3)
    target, dr = runners(model, draft, size=24)
    ids = prompt(5, vocab=vocab)
    with torch.no_grad():  # exact laws from HF, one batched forward per depth
        p1 = process_logits(model(ids).logits[0, -1], **kw)
        grid = torch.arange(vocab)
        s2 = torch.cat([ids.expand(vocab, -1), grid[:, None]], 1)
        p2 = process_logits(model(s2).logits[:, -1], **kw)  # [a, b]
        s3 = torch.cat([s2.repeat_interleave(vocab, 0), grid.repeat(vocab)[:, None]], 1)
        p3 = process_logits(model(s3).logits[:, -1], **kw).view(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2
    joint23 = (joint12[:, :, None] * p3).sum(0)
    c12, c23, accepted = _sample_counts(target, dr, ids, n, vocab, seed=0, **kw)
    assert 0.4 * n < accepted[0] < 0.9 * n and accepted[1] > 0.1 * n  # accept, reject, depth 2
    assert _chi2_p_value(c12, joint12.flatten()) > 1e-3
    assert _chi2_p_value(c23, joint23.flatten()) > 1e-3

    # Negative control: the same check must catch a rule that forgets to renormalise.
    def lossy(logits, toks, children, temperature, top_k, top_p, generator):
        probs = process_logits(logits, temperature, top_k, top_p)
        path, cur = [0], 0
        while True:
            for c in children[cur]:
                if float(torch.rand((), generator=generator)) < float(probs[cur, toks[c]]):
                    path.append(c)
                    break
            else:
                return path, int(torch.multinomial(probs[cur], 1, generator=generator))
            cur = path[-1]

    monkeypatch.setattr(gen_mod, "_accept_sample", lossy)
    c12, _, _ = _sample_counts(target, dr, ids, 600, vocab, seed=0, **kw)
    assert _chi2_p_value(c12, joint12.flatten()) < 1e-3


# ---------------------------------------------------------------- compiled / graphed paths


def _static_paths_match(device, configs=TREES, timing=True, **mode):
    model = perm_target()
    draft = oracle_draft(model).to(device)
    model.to(device)
    ids = prompt().to(device)
    eager_t, eager_d = runners(model, draft)
    fast_t = CachedTarget.from_hf(model, AUX, 160, **mode)
    fast_d = DraftRunner(
        draft, model.get_input_embeddings(), 160, **{k: v for k, v in mode.items() if k != "query_pad"}
    )
    want = greedy_generate(eager_t, ids, 24)
    assert torch.equal(greedy_generate(fast_t, ids, 24), want)
    for steps, topk, ndt in configs:
        out_e, st_e = speculative_generate(eager_t, eager_d, ids, 24, steps, topk, ndt)
        out_f, st_f = speculative_generate(fast_t, fast_d, ids, 24, steps, topk, ndt)
        assert torch.equal(out_f.cpu(), want.cpu()) and torch.equal(out_e, out_f)
        assert st_f.accept_lengths == st_e.accept_lengths
        if not timing:
            continue
        # Timing replays drafting and verifying as two graphs: same tokens, phases measured.
        out_t, st_t = speculative_generate(fast_t, fast_d, ids, 24, steps, topk, ndt, timing=True)
        assert torch.equal(out_t, out_f) and st_t.accept_lengths == st_f.accept_lengths
        assert st_t.timing["rounds"] == st_t.verify_steps and st_t.timing["verify_ms"] > 0
    assert_caches_consistent(model, fast_t, fast_d, ids, out_f, st_f)


@pytest.mark.parametrize("device_rounds", [False, True])
def test_every_graphed_function_survives_its_capture(as_captured, device_rounds):
    """Decoding as under CUDA graphs (see the as_captured fixture): the committed caches must
    still equal a fresh prefill of the emitted text. (A commit that gathered and scattered
    overlapping slots in one function failed this on the H200, in test_cuda_graphs_match_eager's
    timing run.)"""
    model = perm_target()
    draft = oracle_draft(model)
    target, runner = runners(model, draft)
    ids = prompt()
    want, moved = greedy_generate(runners(model, draft)[0], ids, 24), 0
    for steps, topk, ndt in TREES:
        out, stats = speculative_generate(target, runner, ids, 24, steps, topk, ndt, device_rounds=device_rounds)
        assert torch.equal(out, want)
        assert_caches_consistent(model, target, runner, ids, out, stats)
        moved += stats.compactions
    assert moved > 0  # the trees moved K/V: the case that was not safe to repeat


@pytest.mark.slow  # compiles on the CPU
def test_compiled_steps_match_eager_cpu():
    """torch.compile(dynamic=False) of the target decode step and the draft tree step
    (~20 s of compiling on 2 cores; a 2-layer target keeps it short)."""
    model = tiny(LlamaForCausalLM, LlamaConfig, num_hidden_layers=2)
    size, ids = 32, prompt()
    runs = []
    for compile in (False, True):
        target = CachedTarget.from_hf(model, [1, 1, 1], size, compile=compile)
        draft = DraftRunner(random_draft(model), model.get_input_embeddings(), size, compile=compile)
        with torch.no_grad():
            pos = torch.arange(7)
            _, aux = target(ids, pos, pos, causal_mask(0, 7, size, "cpu"))  # prefill: always eager
            p = torch.tensor([7])
            logits, aux1 = target.fast(torch.tensor([[3]]), p, p, causal_mask(7, 1, size, "cpu"))
            h, _ = draft.extend(torch.cat([ids[:, 1:], torch.tensor([[3]])], 1), aux, 0)
            slots = draft.spec_base + torch.arange(4)
            mask = torch.arange(draft.cache_size)[None] < 7
            mask = mask | (torch.arange(draft.cache_size)[None] == slots[:, None])
            out = draft.tree_step(torch.tensor([1, 2, 3, 4]), h.expand(4, -1), 7, slots, mask)
        runs.append((logits, aux1, target.kv(1)[0], *out, draft.k_cache))
    for eager, compiled in zip(*runs):
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["matmul", "exact"])
def test_query_pad_and_matmul_attention_match_eager(attention):
    """Every target pass padded to 16 queries, attention as matmuls: same tokens and
    acceptance as the plain eager engine, for chain and trees, and a clean committed cache."""
    _static_paths_match("cpu", timing=False, query_pad=16, attention=attention)


def test_exact_attention_ignores_where_the_context_sits():
    """The same keys and values at scattered slots (a tree node's ancestors) or in a row
    (plain decoding) give bit-identical exact attention; both match SDPA."""
    from draftling.engine.target_model import matmul_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 16, generator=g).bfloat16()
    k = torch.randn(1, 2, 40, 16, generator=g).bfloat16()
    v = torch.randn(1, 2, 40, 16, generator=g).bfloat16()
    seen = torch.zeros(1, 40, dtype=torch.bool)
    seen[0, :25] = True
    perm = torch.randperm(40, generator=g)
    scattered = seen[:, perm]
    a = matmul_attention(q, k, v, seen, 0.25, exact=True)
    b = matmul_attention(q, k[:, :, perm], v[:, :, perm], scattered, 0.25, exact=True)
    assert torch.equal(a, b)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=seen, scale=0.25, enable_gqa=True
    )
    torch.testing.assert_close(a.float(), want, atol=1e-2, rtol=1e-2)


def test_padded_pass_equals_unpadded():
    """Pad rows change nothing in the real rows' logits, aux states or committed K/V."""
    model = tiny(LlamaForCausalLM, LlamaConfig)
    plain = CachedTarget.from_hf(model, AUX, 64)
    padded = CachedTarget.from_hf(model, AUX, 64, query_pad=8)
    ids = prompt(10)
    outs = []
    for target in (plain, padded):
        with torch.no_grad():
            pos = torch.arange(7)
            target(ids[:, :7], pos, pos, causal_mask(0, 7, 64, "cpu"))  # prefill: never padded
            pos = torch.arange(7, 10)
            outs.append(target(ids[:, 7:], pos, pos, causal_mask(7, 3, 64, "cpu")))
    for got, want in zip(outs[1], outs[0]):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for i in range(len(plain.layers)):
        for got, want in zip(padded.kv(i), plain.kv(i)):
            torch.testing.assert_close(got[:, :, :10], want[:, :, :10], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernel choice is a GPU matter")
def test_bf16_padded_speculative_equals_plain_exactly():
    """In bf16 on a GPU a different matmul kernel per query count flips near-tied argmaxes.
    With every pass padded to the same width, speculative greedy output must equal plain
    greedy bit for bit (a random draft: every round's accepted path is the root, in place)."""
    model = tiny(
        LlamaForCausalLM,
        LlamaConfig,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
    ).to("cuda", torch.bfloat16)
    draft = random_draft(model).to("cuda", torch.bfloat16)
    mode = dict(cuda_graphs=True, compile=True, attention="exact")
    target = CachedTarget.from_hf(model, AUX, 200, query_pad=16, **mode)
    runner = DraftRunner(draft, model.get_input_embeddings(), 200, **mode)
    for seed in range(4):
        ids = prompt(20, seed=seed).cuda()
        want = greedy_generate(target, ids, 96)
        for steps, topk, ndt in TREES:
            out, _ = speculative_generate(target, runner, ids, 96, steps, topk, ndt)
            assert torch.equal(out, want), (seed, steps, topk, ndt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_match_eager():
    _static_paths_match("cuda", cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compile+graphs timed on the GPU only")
def test_compile_and_cuda_graphs_match_eager():
    _static_paths_match("cuda", configs=[(3, 4, 8)], timing=False, compile=True, cuda_graphs=True)


def _block_paths_match(**mode):
    """A trained block head's rounds, chain and tree, on a graphed engine: the eager engine's
    tokens and acceptance, greedy on the device and on the host, and timed (drafting and
    verifying as two graphs)."""
    from draftling.engine.block_round import BlockRunner
    from tests.helpers import train_block_head

    model = perm_target()
    draft, ids, _, _ = train_block_head(model)
    model.cuda(), draft.cuda()
    x, k = ids[0].cuda(), draft.block_size - 1
    for tree in ((k, 1, k + 1), (3, 4, 8)):  # its chain, and a tree of its drafts
        runs = {}
        for name, opts in (("eager", {}), ("fast", mode)):
            target = CachedTarget.from_hf(model, AUX, 160, **opts)
            runner = BlockRunner(draft, target.embed, 160, **{o: v for o, v in opts.items() if o != "query_pad"})
            for extra in ({}, {"device_rounds": False}, {"timing": True}):
                runs[name, str(extra)] = speculative_generate(target, runner, x, 28, *tree, **extra)
        (out, stats), *others = runs.values()
        assert stats.tau > 2.0
        for o, s in others:
            assert torch.equal(o.cpu(), out.cpu()) and s.accept_lengths == stats.accept_lengths


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_block_rounds_match_eager():
    _block_paths_match(cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compile+graphs timed on the GPU only")
def test_compile_and_cuda_graphs_block_rounds_match_eager():
    _block_paths_match(compile=True, cuda_graphs=True)


def test_validation_chain_walk_equals_the_engines_chain_rounds(monkeypatch):
    """Validation's chain walk (teacher forcing on the greedy output) accepts what the engine's
    chain decode accepts, round by round: the walk's chain_tau is the decode's tau."""
    import types

    from draftling.target.load import wrap_target
    from draftling.train import ttt as ttt_mod
    from draftling.train.teacher import teacher_forward

    model = perm_target()
    draft = oracle_draft(model, shuffled=False)
    target, dr = runners(model, draft)
    ids = prompt()
    n = 60
    reply = greedy_generate(target, ids, n)
    _, stats = speculative_generate(target, dr, ids, n, 3, 1, 4)
    engine_rounds = [a - 1 for a in stats.accept_lengths]
    assert max(engine_rounds) == 3 and min(engine_rounds) < 3  # full rounds and misses both occur

    walks = []
    real_walk = ttt_mod.chain_walk
    monkeypatch.setattr(ttt_mod, "chain_walk", lambda c, m: walks.append(real_walk(c, m)) or walks[-1])
    seq = torch.cat([ids, reply], dim=1)
    mask = torch.ones_like(seq)
    loss_mask = torch.cat([torch.zeros_like(ids), torch.ones_like(reply)], dim=1)
    teacher_side = wrap_target(model, types.SimpleNamespace(pad_token_id=0), aux_layer_ids=AUX)
    with torch.no_grad():
        teacher = teacher_forward(teacher_side, seq, mask, draft.t2d)
        _, counts = ttt_mod.ttt_unroll(draft, model.get_input_embeddings(), teacher, seq, loss_mask, mask, 3)
    (walked,) = walks
    # The walk's last round stops at the sequence's end, the engine's at the token budget;
    # every round before those is the same.
    assert abs(len(walked) - len(engine_rounds)) <= 1
    assert walked[:-1] == engine_rounds[: len(walked) - 1]
    assert (counts.walk_rounds, counts.walk_accepted) == (len(walked), sum(walked))
    assert counts.metrics()["chain_tau"] == pytest.approx(stats.tau, abs=0.1)


def test_tree_selection_on_a_hand_worked_example():
    # A stub draft whose next-token distribution depends only on the input token, so every
    # score below is a product of table entries, worked out by hand.
    from types import SimpleNamespace

    from draftling.engine.spec_round import SpecRound

    vocab = 6
    table = {1: {3: 0.9, 4: 0.05}, 2: {5: 0.5, 3: 0.4}, 3: {4: 0.7, 5: 0.2}, 5: {0: 0.5, 1: 0.3}}

    def log_probs(p: dict) -> torch.Tensor:
        rest = (1 - sum(p.values())) / (vocab - len(p))
        return torch.tensor([math.log(p.get(t, rest)) for t in range(vocab)])

    class StubDraft:  # what SpecRound uses of a DraftRunner
        cache_size, spec_base, rounds = 32, 16, {}
        draft = SimpleNamespace(draft_to_target=lambda ids: ids + 0)  # draft ids = target ids

        def __call__(self, tokens, hidden, positions, slots, mask):  # tokens [1, k]
            return hidden, torch.stack([log_probs(table[int(t)]) for t in tokens[0]])[None]

    draft = StubDraft()
    target = SimpleNamespace(device=torch.device("cpu"), max_seq_len=32, cuda_graphs=False, batch_size=1, query_pad=0)
    rnd = SpecRound(target, draft, steps=3, topk=2, num_draft_tokens=6)
    root_logits = log_probs({1: 0.6, 2: 0.3})[None]
    n = torch.tensor([4])
    tokens, parents, depths = (t[0] for t in rnd.draft_tree(n, torch.tensor([9]), torch.zeros(1, 8), root_logits))
    # Candidates (cumulative probability): depth 1: 1 (.6), 2 (.3); depth 2, expanding both:
    # 1-3 (.54), 1-4 (.03), 2-5 (.15), 2-3 (.12); depth 3, expanding the best two, 1-3 and 2-5:
    # 1-3-4 (.378), 1-3-5 (.108), 2-5-0 (.075), 2-5-1 (.045). The best five, in expansion order:
    # 1, 2, 1-3, 2-5, 1-3-4.
    assert tokens.tolist() == [9, 1, 2, 3, 5, 4]
    assert parents.tolist() == [0, 0, 0, 1, 2, 3]
    assert depths.tolist() == [0, 1, 1, 2, 2, 3]
    # Verify's mask: the context (< n) plus each node's ancestors and itself, at slots n + node.
    mask = rnd.tree_mask(n, parents[None])[0]
    assert mask[:, :4].all() and not mask[:, 10:].any()
    ancestors = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 2, 4}, 5: {0, 1, 3, 5}}
    for node, seen in ancestors.items():
        assert {j for j in range(6) if mask[node, 4 + j]} == seen
