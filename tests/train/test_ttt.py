"""The TTT unroll against a brute-force reference built position by position."""

import math

import torch
import torch.nn.functional as F

from draftling.draft.model import repeat_kv
from draftling.train.attention import TTTAttention
from draftling.train.step_counts import StepCounts
from draftling.train.teacher import teacher_forward
from draftling.train.ttt import shift_left, ttt_unroll
from tests.helpers import spaced_vocab_draft as make_draft
from tests.helpers import tiny_llama


def test_shift_left():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 2, fill=9).tolist() == [[3, 4, 9, 9]]
    assert shift_left(x, 0).tolist() == x.tolist()


def test_ttt_attention_matches_explicit_keys():
    """Step j at t must see step-0 keys at <= t plus the keys of steps 1..j at t only."""
    torch.manual_seed(0)
    b, h, kvh, t, d, steps = 2, 4, 2, 7, 8, 4
    qs = [torch.randn(b, h, t, d) for _ in range(steps)]
    ks = [torch.randn(b, kvh, t, d) for _ in range(steps)]
    vs = [torch.randn(b, kvh, t, d) for _ in range(steps)]
    attend = TTTAttention()
    outs = [attend(qs[j], ks[j], vs[j]) for j in range(steps)]
    for j in range(steps):
        for pos in range(t):
            keys = torch.cat([ks[0][:, :, : pos + 1]] + [ks[i][:, :, pos : pos + 1] for i in range(1, j + 1)], 2)
            vals = torch.cat([vs[0][:, :, : pos + 1]] + [vs[i][:, :, pos : pos + 1] for i in range(1, j + 1)], 2)
            q = qs[j][:, :, pos : pos + 1]
            ref = F.scaled_dot_product_attention(q, repeat_kv(keys, 2), repeat_kv(vals, 2))
            torch.testing.assert_close(outs[j][:, :, pos : pos + 1], ref, atol=1e-5, rtol=1e-5)


def test_unroll_alignment_matches_decode_time_chain():
    """Step j at position t must equal what the draft computes at decode time when it
    extends a chain from t with the teacher-forced tokens x_{t+1..t+1+j}."""
    model = tiny_llama()
    draft = make_draft(model)
    embed = model.get_input_embeddings()
    torch.manual_seed(3)
    ids = torch.randint(0, 300, (1, 12))
    attn = torch.ones_like(ids)
    target = type("T", (), {"model": model, "aux_layer_ids": [2, 3, 4], "output_head": lambda self: model.lm_head})()
    teacher = teacher_forward(target, ids, attn, draft.t2d)
    hiddens = []
    orig_step = draft.step

    def recording_step(*a, **k):
        out = orig_step(*a, **k)
        hiddens.append(out)
        return out

    draft.step = recording_step
    with torch.no_grad():
        ttt_unroll(draft, embed, teacher, ids, torch.ones_like(ids), attn, steps=3)
    draft.step = orig_step

    # Decode-time reference, written independently: a growing list of keys per position.
    fused = draft.fuse(teacher.aux)
    t0 = 5
    with torch.no_grad():
        keys, vals = [], []

        def attend(q, k, v):
            keys.append(k)
            vals.append(v)
            kk, vv = torch.cat(keys, 2), torch.cat(vals, 2)
            n_rep = q.shape[1] // kk.shape[1]
            # Causal within this call; earlier calls are all visible.
            qn, kn = q.shape[2], kk.shape[2]
            mask = torch.ones(qn, kn, dtype=torch.bool).tril(kn - qn)
            return F.scaled_dot_product_attention(q, repeat_kv(kk, n_rep), repeat_kv(vv, n_rep), attn_mask=mask)

        # Prefix: positions 0..t0 with target features (step 0).
        pos = torch.arange(t0 + 1)[None]
        h = draft.step(embed(ids[:, 1 : t0 + 2]), fused[:, : t0 + 1], pos, attend)
        torch.testing.assert_close(h, hiddens[0][:, : t0 + 1], atol=1e-5, rtol=1e-4)
        last = h[:, -1:]
        for j in (1, 2):
            last = draft.step(embed(ids[:, t0 + 1 + j : t0 + 2 + j]), last, torch.tensor([[t0 + j]]), attend)
            torch.testing.assert_close(last, hiddens[j][:, t0 : t0 + 1], atol=1e-5, rtol=1e-4)


def test_labels_mask_and_conditional_metrics():
    model = tiny_llama()
    draft = make_draft(model)
    ids = torch.randint(0, 300, (2, 10))
    attn = torch.ones_like(ids)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 6:] = 1  # tokens 6..9 are the reply
    target = type("T", (), {"model": model, "aux_layer_ids": [2, 3, 4], "output_head": lambda self: model.lm_head})()
    teacher = teacher_forward(target, ids, attn, draft.t2d)
    # Full-vocab argmax agrees with HF logits; draft logits are the t2d columns.
    logits = model(ids).logits
    assert torch.equal(teacher.target_argmax, logits.argmax(-1))
    torch.testing.assert_close(teacher.draft_logits, logits[..., draft.t2d], atol=1e-5, rtol=1e-5)
    loss, counts = ttt_unroll(draft, model.get_input_embeddings(), teacher, ids, loss_mask, attn, steps=3)
    assert torch.isfinite(loss)
    # Step j at t predicts x_{t+2+j}: valid where that token is a reply token and the
    # teacher's argmax at t+1+j lies in the draft vocab.
    for j in range(3):
        expect = 0
        for bi in range(2):
            for t in range(10):
                if t + 2 + j < 10 and loss_mask[bi, t + 2 + j] and teacher.in_draft[bi, t + 1 + j]:
                    expect += 1
        assert counts.valid[j] == expect
        # Accuracy is over every reply position: an out-of-vocab target argmax is a miss.
        assert counts.scored[j] == sum(
            1 for bi in range(2) for t in range(10) if t + 2 + j < 10 and loss_mask[bi, t + 2 + j]
        )
    assert sum(counts.scored) > sum(counts.valid)  # the test vocab leaves some argmaxes out
    m = counts.metrics()
    assert m["acc"] == [c / n for c, n in zip(counts.correct, counts.scored)]
    assert 1.0 <= m["sim_tau"] <= 4.0
    assert counts.chain_valid[0] == counts.scored[0]
    assert all(cv <= v for cv, v in zip(counts.chain_valid, counts.scored))


def test_step_counts_metrics():
    c = StepCounts(
        3,
        valid=[10, 10, 10],
        correct=[8, 5, 3],
        chain_valid=[10, 8, 4],
        chain_correct=[8, 4, 2],
        loss_sum=[1.0, 2.0, 3.0],
    )
    m = c.metrics()
    assert m["acc"] == [0.8, 0.5, 0.3]
    assert m["cond_acc"] == [0.8, 0.5, 0.5]
    assert math.isclose(m["sim_tau"], 1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.5)


def test_chain_walk_follows_a_chain_decode():
    from draftling.train.ttt import chain_walk

    def flags(n, right):
        correct = [[False] * n for _ in range(3)]
        for j, t in right:
            correct[j][t] = True
        return correct

    # Prompt 0..2, reply 3..11. Step j at t predicts token t+2+j; the prefill gives token 3,
    # so the first round sits at t=2.
    mask = [0, 0, 0] + [1] * 9
    # t=2: steps 0, 1 right, step 2 wrong -> 2; t=5: step 0 wrong -> 0; t=6: all right -> 3;
    # t=10 would predict token 12, past the end: no round.
    right = [(0, 2), (1, 2), (0, 6), (1, 6), (2, 6), (1, 5), (2, 5)]  # steps after a miss do not count
    assert chain_walk(flags(12, right), mask) == [2, 0, 3]

    def everything(n):
        return flags(n, [(j, t) for j in range(3) for t in range(n)])

    assert chain_walk(everything(12), mask) == [3, 3]
    # A round is cut where the reply ends: reply 3..9, t=6 can check tokens 8 and 9 only.
    assert chain_walk(everything(10), mask[:10]) == [3, 2]
    # Two replies (two runs of loss tokens): each starts its own walk.
    two = [0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert chain_walk(everything(12), two) == [3, 3]
    assert chain_walk(flags(12, [(0, 1), (1, 1)] + [(j, 7) for j in range(3)]), two) == [2, 3]
    assert chain_walk(everything(12), [0] * 12) == []
