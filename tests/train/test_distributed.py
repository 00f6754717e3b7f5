"""Data-parallel training on the CPU (gloo, 2 processes under torchrun): two ranks at global
batch B end with the weights of one process at batch B, for DDP and FSDP2, and a 2-rank
checkpoint resumes on 1 rank into the uninterrupted 1-process run."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftling.cli import main
from draftling.train.distributed import DistContext, rank_share
from draftling.train.ttt import step_valid_counts, ttt_unroll
from tests.conftest import random_batch, run_draftling

STEPS = 4
TRAIN_ARGS = [
    "train.max_steps=4",
    "train.batch_size=4",
    "train.ttt_steps=3",
    "train.log_every=1",
    "train.ckpt_every=2",
    "train.keep_checkpoints=10",
    "train.warmup_steps=2",
    "train.lr=1e-3",
]


def test_rank_share_is_strided_and_never_empty():
    keys = [10, 11, 12, 13, 14]
    parts = [rank_share(keys, DistContext(r, 2))[0] for r in range(2)]
    assert parts == [[10, 12, 14], [11, 13]]
    # A short last batch: rank 1 gets a stand-in it must not learn from.
    assert rank_share([7], DistContext(1, 2)) == ([7], True)
    assert rank_share([7], DistContext(0, 2)) == ([7], False)


def test_global_denominators_make_half_batch_grads_average_to_full_batch_grads(tiny_target):
    from draftling.data.tokenized import TokenizedExample
    from draftling.draft.model import Eagle3Draft, draft_config_from_target
    from draftling.train.dataset import collate
    from draftling.train.teacher import teacher_forward

    torch.manual_seed(0)
    vocab = torch.zeros(tiny_target.config.vocab_size, dtype=torch.bool)
    vocab[:64] = True
    draft = Eagle3Draft(draft_config_from_target(tiny_target.config, 64, tiny_target.aux_layer_ids))
    draft.set_vocab(torch.zeros(64, dtype=torch.long), vocab)
    rows = [TokenizedExample(r["id"], "t", r["input_ids"], r["loss_mask"]) for r in random_batch(4, 18)]
    embed = tiny_target.input_embeddings()

    def grads(examples, denominators=None):
        batch = collate(examples, 0)
        teacher = teacher_forward(tiny_target, batch["input_ids"], batch["attention_mask"], draft.t2d)
        draft.zero_grad()
        loss, _ = ttt_unroll(
            draft,
            embed,
            teacher,
            batch["input_ids"],
            batch["loss_mask"],
            batch["attention_mask"],
            3,
            loss_denominators=denominators,
        )
        loss.backward()
        return {n: p.grad.clone() for n, p in draft.named_parameters()}, teacher, batch

    full, _, _ = grads(rows)
    halves = [rows[:1], rows[1:]]  # unequal shares, as with an odd global batch
    counts = []
    for half in halves:
        batch = collate(half, 0)
        teacher = teacher_forward(tiny_target, batch["input_ids"], batch["attention_mask"], draft.t2d)
        counts.append(step_valid_counts(batch["loss_mask"], batch["attention_mask"], teacher.in_draft, 3))
    denominators = ((counts[0] + counts[1]).double() / 2).tolist()
    g0, _, _ = grads(halves[0], denominators)
    g1, _, _ = grads(halves[1], denominators)
    for name, g in full.items():
        torch.testing.assert_close((g0[name] + g1[name]) / 2, g, atol=1e-6, rtol=1e-5, msg=name)
    # Without global denominators the halves' average is a different (wrong) gradient.
    l0, _, _ = grads(halves[0])
    l1, _, _ = grads(halves[1])
    assert not torch.allclose((l0["fc.weight"] + l1["fc.weight"]) / 2, full["fc.weight"], atol=1e-6)


def test_a_block_heads_half_batch_grads_average_to_full_batch_grads(tiny_target):
    """The dflash objective under data parallelism: each row draws its own anchors wherever it
    lands, and the global scored count as denominator makes the halves' average gradient the
    whole batch's; each half's own count gives another."""
    from draftling.data.tokenized import TokenizedExample
    from draftling.train.batches import _loss_counts
    from draftling.train.block_loss import block_unroll
    from draftling.train.dataset import collate
    from draftling.train.teacher import teacher_forward
    from tests.helpers import random_block_draft

    draft = random_block_draft(tiny_target.model, block=4).train()
    rows = [TokenizedExample(r["id"], "t", r["input_ids"], r["loss_mask"]) for r in random_batch(4, 18)]
    embed = tiny_target.input_embeddings()

    def run(examples, denominators=None):
        batch = collate(examples, 0)
        teacher = teacher_forward(tiny_target, batch["input_ids"], batch["attention_mask"], draft.t2d)
        draft.zero_grad()
        args = (batch["input_ids"], batch["loss_mask"], batch["attention_mask"])
        loss, _ = block_unroll(draft, embed, teacher, *args, loss_denominators=denominators)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        return grads, _loss_counts(draft, batch, teacher, 3)

    full, _ = run(rows)
    halves = [rows[:1], rows[1:]]
    global_count = sum(run(h)[1] for h in halves) / 2
    g0, _ = run(halves[0], global_count)
    g1, _ = run(halves[1], global_count)
    for name, g in full.items():
        torch.testing.assert_close((g0[name] + g1[name]) / 2, g, atol=1e-6, rtol=1e-5, msg=name)
    l0, _ = run(halves[0])
    l1, _ = run(halves[1])
    assert not torch.allclose((l0["fc.weight"] + l1["fc.weight"]) / 2, full["fc.weight"], atol=1e-6)


@pytest.fixture(scope="module")
def dp_data(tmp_path_factory, tiny_target_dir):
    from draftling.draft.vocab import build_vocab_file
    from draftling.io import write_jsonl
    from draftling.target.load import load_target_config

    data = tmp_path_factory.mktemp("dp-data")
    rows = random_batch(n=21, t=20)
    write_jsonl(data / "train.jsonl", rows[:16])
    write_jsonl(data / "val.jsonl", rows[16:])  # 5 rows: the last val batch leaves rank 1 a stand-in
    build_vocab_file(
        data / "train.jsonl", load_target_config(str(tiny_target_dir)).vocab_size, 64, data / "vocab.safetensors"
    )
    return data


def common(target_dir, data, run_dir):
    return [
        "train",
        "--target",
        str(target_dir),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--data",
        str(data),
        "--run-dir",
        str(run_dir),
        *TRAIN_ARGS,
    ]


def torchrun_train(args, nproc=2):
    r = run_draftling(*args, "--nproc", nproc, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, tiny_target_dir, dp_data):
    run = tmp_path_factory.mktemp("dp-runs") / "single"
    assert main(common(tiny_target_dir, dp_data, run)) == 0
    return run


def weights(run_dir):
    return load_file(str(run_dir / "draft" / "draft.safetensors"))


def metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=2e-5, rtol=1e-4, msg=k)
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for x, y in zip(ma, mb):
        assert x["tokens"] == y["tokens"]  # counts summed over ranks, not rank 0's share
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-5)
        assert x["acc"] == pytest.approx(y["acc"], abs=1e-9)


@pytest.mark.slow  # torchrun launches two processes
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(tmp_path, tiny_target_dir, dp_data, single_run, mode):
    run = tmp_path / mode
    out = torchrun_train(common(tiny_target_dir, dp_data, run) + [f"train.parallel={mode}"])
    assert f"2 ranks ({mode})" in out
    assert out.count("training draft:") == 1  # info lines from rank 0 only (logs.RankZeroFilter)
    assert_same_run(single_run, run)
    # Written once: one metrics file, checkpoints in the single-process layout.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    assert json.loads((run / "train_result.json").read_text())["world_size"] == 2


@pytest.mark.slow  # torchrun launches two processes
def test_two_ranks_match_one_process_for_a_dflash_head(tmp_path, tiny_target_dir, dp_data):
    dflash = ["draft.method=dflash", "draft.layers=1"]
    single = tmp_path / "single"
    assert main(common(tiny_target_dir, dp_data, single) + dflash) == 0
    run = tmp_path / "ddp"
    torchrun_train(common(tiny_target_dir, dp_data, run) + dflash + ["train.parallel=ddp"])
    assert_same_run(single, run)


@pytest.mark.slow  # torchrun launches two processes
def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path, tiny_target_dir, dp_data, single_run):
    run = tmp_path / "cut"
    torchrun_train(common(tiny_target_dir, dp_data, run))
    # Simulate a kill after step 2: drop the later checkpoint and the outputs.
    shutil.rmtree(run / "checkpoints" / "step_0000004")
    shutil.rmtree(run / "draft")
    assert main(common(tiny_target_dir, dp_data, run) + ["--resume"]) == 0
    assert_same_run(single_run, run)


def test_nproc_must_be_positive(tmp_path, tiny_target_dir, dp_data, capsys):
    assert main(common(tiny_target_dir, dp_data, tmp_path / "r") + ["--nproc", "0"]) == 2
    assert "--nproc 0" in capsys.readouterr().err


@pytest.mark.slow  # torchrun launches two processes
def test_two_ranks_train_from_an_offline_cache(tmp_path, tiny_target_dir, dp_data, single_run):
    cache = tmp_path / "cache"
    assert (
        main(
            [
                "extract",
                "--target",
                str(tiny_target_dir),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--data",
                str(dp_data),
                "--out",
                str(cache),
                "--shard-size",
                "5",
                "--logits-dtype",
                "float32",
            ]
        )
        == 0
    )
    run = tmp_path / "offline"
    out = torchrun_train(common(tiny_target_dir, dp_data, run) + ["--offline", str(cache)])
    assert "offline teacher" in out and "2 ranks (ddp)" in out
    assert_same_run(single_run, run)  # fp32 cache: the online single-process run, to fp tolerance
