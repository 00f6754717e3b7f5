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
TRAIN_ARGS = ["train.max_steps=4", "train.batch_size=4", "train.ttt_steps=3", "train.log_every=1",
              "train.ckpt_every=2", "train.keep_checkpoints=10", "train.warmup_steps=2", "train.lr=1e-3"]


def test_rank_share_is_strided_and_never_empty():
    keys = [10, 11, 12, 13, 14]
    parts = [rank_share(keys, DistContext(r, 2))[0] for r in range(2)]
    assert parts == [[10, 12, 14], [11, 13]]
    # A short last batch: rank 1 gets a stand-in it must not learn from.
    assert rank_share([7], DistContext(1, 2)) == ([7], True)
    assert rank_share([7], DistContext(0, 2)) == ([7], False)


def test_global_denominators_make_half_batch_grads_average_to_full_batch_grads(tiny_target):
    from draftling.draft.model import Eagle3Draft, draft_config_from_target
    from draftling.data.tokenized import TokenizedExample
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
        loss, _ = ttt_unroll(draft, embed, teacher, batch["input_ids"], batch["loss_mask"],
                             batch["attention_mask"], 3, loss_denominators=denominators)
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


@pytest.fixture(scope="module")
def dp_data(tmp_path_factory, tiny_target_dir):
    from draftling.draft.vocab import build_vocab_file
    from draftling.io import write_jsonl
    from draftling.target.load import load_target_config

    data = tmp_path_factory.mktemp("dp-data")
    rows = random_batch(n=21, t=20)
    write_jsonl(data / "train.jsonl", rows[:16])
    write_jsonl(data / "val.jsonl", rows[16:])  # 5 rows: the last val batch leaves rank 1 a stand-in
    build_vocab_file(data / "train.jsonl", load_target_config(str(tiny_target_dir)).vocab_size, 64,
                     data / "vocab.safetensors")
    return data


def common(target_dir, data, run_dir):
    return ["train", "--target", str(target_dir), "--device", "cpu", "--dtype", "float32",
            "--data", str(data), "--run-dir", str(run_dir), *TRAIN_ARGS]


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
    assert_same_run(single_run, run)
    # Written once: one metrics file, checkpoints in the single-process layout.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    assert json.loads((run / "train_result.json").read_text())["world_size"] == 2


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
    assert main(["extract", "--target", str(tiny_target_dir), "--device", "cpu", "--dtype", "float32",
                 "--data", str(dp_data), "--out", str(cache), "--shard-size", "5",
                 "--logits-dtype", "float32"]) == 0
    run = tmp_path / "offline"
    out = torchrun_train(common(tiny_target_dir, dp_data, run) + ["--offline", str(cache)])
    assert "offline teacher" in out and "2 ranks (ddp)" in out
    assert_same_run(single_run, run)  # fp32 cache: the online single-process run, to fp tolerance


def test_scaling_summary_skips_warmup_window_and_computes_efficiency(tmp_path):
    from draftling.bench.ddp_scaling import summarize

    for world, rates in ((1, [10.0, 100.0, 100.0]), (2, [5.0, 180.0, 160.0])):
        run = tmp_path / f"run{world}"
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"split": "train", "tok_s": r, "step": i}) + "\n" for i, r in enumerate(rates))
            + json.dumps({"split": "val", "sim_tau": 1.5, "step": 3}) + "\n")
        (run / "train_result.json").write_text(json.dumps({"steps": 3, "train_wall_s": 1.0}))
    out = summarize({1: tmp_path / "run1", 2: tmp_path / "run2"}, "test-gpu")
    two = out["per_world_size"]["2"]
    assert out["per_world_size"]["1"]["tok_s"] == 100.0 and two["tok_s"] == 170.0
    assert two["speedup_vs_1"] == pytest.approx(1.7) and two["scaling_efficiency"] == pytest.approx(0.85)


def test_train_fixed_cost_fits_the_line_through_each_codes_step_times(tmp_path):
    """Four finished runs (before/after x 32/16 sequences): step_s = batch * mean length / tok_s,
    and the fit recovers the fixed cost and the per-sequence cost each code was built with."""
    import importlib.util

    from tests.conftest import CHECKOUT

    spec = importlib.util.spec_from_file_location("train_fixed_cost", CHECKOUT / "lab/gpu/train_fixed_cost.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    data = tmp_path / "data"
    data.mkdir()
    (data / "summary.json").write_text(json.dumps({"train_tokens": 5000, "train_sequences": 10}))  # 500 tok/seq
    truth = {"before": (0.26, 0.01), "after": (0.02, 0.01)}  # (fixed s, s per sequence)
    args = []
    for code, (fixed, per_seq) in truth.items():
        for batch in (32, 16):
            tok_s = batch * 500 / (fixed + per_seq * batch)
            run = tmp_path / f"{code}-{batch}"
            run.mkdir()
            (run / "metrics.jsonl").write_text("".join(
                json.dumps({"split": "train", "tok_s": r, "step": i}) + "\n" for i, r in enumerate([1.0, tok_s, tok_s])))
            (run / "train_result.json").write_text(json.dumps({"steps": 30, "train_wall_s": 9.0}))
            args += ["--run", f"{code}:{batch}={run}"]
    assert script.main(["--data", str(data), "--out", str(tmp_path / "out"), "--gpu", "test-gpu", *args]) == 0
    out = json.loads((tmp_path / "out" / "fixed-cost.json").read_text())
    assert out["gpu"] == "test-gpu" and out["mean_seq_tokens"] == 500.0
    assert out["fixed_cost_s_before"] == pytest.approx(0.26, abs=1e-4)
    assert out["fixed_cost_s_after"] == pytest.approx(0.02, abs=1e-4)
    assert out["per_seq_s_after"] == pytest.approx(0.01, abs=1e-5)
    ratio = (0.26 + 0.32) / (0.02 + 0.32)  # same work per sequence: the step-time ratio at 32
    assert out["tok_s_after_over_before"]["32"] == pytest.approx(ratio, abs=2e-3)
    assert len(out["points"]) == 4 and all(p["windows"] == 2 for p in out["points"])
    bound = out["two_gpu_efficiency_bound"]  # step(32) / (2 step(16)): (fixed + 32 c) / (2 fixed + 32 c)
    assert bound["before"]["32"] == pytest.approx(0.58 / 0.84, abs=2e-3)
    assert bound["after"]["32"] == pytest.approx(0.34 / 0.36, abs=2e-3) and "16" not in bound["after"]
    with pytest.raises(SystemExit, match="CODE:BATCH=DIR"):
        script.parse_run("middle:32=/x")


def test_two_gpu_results_carry_the_contract_keys_and_the_loss_differences(tmp_path):
    """1 and 2 GPUs, the 2-GPU run under FSDP and a split teacher: the top-level keys of the two-GPU
    results, the FSDP loss difference taken against DDP at every shared point, the split's
    against 1 GPU."""
    from draftling.bench.ddp_scaling import main

    def run(name, rates, losses, val_loss, peak, tau):
        d = tmp_path / name
        d.mkdir()
        rows = [{"split": "train", "tok_s": r, "step": 10 * (i + 1), "loss": l} for i, (r, l) in enumerate(zip(rates, losses))]
        rows.append({"split": "val", "step": 30, "loss": val_loss, "sim_tau": tau})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "train_result.json").write_text(json.dumps({"steps": 30, "train_wall_s": 1.0, "peak_gpu_gib": peak,
                                                         "val": {"sim_tau": tau, "chain_tau": tau - 0.01}}))
        return d

    one = run("one", [1, 100, 100], [9.0, 8.0, 7.0], 7.5, 8.0, 1.5)
    two = run("two", [1, 190, 190], [9.0, 8.0, 7.0], 7.5, 4.5, 1.5)
    fsdp = run("fsdp", [1, 170, 170], [9.0, 8.002, 7.0], 7.505, 3.0, 1.5)
    split = run("split", [1, 80, 80], [9.0, 8.0, 7.1], 7.5, 2.0, 1.49)
    fixed = tmp_path / "fixed-cost.json"
    fixed.write_text(json.dumps({"fixed_cost_s_before": 0.138, "fixed_cost_s_after": 0.055}))
    out = tmp_path / "x2.json"
    main(["--run", f"1={one}", "--run", f"2={two}", "--fsdp", str(fsdp), "--split", str(split),
          "--fixed-cost", str(fixed), "--out", str(out), "--gpu", "test-gpu"])
    res = json.loads(out.read_text())
    assert {"date", "gpu", "tok_s_1gpu", "tok_s_2gpu", "scaling_efficiency", "fixed_cost_s_before",
            "fixed_cost_s_after", "fsdp"} <= set(res)
    assert res["tok_s_2gpu"] == 190 and res["scaling_efficiency"] == pytest.approx(0.95)
    assert res["fixed_cost_s_after"] == 0.055
    f = res["fsdp"]
    assert f["tok_s_2gpu"] == 170 and f["peak_gib"] == 3.0 and f["ddp_peak_gib"] == 4.5
    assert f["max_loss_diff_vs_ddp"] == pytest.approx(0.005) and f["points_compared"] == 4
    s = res["teacher_split"]
    assert s["max_loss_diff_vs_1gpu"] == pytest.approx(0.1) and s["val_sim_tau"] == 1.49
    assert s["one_gpu_val_sim_tau"] == 1.5
    with pytest.raises(SystemExit, match="not found"):
        main(["--run", f"1={one}", "--run", f"2={two}", "--fsdp", str(tmp_path / "nope"), "--out", str(out)])
    with pytest.raises(SystemExit, match="--run 2=DIR"):
        main(["--run", f"1={one}", "--fsdp", str(fsdp), "--out", str(out)])
