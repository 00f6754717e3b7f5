"""Online trainer on a tiny target: learning happens, resume is exact, checkpoints are atomic."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftling.errors import ConfigError
from draftling.io import write_jsonl
from draftling.train.checkpoint import list_checkpoints, load_train_state
from draftling.train.trainer import train
from tests.conftest import random_batch, setup_data
from tests.helpers import cfg_for, whole_and_resumed
from tests.helpers import train_run as run


@pytest.mark.parametrize(
    "offload,cache_gb", [(False, 0), (True, 0), (False, 1)], ids=["adamw", "offloaded-adamw", "teacher-cache"]
)
def test_resume_equals_uninterrupted_run(tmp_path, tiny_target, offload, cache_gb):
    setup_data(tmp_path)
    # teacher-cache: the quickstart's hybrid mode. The cut at step 4 falls in epoch 2 (3 batches
    # an epoch), where the uninterrupted run reads the cache and the resumed one starts empty.
    opts = {"train.optimizer_offload": str(offload).lower(), "train.teacher_cache_gb": cache_gb}
    # Interrupted: stop at step 4 (max_steps=4 with the SAME schedule length would differ,
    # so simulate a kill by deleting the later checkpoints of a full run).
    whole_and_resumed(tmp_path, tiny_target, 8, 4, **opts)
    a = load_file(str(tmp_path / "full" / "draft" / "draft.safetensors"))
    b = load_file(str(tmp_path / "cut" / "draft" / "draft.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa = load_train_state(list_checkpoints(tmp_path / "full")[-1])
    sb = load_train_state(list_checkpoints(tmp_path / "cut")[-1])
    for k, v in sa["optimizer"]["state"].items():
        assert torch.equal(v["exp_avg_sq"], sb["optimizer"]["state"][k]["exp_avg_sq"])
    # The metrics log has each step once, in order, after the resume.
    steps = [
        json.loads(l)["step"]
        for l in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
        if json.loads(l)["split"] == "train"
    ]
    assert steps == list(range(1, 9))


def test_resume_restores_optimizer_not_just_weights(tmp_path, tiny_target):
    setup_data(tmp_path)
    run(tmp_path, tiny_target, "r", 4)
    state = load_train_state(list_checkpoints(tmp_path / "r")[-1])
    assert state["step"] == 4 and state["scheduler"]["last_epoch"] == 4
    assert len(state["optimizer"]["state"]) > 0 and "torch" in state["rng"]


def test_loss_goes_down_and_metrics_are_logged(tmp_path, tiny_target, capsys):
    setup_data(tmp_path, n=8)
    result = run(tmp_path, tiny_target, "fit", 30, **{"train.log_every": 5, "train.ckpt_every": 100})
    records = [json.loads(l) for l in (tmp_path / "fit" / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in records if r["split"] == "train"]
    # Soft-label loss is floored by the teacher's entropy; accuracy shows the learning.
    assert train_recs[-1]["loss"] < train_recs[0]["loss"]
    # Accuracy counts out-of-vocab positions as misses; within the vocab's reach it must climb.
    reach = [r["acc"][0] / r["vocab_coverage"] for r in (train_recs[0], train_recs[-1])]
    assert 0 < train_recs[-1]["vocab_coverage"] < 1 and reach[1] > reach[0] + 0.3
    for r in train_recs:
        assert len(r["acc"]) == 3 and len(r["cond_acc"]) == 3 and r["sim_tau"] >= 1.0
    assert records[-1]["split"] == "val" and "val" in result
    out = capsys.readouterr().out
    assert "step 30/30" in out and "sim_tau" in out and "validation" in out  # no TTY needed
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert all(" | elapsed " in line and " left" in line for line in step_lines)  # the ETA, no TTY
    assert "M trainable params (" in out and "frozen (the target's embedding included)" in out
    params = json.loads((tmp_path / "fit" / "train_result.json").read_text())["params"]
    embed = tiny_target.input_embeddings().weight.numel()
    weights = load_file(tmp_path / "fit" / "draft" / "draft.safetensors")
    assert params["trainable"] == sum(t.numel() for k, t in weights.items() if k not in ("d2t", "t2d"))  # not the maps
    assert params["frozen"] == embed and params["target"] == sum(p.numel() for p in tiny_target.model.parameters())
    assert params["share_of_target"] == pytest.approx(params["trainable"] / params["target"])
    assert (tmp_path / "fit" / "config.yaml").is_file()


def test_checkpoints_are_atomic_and_pruned(tmp_path, tiny_target):
    setup_data(tmp_path)
    run(tmp_path, tiny_target, "k", 6, **{"train.keep_checkpoints": 2})
    names = sorted(p.name for p in (tmp_path / "k" / "checkpoints").iterdir())
    assert names == ["step_0000004", "step_0000006"]  # no temporary leftovers


def test_stale_vocab_is_refused(tmp_path, tiny_target):
    setup_data(tmp_path)
    rows = random_batch(n=12, t=20, seed=5)
    write_jsonl(tmp_path / "train.jsonl", rows)  # data changed after the vocab was built
    from draftling.errors import DataError

    with pytest.raises(DataError, match="different data"):
        run(tmp_path, tiny_target, "x", 2)


def test_wall_clock_budget_stops_early_but_still_writes_the_draft(tmp_path, tiny_target, capsys):
    setup_data(tmp_path)
    result = run(tmp_path, tiny_target, "budget", 50, **{"train.max_minutes": 1e-6})
    assert result["steps"] == 1
    assert (tmp_path / "budget" / "draft" / "draft.safetensors").is_file()
    assert "train.max_minutes" in capsys.readouterr().out


def test_loss_on_prompt_trains_on_every_position_but_validates_on_replies(tmp_path, tiny_target):
    setup_data(tmp_path)
    run(tmp_path, tiny_target, "reply", 2)
    run(tmp_path, tiny_target, "all", 2, **{"train.loss_on_prompt": "true"})

    def rows(name, split):
        return [
            json.loads(l)
            for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            if json.loads(l)["split"] == split
        ]

    # The same batches: a third of each example is prompt, so far more positions carry a loss.
    assert rows("all", "train")[0]["tokens"] > 1.3 * rows("reply", "train")[0]["tokens"]
    assert rows("all", "val")[-1]["tokens"] == rows("reply", "val")[-1]["tokens"]


def test_narrower_draft_mlp_trains_saves_and_loads(tmp_path, tiny_target):
    from draftling.draft.store import load_draft
    from draftling.errors import ConfigError

    setup_data(tmp_path)
    run(tmp_path, tiny_target, "narrow", 2, **{"draft.intermediate_size": 32})
    weights = load_file(str(tmp_path / "narrow" / "draft" / "draft.safetensors"))
    assert tuple(weights["midlayer.mlp.up_proj.weight"].shape) == (32, 64)  # target's is 128
    draft = load_draft(tmp_path / "narrow" / "draft")
    assert draft.config.intermediate_size == 32
    assert torch.equal(draft.midlayer.mlp.down_proj.weight, weights["midlayer.mlp.down_proj.weight"])
    with pytest.raises(ConfigError, match="intermediate_size"):
        run(tmp_path, tiny_target, "bad", 1, **{"draft.intermediate_size": 0})


def test_length_grouped_batches_cover_the_epoch_with_less_padding():
    from draftling.data.tokenized import TokenizedExample
    from draftling.train.dataset import EpochBatches

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 400, (203,), generator=g).tolist()
    examples = [
        TokenizedExample(id=str(i), source="s", input_ids=[1] * n, loss_mask=[1] * n) for i, n in enumerate(lengths)
    ]

    def padded(batches):
        return sum(max(lengths[i] for i in b) * len(b) for b in batches)

    plain, grouped = EpochBatches(examples, 4, seed=3), EpochBatches(examples, 4, seed=3, group_by_length=True)
    for epoch in (0, 1):
        a = [plain.indices(epoch, i) for i in range(plain.batches_per_epoch)]
        b = [grouped.indices(epoch, i) for i in range(grouped.batches_per_epoch)]
        # The same examples per epoch (the shuffle's first 200), each once; only the cut differs.
        assert sorted(sum(a, [])) == sorted(sum(b, [])) and len(set(sum(b, []))) == 200
        assert padded(b) < 0.85 * padded(a)
        # Deterministic: a fresh object (a resumed run) cuts the same batches.
        again = EpochBatches(examples, 4, seed=3, group_by_length=True)
        assert [again.indices(epoch, i) for i in range(again.batches_per_epoch)] == b
    assert grouped.indices(0, 0) != grouped.indices(1, 0)


def test_a_run_dir_with_an_earlier_run_needs_resume_or_overwrite(tmp_path, tiny_target):
    from draftling.errors import ConfigError

    setup_data(tmp_path)
    run(tmp_path, tiny_target, "r", 6, **{"train.keep_checkpoints": 0})
    assert [c.name for c in list_checkpoints(tmp_path / "r")] == ["step_0000002", "step_0000004", "step_0000006"]
    # A new run there would leave the old checkpoints for a later --resume to pick up.
    with pytest.raises(ConfigError, match="--resume to continue it or --overwrite"):
        run(tmp_path, tiny_target, "r", 2)
    assert len(list_checkpoints(tmp_path / "r")) == 3  # nothing was touched
    train(
        cfg_for(2),
        tiny_target,
        tmp_path / "r",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
        overwrite=True,
    )
    assert [c.name for c in list_checkpoints(tmp_path / "r")] == ["step_0000002"]
    steps = [json.loads(l)["step"] for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2


def test_resuming_from_the_final_checkpoint_writes_one_final_validation(tmp_path, tiny_target):
    setup_data(tmp_path)
    run(tmp_path, tiny_target, "f", 4)
    run(tmp_path, tiny_target, "f", 4, resume=True)
    records = [json.loads(l) for l in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "val"] == [4]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]


def test_killed_writes_leave_nothing_that_counts_or_stays(tmp_path, tiny_target, capsys):
    setup_data(tmp_path)
    run(tmp_path, tiny_target, "k", 4)
    ckpts = tmp_path / "k" / "checkpoints"
    # What kills leave: a half-written checkpoint, a draft temporary, a half-pruned checkpoint.
    (ckpts / ".step_0000006.abc123.tmp").mkdir()
    (ckpts / ".step_0000006.abc123.tmp" / "draft.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "k" / ".draft.xyz.tmp").mkdir()
    (ckpts / "step_0000004" / "draft.safetensors").unlink()  # weights gone, state left
    assert [c.name for c in list_checkpoints(tmp_path / "k")] == ["step_0000002"]
    run(tmp_path, tiny_target, "k", 4, resume=True)
    assert "removed 2 temporaries" in capsys.readouterr().out
    leftovers = [p.name for d in (tmp_path / "k", ckpts) for p in d.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_a_damaged_newest_checkpoint_is_skipped_and_the_one_before_resumes_exactly(tmp_path, tiny_target, capsys):
    import os
    import shutil

    setup_data(tmp_path)
    run(tmp_path, tiny_target, "full", 6)
    run(tmp_path, tiny_target, "cut", 6)
    shutil.rmtree(tmp_path / "cut" / "draft")
    newest = tmp_path / "cut" / "checkpoints" / "step_0000006"
    os.truncate(newest / "train_state.pt", 100)  # `truncate -s 100`
    capsys.readouterr()
    run(tmp_path, tiny_target, "cut", 6, resume=True)
    out = capsys.readouterr().out
    assert f"skipping damaged checkpoint {newest}: train_state.pt has 100 bytes" in out
    assert "resumed from" in out and "step_0000004" in out
    a = load_file(str(tmp_path / "full" / "draft" / "draft.safetensors"))
    b = load_file(str(tmp_path / "cut" / "draft" / "draft.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_a_changed_config_is_refused_unless_the_key_is_allowed(tmp_path, tiny_target):
    from draftling.errors import ConfigError

    setup_data(tmp_path)
    run(tmp_path, tiny_target, "c", 4)
    shutil_rm = __import__("shutil").rmtree
    shutil_rm(tmp_path / "c" / "checkpoints" / "step_0000004")
    with pytest.raises(ConfigError) as e:
        run(tmp_path, tiny_target, "c", 4, resume=True, **{"train.lr": 2e-3, "train.ttt_steps": 2})
    assert "train.lr: 0.001 -> 0.002" in str(e.value) and "train.ttt_steps: 3 -> 2" in str(e.value)
    assert "lr: 0.001" in (tmp_path / "c" / "config.yaml").read_text()  # untouched
    # Allowed: applied from the resumed step on, and recorded.
    train(
        cfg_for(4, **{"train.lr": 2e-3}),
        tiny_target,
        tmp_path / "c",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
        resume=True,
        allow_change=["train.lr"],
    )
    assert "lr: 0.002" in (tmp_path / "c" / "config.yaml").read_text()
    records = [json.loads(l) for l in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 2, "split": "config_change", "changes": {"train.lr": {"from": 0.001, "to": 0.002}}} in records
    lrs = {r["step"]: r["lr"] for r in records if r["split"] == "train"}
    run(tmp_path, tiny_target, "ref", 4)
    ref = {
        json.loads(l)["step"]: json.loads(l).get("lr")
        for l in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()
    }
    assert lrs[2] == ref[2] and lrs[3] == pytest.approx(2 * ref[3])


def test_a_run_dir_that_is_a_file_is_refused(tmp_path, tiny_target):
    from draftling.errors import ConfigError

    setup_data(tmp_path)
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ConfigError, match="--run-dir .*afile: is a file"):
        run(tmp_path, tiny_target, "afile", 2)
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_resume_keeps_the_compute_dtype_its_run_measured(tmp_path, tiny_target, monkeypatch):
    """bfloat16_if_fast is a timed probe: a resume on a busy machine keeps the run's answer."""
    import shutil

    from draftling.train import settings

    setup_data(tmp_path)
    monkeypatch.setattr(settings, "bf16_matmul_is_faster", lambda device_type="cpu": True)
    opts = {"train.compute_dtype": "bfloat16_if_fast"}
    run(tmp_path, tiny_target, "full", 6, **opts)
    run(tmp_path, tiny_target, "cut", 6, **opts)
    for ckpt in list_checkpoints(tmp_path / "cut")[2:]:
        shutil.rmtree(ckpt)
    shutil.rmtree(tmp_path / "cut" / "draft")
    monkeypatch.setattr(settings, "bf16_matmul_is_faster", lambda device_type="cpu": False)
    run(tmp_path, tiny_target, "cut", 6, resume=True, **opts)
    a = load_file(str(tmp_path / "full" / "draft" / "draft.safetensors"))
    b = load_file(str(tmp_path / "cut" / "draft" / "draft.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((list_checkpoints(tmp_path / "cut")[-1] / "meta.json").read_text())
    assert meta["compute_dtype"] == "bfloat16"


def test_a_metrics_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path, tiny_target):
    setup_data(tmp_path)
    run(tmp_path, tiny_target, "m", 4)
    metrics = tmp_path / "m" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 5, "split": "tr')  # a kill mid-write
    run(tmp_path, tiny_target, "m", 4, resume=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]


def test_data_fraction_draws_from_a_nested_seeded_share(tmp_path, tiny_target):
    from draftling.data.tokenized import load_tokenized
    from draftling.train.dataset import EpochBatches, fraction_pool

    quarter, half, whole = (fraction_pool(40, f, seed=3) for f in (0.25, 0.5, 1.0))
    assert len(quarter) == 10 and len(half) == 20 and whole == list(range(40))
    assert set(quarter) <= set(half) and quarter != list(range(10))  # nested, and not the file's head
    b = EpochBatches([None] * 40, 4, seed=3, fraction=0.5)
    assert b.batches_per_epoch == 5 and {i for k in range(5) for i in b.indices(0, k)} == set(half)
    setup_data(tmp_path)
    result = run(tmp_path, tiny_target, "half", 4, **{"train.data_fraction": 0.5})
    rows = load_tokenized(tmp_path / "train.jsonl")
    pool = fraction_pool(len(rows), 0.5, seed=0)
    assert result["data"] == {
        "fraction": 0.5,
        "sequences": len(pool),
        "loss_tokens": sum(sum(rows[i].loss_mask) for i in pool),
    }
    with pytest.raises(ConfigError, match="train.data_fraction"):
        cfg_for(2, **{"train.data_fraction": 0})
