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

from draftling.draft.model import Eagle3Draft, draft_config_from_target
from draftling.engine import (
    CachedTarget,
    DraftRunner,
    UnsupportedArchitecture,
    build_tree,
    causal_mask,
    greedy_generate,
    process_logits,
    speculative_generate,
)
from draftling.engine import generate as gen_mod
from draftling.engine.generate import tree_mask

AUX = [1, 2, 3]
V, H = 300, 64
TREES = [(3, 1, 4), (3, 4, 8), (5, 8, 16)]


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(cls, cfg_cls, seed=0, **kw):
    fields = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
    fields.update(kw)
    torch.manual_seed(seed)
    return cls(cfg_cls(**fields)).eval()


def random_draft(model, draft_vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config_from_target(model.config, draft_vocab, AUX)).eval()
    vocab = model.config.vocab_size
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(draft_vocab), t2d)  # target_id = draft_id + d2t[draft_id]
    return draft


def perm_target(beta=0.95, perturb=30.0, seed=0):
    """A target that mostly walks two fixed token maps: logits(x) peak at nxt[x] (weight 1)
    and nxt2[x] (weight beta); scaled-up layers add context so it sometimes picks the
    second one, or neither."""
    g = torch.Generator().manual_seed(seed)
    model = tiny(LlamaForCausalLM, LlamaConfig, seed=seed, num_key_value_heads=4)
    cycle = torch.randperm(V, generator=g)
    nxt = torch.empty(V, dtype=torch.long)
    nxt[cycle] = cycle.roll(-1)  # one 300-cycle: the walk does not repeat soon
    nxt2 = torch.randperm(V, generator=g)
    with torch.no_grad():
        e = torch.randn(V, H, generator=g)
        en = e / e.pow(2).mean(-1, keepdim=True).sqrt()
        model.model.embed_tokens.weight.copy_(e)
        head = torch.zeros(V, H).index_copy(0, nxt, en) + beta * torch.zeros(V, H).index_copy(0, nxt2, en)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(perturb)
            layer.mlp.down_proj.weight.mul_(perturb)
    return model


def oracle_draft(model, gamma=4.0, draft_vocab=None, seed=0):
    """A draft that predicts the target's layer-free logits for its input token.

    fc = 0, so step 0 has h = 0. q = k = gamma*(ie + hn) makes each query attend (almost)
    only to itself; v = ie - hn and o = I give out = h + ie - h/rms(h) = ie whenever h is the
    previous step's output (rms 1). So every step outputs input_layernorm(embed(token)), and
    the head (the target's rows, in a shuffled draft vocab) ranks tokens as the target's
    embedding-only path does. Needs num_key_value_heads == num_attention_heads."""
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    draft_vocab = draft_vocab or vocab
    draft = Eagle3Draft(draft_config_from_target(model.config, draft_vocab, AUX)).eval()
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 1))[:draft_vocab]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(draft_vocab), t2d)
    eye = torch.eye(hidden)
    with torch.no_grad():
        draft.fc.weight.zero_()
        attn = draft.midlayer.self_attn
        attn.q_proj.weight.copy_(gamma * torch.cat([eye, eye], 1))
        attn.k_proj.weight.copy_(gamma * torch.cat([eye, eye], 1))
        attn.v_proj.weight.copy_(torch.cat([eye, -eye], 1))
        attn.o_proj.weight.copy_(eye)
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.lm_head.weight.copy_(model.lm_head.weight[ids])
    return draft


def runners(model, draft, size=160):
    target = CachedTarget.from_hf(model, AUX, size)
    return target, DraftRunner(draft, model.get_input_embeddings(), size)


def prompt(n=7, seed=1, vocab=V):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def assert_caches_consistent(model, target, draft_runner, input_ids, out, stats):
    """After decoding, the committed cache prefix must equal a fresh prefill of the emitted
    text: proves compaction moved the right K/V and tree scratch never leaked in."""
    n = stats.cache_len
    seq = torch.cat([input_ids, out], dim=1)
    assert n >= input_ids.shape[1] and seq.shape[1] > n
    fresh_t, fresh_d = runners(model, draft_runner.draft, target.max_seq_len)
    pos = torch.arange(n)
    with torch.no_grad():
        _, aux = fresh_t(seq[:, :n], pos, pos, causal_mask(0, n, target.max_seq_len, "cpu"))
        fresh_d.extend(seq[:, 1:n + 1], aux, 0)
    for i in range(len(target.layers)):
        for got, want in zip(target.kv(i), fresh_t.kv(i)):
            torch.testing.assert_close(got[:, :, :n], want[:, :, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(draft_runner.k_cache[:, :, :n], fresh_d.k_cache[:, :, :n],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(draft_runner.v_cache[:, :, :n], fresh_d.v_cache[:, :, :n],
                               atol=1e-4, rtol=1e-4)


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
            logits, aux = target(seq[:, p:p + 1], pp, pp, causal_mask(p, 1, size, "cpu"))
            torch.testing.assert_close(logits[:, 0], ref.logits[:, p], atol=1e-4, rtol=0)
            torch.testing.assert_close(aux[0, 0, 2 * H:], ref.hidden_states[3][0, p], atol=1e-4, rtol=0)


def test_unsupported_architecture_is_named():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=4, n_head=2))
    with pytest.raises(UnsupportedArchitecture, match="GPT2"):
        CachedTarget.from_hf(model, AUX, 16)
    with pytest.raises(NotImplementedError):
        CachedTarget.from_hf(model, AUX, 16)


# ---------------------------------------------------------------- trees

def test_tree_is_connected_and_masked():
    model = tiny(LlamaForCausalLM, LlamaConfig)
    target, dr = runners(model, random_draft(model))
    ids = prompt()
    with torch.no_grad():
        pos = torch.arange(ids.shape[1])
        _, aux = target(ids, pos, pos, causal_mask(0, ids.shape[1], target.max_seq_len, "cpu"))
        h, lg = dr.extend(torch.cat([ids[:, 1:], torch.tensor([[5]])], 1), aux, 0)
    n = ids.shape[1]
    for steps, topk, q in TREES:
        tree = build_tree(dr, 5, h[0], lg[0], n, steps, topk, q)
        parents, depths = tree.parents.tolist(), tree.depths.tolist()
        assert len(parents) == q and depths[0] == 0
        for i in range(1, q):
            assert 0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1 <= steps
        mask = tree_mask(tree, n, target.max_seq_len, steps)
        assert mask[:, :n].all() and not mask[:, n + q:].any()
        for i in range(q):  # sees exactly itself and its ancestors
            anc, j = {i}, i
            while j:
                j = parents[j]
                anc.add(j)
            assert {j for j in range(q) if mask[i, n + j]} == anc
        if topk == 1:  # chain: the draft's greedy path, depths 1..steps
            assert depths == list(range(q))


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


# ---------------------------------------------------------------- lossless sampling

def _chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square against exact probabilities; cells expected < 5 pooled."""
    n = counts.sum()
    exp = probs.double() * n
    small = exp < 5
    obs = torch.cat([counts[~small].double(), counts[small].sum().double()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    try:
        from scipy.stats import chi2
        return float(chi2.sf(stat, dof))
    except ImportError:  # Wilson-Hilferty: chi2/dof is ~ normal after a cube root
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


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
    model = tiny(LlamaForCausalLM, LlamaConfig, vocab_size=vocab, hidden_size=32,
                 intermediate_size=64, num_attention_heads=4, num_key_value_heads=4)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.4)  # a spread of probabilities, not near-uniform
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

def _static_paths_match(device, **mode):
    model = perm_target()
    draft = oracle_draft(model).to(device)
    model.to(device)
    ids = prompt().to(device)
    eager_t, eager_d = runners(model, draft)
    fast_t = CachedTarget.from_hf(model, AUX, 160, **mode)
    fast_d = DraftRunner(draft, model.get_input_embeddings(), 160, **mode)
    want = greedy_generate(eager_t, ids, 24)
    assert torch.equal(greedy_generate(fast_t, ids, 24), want)
    out_e, st_e = speculative_generate(eager_t, eager_d, ids, 24, 3, 4, 8)
    out_f, st_f = speculative_generate(fast_t, fast_d, ids, 24, 3, 4, 8)
    assert torch.equal(out_f.cpu(), want.cpu()) and torch.equal(out_e, out_f)
    assert st_f.accept_lengths == st_e.accept_lengths


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_match_eager():
    _static_paths_match("cuda", cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compile+graphs timed on the GPU only")
def test_compile_and_cuda_graphs_match_eager():
    _static_paths_match("cuda", compile=True, cuda_graphs=True)
