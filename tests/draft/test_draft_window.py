"""Sliding-window draft attention (draft.window): training, engine and exports agree on it.

The window is the draft config's ``sliding_window`` (with ``layer_types: [sliding_attention]``):
a query at position p sees the context keys at positions p-W+1 .. p. In the TTT unroll the
query of step j at row t sits at position t+j; its own branch (the diagonal) stays visible.
"""

import json
import math
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig, LlamaForCausalLM

from draftling.config import DraftConfig, RunConfig, load_config
from draftling.draft.model import Eagle3Draft, draft_config_from_target, draft_window, repeat_kv, set_window
from draftling.draft.store import load_draft, save_draft
from draftling.engine import causal_mask, draft_runner, greedy_generate, speculative_generate
from draftling.engine.generate import batch_generate
from draftling.errors import ConfigError
from draftling.export.formats import export_sglang, load_any_draft
from draftling.export.speculators import export_speculators
from draftling.train.attention import TTTAttention, flex_usable, ttt_attention
from draftling.train.draft_setup import build_draft
from draftling.train.teacher import TeacherBatch
from draftling.train.ttt import shift_left, ttt_unroll
from draftling.train.warmstart import keep_window
from tests.helpers import TREES, V, prompt, random_draft, runners, tiny, tiny_config, tiny_llama
from tests.helpers import batch_engines as engines
from tests.helpers import batch_prompts as prompts
from tests.helpers import decode_alone as alone
from tests.helpers import spaced_vocab_draft as make_draft

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- TTT attention


def qkv(t, steps, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, t, 8, generator=g)
    ks = [torch.randn(2, 2, t, 8, generator=g) for _ in range(steps)]
    vs = [torch.randn(2, 2, t, 8, generator=g) for _ in range(steps)]
    for x in [q, *ks, *vs]:
        x.requires_grad_(grad)
    return q, ks, vs


def dense_reference(q, ks, vs, window):
    """The TTT attention with the whole [T, T] windowed mask written out."""
    t, j, n_rep = q.shape[2], len(ks) - 1, q.shape[1] // ks[0].shape[1]
    row, col = torch.arange(t)[:, None], torch.arange(t)[None]
    seen = (col <= row) & (col > row + j - window)  # row t's query sits at position t+j
    s0 = (q @ repeat_kv(ks[0], n_rep).transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~seen, -math.inf)
    diag = [(q * repeat_kv(k, n_rep)).sum(-1, keepdim=True) / math.sqrt(q.shape[-1]) for k in ks[1:]]
    p = torch.cat([s0, *diag], -1).softmax(-1)
    out = p[..., :t] @ repeat_kv(vs[0], n_rep)
    for i, v in enumerate(vs[1:]):
        out = out + p[..., t + i : t + i + 1] * repeat_kv(v, n_rep)
    return out


@pytest.mark.parametrize("t", [1, 37, 150])
@pytest.mark.parametrize("window", [1, 3, 64, 70, 200])
@pytest.mark.parametrize("steps", [1, 2, 4])
def test_banded_attention_equals_dense_masked_reference(t, window, steps):
    q, ks, vs = qkv(t, steps, seed=t + window, grad=True)
    weight = torch.randn(2, 4, t, 8)
    got = ttt_attention(q, ks, vs, window=window)
    want = dense_reference(q, ks, vs, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    inputs = [q, *ks, *vs]
    g_got = torch.autograd.grad((got * weight).sum(), inputs)
    g_want = torch.autograd.grad((want * weight).sum(), inputs)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [5, 100])
def test_a_window_past_every_query_equals_full_attention(t):
    """Step j's last query sits at position T-1+j: a window of T+j covers its whole context."""
    for steps in (1, 2, 4):
        q, ks, vs = qkv(t, steps, seed=steps)
        full = ttt_attention(q, ks, vs)
        for window in (t + steps - 1, t + 500):
            torch.testing.assert_close(ttt_attention(q, ks, vs, window=window), full, atol=1e-5, rtol=1e-5)
    q, ks, vs = qkv(t, 1)
    torch.testing.assert_close(ttt_attention(q, ks, vs, window=t), ttt_attention(q, ks, vs), atol=1e-5, rtol=1e-5)


def test_flex_mask_with_window_equals_sdpa():
    ok, why = flex_usable("cpu", training=False)
    if not ok:
        pytest.skip(why)
    for t, window, steps in [(64, 5, 1), (150, 16, 3), (130, 200, 2)]:
        q, ks, vs = qkv(t, steps, seed=window)
        with torch.no_grad():
            got = ttt_attention(q, ks, vs, "flex", window)
        torch.testing.assert_close(got, ttt_attention(q, ks, vs, window=window), atol=1e-5, rtol=1e-5)
    q, ks, vs = qkv(64, 2)
    with torch.no_grad():  # the block mask cache keys on the window: full attention is not reused
        assert not torch.allclose(ttt_attention(q, ks, vs, "flex", 4), ttt_attention(q, ks, vs, "flex"))


class LargestTensor(TorchDispatchMode):
    """The largest storage any op allocates, in forward and backward (a view of an input is
    no allocation)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in given:
                self.nbytes = max(self.nbytes, x.untyped_storage().nbytes())
        return out


def largest_tensor_of_unroll(draft, embed, t: int) -> int:
    """Forward and backward of a 3-step unroll over one t-token sample."""
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(0, 300, (1, t), generator=g)
    teacher = TeacherBatch(
        aux=torch.randn(1, t, 3 * 64, generator=g),
        draft_logits=torch.randn(1, t, 64, generator=g),
        target_argmax=torch.zeros(1, t, dtype=torch.long),
        in_draft=torch.ones(1, t, dtype=torch.bool),
    )
    ones = torch.ones_like(ids)
    with LargestTensor() as seen:
        loss, _ = ttt_unroll(draft, embed, teacher, ids, ones, ones, steps=3)
        loss.backward()
    assert torch.isfinite(loss) and draft.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0
    return seen.nbytes


def test_training_memory_on_a_32k_sample_is_bounded_and_flat_in_length():
    window = 256
    model = tiny_llama(layers=2)
    draft = make_draft(model)
    set_window(draft.config, window)
    embed = model.get_input_embeddings().requires_grad_(False)
    small, large = (largest_tensor_of_unroll(draft, embed, t) for t in (8192, 32768))
    print(f"largest tensor: {small / 2**20:.1f} MiB at 8k tokens, {large / 2**20:.1f} MiB at 32k")
    t = 32768
    assert large <= t * window * 4  # O(T*W): no tensor holds more than T*W fp32 values ...
    assert large * 100 < t * t * 4  # ... and none is near a [T, T] fp32 score matrix (4 GiB)
    assert 3 <= large / small <= 5  # linear in T (quadratic would be 16)


# ---------------------------------------------------------------- engine


def ttt_logits(draft, embed, aux, seq, steps):
    """Each TTT step's draft logits at every row: the training-time attention, windowed as the
    draft's config says."""
    attend = TTTAttention(window=draft_window(draft.config))
    hidden, pos = draft.fuse(aux), torch.arange(seq.shape[1])[None]
    out = []
    for j in range(steps):
        hidden = draft.step(embed(shift_left(seq, 1 + j)), hidden, pos + j, attend)
        out.append(draft.compute_logits(hidden)[0])
    return out


@torch.no_grad()
def engine_chain_logits(model, draft, n=30, steps=4, root=5):
    """The engine's draft over a prompt of n tokens (every row), then a greedy chain of
    ``steps - 1`` tree steps from the root. Returns (sequence drafted, prompt aux, [T,Vd]
    prompt logits, the chain's logits per level)."""
    target, dr = runners(model, draft)
    ids = prompt(n=n, seed=3)
    pos = torch.arange(n)
    _, aux = target(ids, pos, pos, causal_mask(0, n, target.max_seq_len, "cpu"))
    next_ids = torch.cat([ids[:, 1:], torch.tensor([[root]])], 1)
    hidden, logits = dr._extend(next_ids, aux, torch.zeros(1, dtype=torch.long), compiled=False)  # every row
    h, lg = hidden[:, -1], logits[:, -1]
    chain, toks = [lg[0]], [root]
    mask = (torch.arange(dr.cache_size) < n)[None].clone()
    for level in range(1, steps):
        tok = draft.draft_to_target(lg.argmax(-1))
        slot = dr.spec_base + level - 1
        mask[:, slot] = True
        h, lg = dr.tree_step(tok, h, n + level - 1, torch.tensor([slot]), mask)
        chain.append(lg[0])
        toks.append(int(tok))
    return torch.cat([ids, torch.tensor([toks])], 1), aux, logits[0], chain


@pytest.mark.parametrize("window", [4, 150])  # gathered from the cache; a mask over all of it
def test_engine_draft_logits_equal_the_windowed_training_forward(window):
    model = tiny(LlamaForCausalLM, LlamaConfig)
    draft = random_draft(model)
    set_window(draft.config, window)
    n, steps = 30, 4
    seq, aux, prompt_logits, chain = engine_chain_logits(model, draft, n, steps)
    aux = torch.cat([aux, torch.zeros(1, seq.shape[1] - n, aux.shape[-1])], 1)  # rows past n-1: unread
    with torch.no_grad():
        want = ttt_logits(draft, model.get_input_embeddings(), aux, seq, steps)
    torch.testing.assert_close(prompt_logits, want[0][:n], atol=1e-4, rtol=1e-4)
    for j in range(steps):  # the chain from the root is TTT step j at row n-1
        torch.testing.assert_close(chain[j], want[j][n - 1], atol=1e-4, rtol=1e-4)
    if window < n:  # the window really cut something
        set_window(draft.config, 0)
        full = engine_chain_logits(model, draft, n, steps)[2]
        assert not torch.allclose(full[n - 1], prompt_logits[n - 1], atol=1e-3)


def test_speculative_with_a_window_equals_greedy():
    model = tiny(LlamaForCausalLM, LlamaConfig)
    draft = random_draft(model)
    set_window(draft.config, 5)
    target, dr = runners(model, draft)
    assert dr.window == 5
    ids = prompt(n=24)
    want = greedy_generate(target, ids, 30)
    for steps, topk, ndt in TREES:
        for device_rounds in (False, True):
            out, _ = speculative_generate(target, dr, ids, 30, steps, topk, ndt, device_rounds=device_rounds)
            assert torch.equal(out, want), (steps, topk, ndt, device_rounds)


def test_engine_draft_attends_to_as_many_slots_whatever_the_cache(monkeypatch):
    """After the prompt, the draft's attention reads W + T - 1 context slots and the scratch
    per pass (T queries), the same for a cache of 160 or 400 positions: its cost does not grow
    with the context."""
    model = tiny(LlamaForCausalLM, LlamaConfig)
    draft = random_draft(model)
    set_window(draft.config, 5)
    seen = []
    real = draft_runner.draft_outputs

    def recording(draft, hidden, q, k_cache, v_cache, attn_mask, use_matmul, last=None):
        seen.append((q.shape[2], k_cache.shape[2]))
        return real(draft, hidden, q, k_cache, v_cache, attn_mask, use_matmul, last)

    monkeypatch.setattr(draft_runner, "draft_outputs", recording)
    keys = {}
    for size in (160, 400):
        seen.clear()
        target, dr = runners(model, draft, size)
        speculative_generate(target, dr, prompt(n=24), 30, 3, 4, 8)
        assert seen[0] == (24, 24)  # the prompt: its own scratch cache, as wide as the prompt
        assert all(k == 5 + t - 1 + dr.max_spec_nodes for t, k in seen[1:])
        keys[size] = sorted(set(seen))
    assert keys[160] == keys[400]


def test_batched_speculative_with_a_window_equals_alone():
    model = tiny(LlamaForCausalLM, LlamaConfig)
    draft = random_draft(model)
    set_window(draft.config, 6)
    ps = prompts()
    budgets = [20, 6, 15, 20, 2, 13, 9]
    want = alone(model, ps, budgets)
    target, runner = engines(model, draft)
    got = batch_generate(target, ps, budgets, draft=runner, tree=TREES[1])
    assert [r.tokens for r in got] == want


# ---------------------------------------------------------------- config, exports, warm start


def windowed_draft(window):
    """(a 6-layer target's config, a draft for it with ``window``)."""
    target = tiny_config(num_hidden_layers=6, max_position_embeddings=2048)
    draft = Eagle3Draft(draft_config_from_target(target, 64, [2, 3, 3], window=window))
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:64].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(64), t2d)
    return target, draft


def test_window_zero_writes_nothing_new():
    _, draft = windowed_draft(0)
    d = draft.config.to_dict()
    assert "sliding_window" not in d and "layer_types" not in d and draft_window(draft.config) == 0
    _, draft = windowed_draft(32)
    assert (draft.config.sliding_window, draft.config.layer_types) == (32, ["sliding_attention"])


def test_exports_carry_the_window_and_load_back(tmp_path):
    target, draft = windowed_draft(32)
    save_draft(draft, tmp_path)
    assert draft_window(load_draft(tmp_path).config) == 32
    sgl = export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True, target_config=target)
    cfg = json.loads((sgl / "config.json").read_text())
    assert (cfg["sliding_window"], cfg["layer_types"]) == (32, ["sliding_attention"])
    spec = export_speculators(
        draft,
        tmp_path / "spec",
        verifier_name_or_path="org/tiny",
        verifier_architectures=["LlamaForCausalLM"],
        target_config=target,
    )
    layer = json.loads((spec / "config.json").read_text())["transformer_layer_config"]
    assert (layer["sliding_window"], layer["layer_types"]) == (32, ["sliding_attention"])
    for path in (sgl, spec):
        assert draft_window(load_any_draft(path, "cpu", torch.float32).config) == 32
    _, plain = windowed_draft(0)
    out = export_speculators(
        plain,
        tmp_path / "plain",
        verifier_name_or_path="org/tiny",
        verifier_architectures=["LlamaForCausalLM"],
        target_config=target,
    )
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert "sliding_window" not in layer and "layer_types" not in layer


@pytest.mark.parametrize("value", ["-1", "1.5", "wide"])
def test_a_bad_window_is_one_config_error_naming_the_key(value):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[f"draft.window={value}"])
    assert "draft.window" in str(e.value) and "\n" not in str(e.value)
    assert load_config(overrides=["draft.window=512"]).draft.window == 512
    with pytest.raises(ConfigError, match="draft.window"):
        DraftConfig(window=-4)


def test_a_new_draft_takes_the_window_from_the_config(tiny_target):
    cfg = RunConfig()
    cfg.draft.window = 48
    t2d = torch.zeros(300, dtype=torch.bool)
    t2d[:64] = True
    vocab = types.SimpleNamespace(size=64, d2t=torch.zeros(64, dtype=torch.long), t2d=t2d)
    assert draft_window(build_draft(cfg, tiny_target, vocab).config) == 48


def test_warm_start_keeps_the_heads_window_unless_the_config_sets_one():
    _, head = windowed_draft(64)
    keep_window(head, 0, "src")
    assert draft_window(head.config) == 64
    keep_window(head, 64, "src")
    assert draft_window(head.config) == 64
    with pytest.raises(ConfigError, match="window of 64 but draft.window=128") as e:
        keep_window(head, 128, "src")
    assert "\n" not in str(e.value)
    _, full = windowed_draft(0)
    keep_window(full, 128, "src")  # a full-attention head learns a window
    assert draft_window(full.config) == 128
