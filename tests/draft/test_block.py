"""The block drafter (draft/block.py): what a block sees, its objective (train/block_loss.py),
its decode (engine/block_decode.py: tokens equal plain greedy decoding's), and that a few
hundred steps on a predictable target teach it to draft whole blocks."""

import pytest
import torch

from draftling.draft.block import BlockDraft, block_config_from_target, block_visibility
from draftling.draft.model import init_from_target
from draftling.engine.accept import process_logits
from draftling.engine.block_decode import block_generate
from draftling.engine.generate import greedy_generate
from draftling.engine.target_model import CachedTarget
from draftling.errors import ConfigError
from draftling.target.load import wrap_target
from draftling.train.block_loss import block_loss, sample_anchors
from draftling.train.teacher import teacher_forward
from tests.helpers import AUX, chi2_p_value, perm_target, sampling_target

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 4


def block_head(model, seed=0, block=BLOCK, layers=1):
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    cfg = block_config_from_target(model.config, vocab, AUX, block, layers, mask_token_id=0)
    draft = BlockDraft(cfg)
    t2d = torch.ones(vocab, dtype=torch.bool)
    draft.set_vocab(torch.zeros(vocab, dtype=torch.long), t2d)
    init_from_target(draft, model, t2d)
    return draft


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
    draft = block_head(model).eval()
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
    draft = block_head(model).eval()
    ids = torch.tensor([3, 17, 5, 9, 22, 40])
    want = greedy_generate(target, ids, 40)[0].tolist()
    got, stats = block_generate(target, draft, ids, 40)
    assert got == want and stats.verify_steps >= 1 and 1.0 <= stats.tau <= BLOCK and stats.tokens == 40


def test_the_block_config_refuses_what_cannot_draft():
    model = perm_target()
    with pytest.raises(ConfigError, match="block_size"):
        block_config_from_target(model.config, 64, AUX, 1, 1, 0)
    with pytest.raises(ConfigError, match="mask_token_id"):
        block_config_from_target(model.config, 64, AUX, 4, 1, model.config.vocab_size)


def test_training_on_a_predictable_target_drafts_whole_blocks():
    """The objective trains: slot accuracy and expected acceptance rise well above a random
    head's; decoding agrees with training on its own text (whole blocks accepted) and beats a
    random head on new prompts, and stays identical to greedy decoding throughout."""
    model = perm_target()
    target = wrap_target(model, None, aux_layer_ids=AUX)
    draft, random_head = block_head(model), block_head(model).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (64, 4), generator=g)
    engine = CachedTarget.from_hf(model, AUX, 160)
    seqs = torch.cat([ids, torch.stack([greedy_generate(engine, p, 28)[0] for p in ids])], 1)
    mask, ones = torch.ones_like(seqs), torch.ones_like(seqs)
    mask[:, :4] = 0
    batch = teacher_forward(target, seqs, ones, draft.t2d)
    embed = model.get_input_embeddings()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(200):
        out = block_loss(draft, embed, seqs, mask, ones, batch, sample_anchors(mask, 12, g))
        first = first or out
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert out.loss < 0.5 * first.loss and out.slot_acc[0] > 0.8 and out.accept_len > first.accept_len + 1.0
    draft.eval()
    seen = block_generate(engine, draft, ids[0], 28)[1]
    assert seen.tau > 3.0  # its own text: what it trained on, drafted as it trained
    fresh = torch.randint(0, model.config.vocab_size, (6, 4), generator=torch.Generator().manual_seed(7))
    taus = {}
    for name, head in (("trained", draft), ("random", random_head)):
        runs = [block_generate(engine, head, p, 40) for p in fresh]
        assert all(got == greedy_generate(engine, p, 40)[0].tolist() for (got, _), p in zip(runs, fresh))
        taus[name] = sum(s.tau for _, s in runs) / len(runs)
    assert taus["trained"] > taus["random"] + 0.2


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
