"""The block drafter (draft/block.py): what a block sees, its objective (train/block_loss.py),
its decode in the engine (engine/block_round.py: tokens equal plain greedy decoding's), and that a few
hundred steps on a predictable target teach it to draft whole blocks."""

import pytest
import torch

from draftling.draft.block import BlockDraft, block_config_from_target, block_visibility
from draftling.draft.model import init_from_target
from draftling.engine.accept import process_logits
from draftling.engine.block_round import BlockRunner
from draftling.engine.generate import batch_generate, greedy_generate, speculative_generate
from draftling.engine.target_model import CachedTarget
from draftling.errors import ConfigError
from draftling.target.load import wrap_target
from draftling.train.block_loss import sample_anchors
from draftling.train.teacher import teacher_forward
from tests.helpers import AUX, chi2_p_value, perm_target, random_block_draft, sampling_target, train_block_head

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 4


def block_generate(target, draft, ids, n, **options):
    """One request through the engine's block rounds: (new tokens, SpecStats)."""
    runner = BlockRunner(draft, target.embed, target.max_seq_len)
    k = draft.block_size - 1
    out, stats = speculative_generate(target, runner, ids, n, k, 1, k + 1, **options)
    return out[0].tolist(), stats


def test_a_block_sees_the_context_before_its_anchor_and_its_whole_block():
    vis = block_visibility(torch.tensor([[2, 5]]), 3, 8)[0, 0]
    assert vis.shape == (6, 8 + 6)
    assert vis[0, :8].tolist() == [True, True] + [False] * 6  # anchor 2: context 0, 1
    assert vis[3, :8].tolist() == [True] * 5 + [False] * 3  # anchor 5: context 0..4
    assert vis[1, 8:].tolist() == [True] * 3 + [False] * 3  # its own block, every slot
    assert vis[5, 8:].tolist() == [False] * 3 + [True] * 3


def test_anchors_are_positions_whose_next_token_is_trained():
    mask = torch.tensor([[0, 0, 0, 1, 1, 0, 1, 0]])
    anchors = sample_anchors(mask, 8, torch.Generator().manual_seed(0))
    assert sorted(a for a in anchors[0].tolist() if a >= 0) == [2, 3, 5]
    assert (anchors[0] == -1).sum() == 5


def test_later_context_does_not_reach_an_earlier_block():
    model = perm_target()
    draft = random_block_draft(model).eval()
    target = wrap_target(model, None, aux_layer_ids=AUX)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    other = ids.clone()
    other[0, 8:] = (other[0, 8:] + 1) % model.config.vocab_size
    ones = torch.ones_like(ids)
    losses = []
    for x in (ids, other):
        batch = teacher_forward(target, x, ones, draft.t2d)
        ctx = draft.context_kv(draft.context(batch.aux), torch.arange(12)[None])
        tokens = torch.tensor([[x[0, 5].item(), 0, 0, 0]])
        vis = block_visibility(torch.tensor([[5]]), BLOCK, 12)
        losses.append(draft.block_hidden(model.get_input_embeddings()(tokens), torch.arange(5, 9)[None], ctx, vis))
    assert torch.equal(losses[0], losses[1])  # anchor 5 reads positions 0..4 only


def test_block_decoding_equals_greedy_decoding():
    model = perm_target()
    target = CachedTarget.from_hf(model, AUX, 160)
    draft = random_block_draft(model).eval()
    ids = torch.tensor([3, 17, 5, 9, 22, 40])
    want = greedy_generate(target, ids, 40)[0].tolist()
    got, stats = block_generate(target, draft, ids, 40)
    assert got == want and stats.verify_steps >= 1 and 1.0 <= stats.tau <= BLOCK and stats.tokens == 40


def test_the_block_config_refuses_what_cannot_draft():
    model = perm_target()
    target = CachedTarget.from_hf(model, AUX, 64)
    runner = BlockRunner(random_block_draft(model), target.embed, 64)
    with pytest.raises(ConfigError, match=r"block size 4 decodes chain-3-1-4 \(block-4\) or trees of at most 3 levels"):
        speculative_generate(target, runner, torch.tensor([1, 2]), 4, 5, 2, 6)  # 5 levels: deeper than its block
    with pytest.raises(ConfigError, match="block_size"):
        block_config_from_target(model.config, 64, AUX, 1, 1, 0)
    with pytest.raises(ConfigError, match="mask_token_id"):
        block_config_from_target(model.config, 64, AUX, 4, 1, model.config.vocab_size)


def assert_context_is_fresh(model, runner, prompt, out, n):
    """The runner's context cache below the committed length ``n`` equals the context of a
    fresh prefill of the prompt and its emitted tokens."""
    seq = torch.cat([prompt, out])[None, :n]
    fresh = BlockRunner(runner.draft, runner.embed, runner.max_seq_len)
    with torch.no_grad():
        _, aux = CachedTarget.from_hf(model, AUX, runner.max_seq_len).prefill_rows(
            torch.tensor([0]), seq, torch.tensor([n])
        )
        fresh.extend_rows(torch.tensor([0]), seq, aux, torch.tensor([n]))
    for got, want in zip(runner.k_ctx + runner.v_ctx, fresh.k_ctx + fresh.v_ctx):
        torch.testing.assert_close(got[:, :, :n], want[:, :, :n], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def trained():
    """A block head trained 200 steps on a predictable target's own greedy text."""
    model = perm_target()
    draft, ids, first, out = train_block_head(model, BLOCK)
    return model, draft, ids, first, out


def test_training_on_a_predictable_target_drafts_whole_blocks(trained):
    """The objective trains: slot accuracy and expected acceptance rise well above a random
    head's; decoding agrees with training on its own text (whole blocks accepted) and beats a
    random head on new prompts, and stays identical to greedy decoding throughout."""
    model, draft, ids, first, out = trained
    random_head = random_block_draft(model).eval()
    engine = CachedTarget.from_hf(model, AUX, 160)
    embed = model.get_input_embeddings()
    assert out.loss < 0.5 * first.loss and out.slot_acc[0] > 0.8 and out.accept_len > first.accept_len + 1.0
    seen = block_generate(engine, draft, ids[0], 28)[1]
    assert seen.tau > 3.0  # its own text: what it trained on, drafted as it trained
    fresh = torch.randint(0, model.config.vocab_size, (6, 4), generator=torch.Generator().manual_seed(7))
    taus = {}
    for name, head in (("trained", draft), ("random", random_head)):
        runs = [block_generate(engine, head, p, 40) for p in fresh]
        assert all(got == greedy_generate(engine, p, 40)[0].tolist() for (got, _), p in zip(runs, fresh))
        taus[name] = sum(s.tau for _, s in runs) / len(runs)
    assert taus["trained"] > taus["random"] + 0.2
    # Three rows serving seven requests (rows refilled as requests end), accepted on the
    # device or on the host: each request's tokens and per-round acceptance as decoded alone.
    prompts = [ids[0], *fresh]
    alone = [block_generate(engine, draft, p, 40) for p in prompts]
    batched = CachedTarget.from_hf(model, AUX, 160, batch_size=3)
    runner = BlockRunner(draft, embed, 160, batch_size=3)
    for device_rounds in (True, False):
        rows = batch_generate(
            batched, prompts, 40, draft=runner, tree=(BLOCK - 1, 1, BLOCK), device_rounds=device_rounds
        )
        assert [r.tokens for r in rows] == [t for t, _ in alone]
        assert [r.stats.accept_lengths for r in rows] == [s.accept_lengths for _, s in alone]


def test_sampled_block_decoding_follows_the_targets_law():
    """The first two sampled tokens' joint law against the target's exact one: t2 comes from
    a block draft accepted with its probability, or from the residual. A rule that forgets to
    renormalise the residual fails the same check (negative control in tests/engine)."""
    vocab, n = 16, 2000
    kw = dict(temperature=1.3, top_k=12, top_p=0.95)
    model = sampling_target(vocab)
    target = CachedTarget.from_hf(model, AUX, 24)
    draft = BlockDraft(block_config_from_target(model.config, vocab, AUX, 3, 1, mask_token_id=0)).eval()
    draft.set_vocab(torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
    init_from_target(draft, model, draft.t2d)  # drafts the target's likely tokens: some accepted
    ids = torch.tensor([[3, 7, 1, 12, 5]])
    with torch.no_grad():
        p1 = process_logits(model(ids).logits[0, -1], **kw)
        s2 = torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        joint = (p1[:, None] * process_logits(model(s2).logits[:, -1], **kw)).flatten()
    g = torch.Generator().manual_seed(0)
    counts, accepted = torch.zeros(vocab * vocab, dtype=torch.long), 0
    for _ in range(n):
        out, stats = block_generate(target, draft, ids, 2, generator=g, **kw)
        counts[out[0] * vocab + out[1]] += 1
        accepted += stats.accept_counts[0]
    assert 0.05 * n < accepted < 0.95 * n  # both ways to the second token ran
    assert chi2_p_value(counts, joint) > 1e-3


def test_a_causal_block_sees_only_its_earlier_slots():
    vis = block_visibility(torch.tensor([[2]]), 3, 4, causal=True)[0, 0]
    assert vis[:, 4:].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert vis[:, :4].tolist() == [[True, True, False, False]] * 3  # the context is as before


@pytest.mark.parametrize("device_rounds", [False, True])
def test_block_rounds_survive_their_capture(as_captured, trained, device_rounds):
    """Decoding as under CUDA graphs (each static function run three times on its first
    shape): tokens equal greedy decoding's, and the drafter's context cache up to the last
    committed position equals the context of a fresh prefill of the emitted text."""
    model, draft, ids, _, _ = trained
    target = CachedTarget.from_hf(model, AUX, 160)
    runner = BlockRunner(draft, target.embed, 160)
    k = BLOCK - 1
    out, stats = speculative_generate(target, runner, ids[0], 28, k, 1, k + 1, device_rounds=device_rounds)
    assert out[0].tolist() == greedy_generate(CachedTarget.from_hf(model, AUX, 160), ids[0], 28)[0].tolist()
    assert stats.tau > 2.0
    assert_context_is_fresh(model, runner, ids[0], out[0], stats.cache_len)


@pytest.mark.parametrize("device_rounds", [False, True])
def test_block_trees_equal_greedy_decoding(as_captured, trained, device_rounds):
    """Trees of block drafts (depth-d nodes: slot d's best tokens, the best paths kept), one and
    three rows, as under CUDA graphs: greedy tokens equal plain decoding's, a wider tree accepts
    at least as much as the chain of its depth, and the drafter's context along the accepted
    paths equals a fresh prefill's."""
    model, draft, ids, _, _ = trained
    fresh = torch.randint(0, model.config.vocab_size, (4, 4), generator=torch.Generator().manual_seed(3))
    prompts = [ids[0], ids[5], *fresh]
    want = [greedy_generate(CachedTarget.from_hf(model, AUX, 160), p, 30)[0].tolist() for p in prompts]
    taus = {}
    for tree in ((3, 1, 4), (3, 4, 8), (2, 3, 7)):
        target = CachedTarget.from_hf(model, AUX, 160, batch_size=3)
        runner = BlockRunner(draft, target.embed, 160, batch_size=3)
        rows = batch_generate(target, prompts, 30, draft=runner, tree=tree, device_rounds=device_rounds)
        assert [r.tokens for r in rows] == want, tree
        taus[tree] = sum(sum(r.stats.accept_lengths) for r in rows) / sum(r.stats.verify_steps for r in rows)
    assert taus[3, 4, 8] >= taus[3, 1, 4] > 1.5
    target = CachedTarget.from_hf(model, AUX, 160)
    runner = BlockRunner(draft, target.embed, 160)
    out, stats = speculative_generate(target, runner, ids[0], 28, 3, 4, 8, device_rounds=device_rounds)
    assert_context_is_fresh(model, runner, ids[0], out[0], stats.cache_len)
