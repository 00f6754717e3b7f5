"""The training step's fixed costs on the CPU: batches padded to a multiple (train.pad_to_multiple)
train the same weights and reuse flex block masks, and a step reads nothing back from the device
(counted with tests/host_reads.py); the counts are read once per log line, to the same metrics."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from draftling.config import RunConfig, TrainConfig, load_config
from draftling.data.tokenized import TokenizedExample
from draftling.draft.vocab import build_vocab
from draftling.train import attention, ttt
from draftling.train import batches as batches_mod
from draftling.train import teacher as teacher_mod
from draftling.train.batches import evaluate
from draftling.train.distributed import DistContext
from draftling.train.inputs import RunInputs
from draftling.train.metrics import StepWindow
from draftling.train.step_counts import StepCounts
from draftling.train.teacher import TeacherCache
from draftling.train.trainer import build_run
from draftling.train.ttt import step_row_bounds
from tests.conftest import setup_data
from tests.helpers import train_run as run
from tests.host_reads import HostReads


def examples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(2, 300, (n,), generator=g).tolist()
        rows.append(TokenizedExample(f"ex{i}", "t", ids, [0] * (n // 3) + [1] * (n - n // 3)))
    return rows


def tiny_run(target, rows, **train):
    """A TrainRun over ``rows`` as trainer.train builds it (no run directory)."""
    counts = torch.bincount(torch.tensor([t for r in rows for t in r.input_ids]), minlength=300).float()
    vocab = build_vocab(counts, 48, "t")  # leaves some target argmaxes out: spare loss rows
    tc = TrainConfig(**{"ttt_steps": 3, "batch_size": 4, "warmup_steps": 1, "log_every": 100, **train})
    torch.manual_seed(0)
    return build_run(
        RunConfig(train=tc),
        target,
        RunInputs(rows, [], vocab, None, None),
        None,
        None,
        DistContext(),
        say=lambda line: None,
    )


@pytest.mark.parametrize("cache_gb", [0, 1], ids=["online", "teacher-cache"])
def test_padding_to_a_multiple_trains_the_same_weights(tmp_path, tiny_target, one_thread, capsys, cache_gb):
    setup_data(tmp_path)  # rows of 18-20 tokens: padded to 32 (online) or 21 (cached outputs padded after)
    pads = (1, 16 if cache_gb == 0 else 7)
    for pad in pads:
        run(
            tmp_path,
            tiny_target,
            f"pad{pad}",
            5,
            **{"train.pad_to_multiple": pad, "train.ckpt_every": 100, "train.teacher_cache_gb": cache_gb},
        )
        assert f"pad_to_multiple {pad}" in capsys.readouterr().out
    a, b = (load_file(str(tmp_path / f"pad{p}" / "draft" / "draft.safetensors")) for p in pads)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)
    ma, mb = (
        [json.loads(line) for line in (tmp_path / f"pad{p}" / "metrics.jsonl").read_text().splitlines()] for p in pads
    )
    assert len(ma) == len(mb) == 6
    for x, y in zip(ma, mb):  # the padding carries no loss: the same counts, losses to float rounding
        assert (x["acc"], x["cond_acc"], x["tokens"]) == (y["acc"], y["cond_acc"], y["tokens"])
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)


def test_flex_block_masks_are_built_once_per_padded_length(tiny_target, one_thread):
    rows = examples([20, 23, 30, 31, 45, 50])  # three batches of three lengths
    run_ = tiny_run(tiny_target, rows, batch_size=2)
    results = {}
    for pad in (1, None):  # None: auto, flex's block size
        cfg = load_config(
            None,
            ["train.attention=flex", "train.ttt_steps=3", "train.batch_size=2"]
            + ([f"train.pad_to_multiple={pad}"] if pad else []),
        )
        attention._BLOCK_MASKS.clear()
        results[pad] = evaluate(run_.draft, tiny_target, rows, cfg, torch.device("cpu"), max_batches=3)
        results[pad]["masks"] = sorted(key[:2] for key in attention._BLOCK_MASKS)
    assert results[1]["masks"] == sorted((t, j) for t in (23, 31, 50) for j in (1, 2, 3))
    assert results[None]["masks"] == [(128, 1), (128, 2), (128, 3)]  # one length for all three batches
    for key in ("acc", "cond_acc", "tokens", "chain_tau"):
        assert results[None][key] == results[1][key], key
    assert results[None]["loss"] == pytest.approx(results[1]["loss"], rel=1e-5)


def test_row_bounds_from_the_host_give_the_exact_counts_and_gradients(tiny_target, one_thread):
    run_ = tiny_run(tiny_target, examples([17, 24, 30, 30]))
    batch = batches_mod.load_batch(run_.source, [0, 1, 2, 3], run_.draft.t2d)
    b = batch.tensors
    valid = ttt.step_valid_counts(b["loss_mask"], b["attention_mask"], batch.teacher.in_draft, 3).tolist()
    assert all(n > v for n, v in zip(batch.row_bounds, valid))  # spare rows in every step's chunks
    outs = []
    for bounds in (None, batch.row_bounds):
        run_.draft.zero_grad(set_to_none=True)
        loss, counts = ttt.ttt_unroll(
            run_.draft,
            tiny_target.input_embeddings(),
            batch.teacher,
            b["input_ids"],
            b["loss_mask"],
            b["attention_mask"],
            3,
            loss_chunk_tokens=5,
            row_bounds=bounds,
        )
        loss.backward()
        outs.append(
            (
                loss.detach(),
                counts.rows(),
                {n: p.grad.clone() for n, p in run_.draft.named_parameters() if p.grad is not None},
            )
        )
    (l0, c0, g0), (l1, c1, g1) = outs
    assert c1[1:] == c0[1:] and c0[1] == valid  # every count exact; the sums to float rounding
    torch.testing.assert_close(torch.tensor(c1[0]), torch.tensor(c0[0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7, msg=name)


def paused(reads, fn):
    def wrapped(*args, **kwargs):
        with reads.paused():
            return fn(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("teacher", ["online", "teacher-cache"])
def test_training_steps_read_nothing_back_until_the_log_line(tiny_target, one_thread, monkeypatch, teacher):
    run_ = tiny_run(tiny_target, examples([17, 24, 30, 30, 22, 9, 26, 30]), log_every=4)
    if teacher == "teacher-cache":
        run_.cache = TeacherCache(2**30)
    for _ in range(2):  # warm-up: the cache fills, the draft ids of t2d are found once
        run_.train_step()
    reads = HostReads(ignore=[s["step"] for s in run_.optimizer.state.values()])  # AdamW's host counters
    # Collating reads host lists by design; transformers' padding-mask check reads (left alone).
    monkeypatch.setattr(batches_mod, "host_batch", paused(reads, batches_mod.host_batch))
    monkeypatch.setattr(teacher_mod, "aux_hidden_states", paused(reads, teacher_mod.aux_hidden_states))
    window, steps, records = StepWindow(3, torch.device("cpu")), [], []
    run_.metrics_log = SimpleNamespace(write=lambda record, line=None: records.append(record))
    batches = [run_.batches.indices(*run_.batches.position(step)) for step in range(2, 6)]  # host permutations
    with reads:
        for keys in batches:
            loss, counts, tokens = run_.train_step(keys)
            window.add(counts, loss, tokens)
            steps.append((loss.detach(), counts, tokens))
        assert reads.calls == []
        run_.step = 8  # a log step with a full window of 4
        window.log(run_)
    assert reads.calls == ["tolist", "tolist"]  # the log line: the window from the device, then its host copy
    # The record as the loop made it before: each step read to the host and summed there.
    sums, loss_sum, tokens_sum = [[0] * 3 for _ in StepCounts.FIELDS], 0.0, 0
    for loss, counts, tokens in steps:
        sums = [[a + b for a, b in zip(x, y)] for x, y in zip(sums, counts.rows())]
        loss_sum, tokens_sum = loss_sum + loss.item(), tokens_sum + tokens
    expect = StepCounts(3, **dict(zip(StepCounts.FIELDS, sums))).metrics()
    expect.update(loss=loss_sum / 4, window_tokens=tokens_sum)
    assert {k: records[0][k] for k in expect} == expect


def test_step_row_bounds_count_the_scored_positions():
    loss = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    # Step j at t is scored when token t+2+j is a loss token.
    assert step_row_bounds(loss, attn, 3) == [3 + 1, 2 + 0, 1 + 0]
