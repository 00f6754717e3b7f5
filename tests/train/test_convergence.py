"""Convergence detection (train/convergence.py) and `draftling report` (train/report.py), on the CPU.

The detector is tested on synthetic tau series; the smoke bench and the stop go through the real
train loop on a tiny random target. There a learning rate of 1e-12 keeps the draft's weights
(and so its smoke tau) exactly where they start: a plateau from the first check, so the step a
run must stop at is known: the anchor is the first check after warmup, the verdict M checks later.
"""

import json
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file

from draftling import cli
from draftling.config import load_config
from draftling.errors import ConfigError, DataError
from draftling.io import read_metrics
from draftling.target.load import wrap_target
from draftling.train.checkpoint import list_checkpoints
from draftling.train.convergence import (
    ConvergenceDetector,
    SmokeBench,
    SmokeCheck,
    epoch_phrase,
    load_smoke_prompts,
    paired_change,
)
from draftling.train.trainer import train
from tests.conftest import TINY_VOCAB, setup_data
from tests.helpers import tiny_llama

PROMPTS = 14  # as set:smoke-v1


# ----------------------------------------------------------------------------- the detector


def series(means, jitter=0.05, seed=0, start=10, every=10):
    """Smoke checks whose per-prompt taus are ``mean`` plus fixed prompt offsets plus noise of
    size ``jitter`` that changes from check to check."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.linspace(-0.5, 0.5, PROMPTS)
    out = []
    for i, m in enumerate(means):
        taus = (m + offsets + jitter * torch.randn(PROMPTS, generator=g)).tolist()
        step = start + i * every
        out.append(SmokeCheck(step, step / 100, {f"p{k}": t for k, t in enumerate(taus)}, {}))
    return out


def first_verdict(checks, m=3, min_step=0):
    det = ConvergenceDetector(m, min_step)
    for c in checks:
        if det.add(c):
            return det.verdict
    return None


def test_a_rising_tau_never_converges():
    assert first_verdict(series([1.2 + 0.1 * i for i in range(12)])) is None
    # A step per check mostly inside the band of that check, but it adds up against the anchor.
    checks = series([1.2 + 0.035 * i for i in range(12)], jitter=0.05)
    steps = [paired_change(a, b) for a, b in zip(checks, checks[1:])]
    assert sum(abs(d) < band for d, band in steps) > len(steps) / 2
    assert first_verdict(checks) is None


def test_a_plateau_converges_at_the_check_where_it_has_stayed_flat_for_m_checks():
    means = [1.2, 1.5, 1.8, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    v = first_verdict(series(means, jitter=0.03))
    assert v is not None and v["since_step"] == 40 and v["step"] == 70  # anchor: 4th check; 3 more
    assert first_verdict(series(means, jitter=0.03), m=2)["step"] == 60
    # Exactly flat (every prompt's change 0): inside a band of 0.
    assert first_verdict(series([1.5] * 4, jitter=0.0))["step"] == 40


def test_the_noise_band_comes_from_the_per_prompt_scatter():
    quiet, noisy = series([1.5, 1.6], jitter=0.02), series([1.5, 1.6], jitter=0.3, seed=1)
    (_, quiet_band), (_, noisy_band) = paired_change(*quiet), paired_change(*noisy)
    assert noisy_band > 5 * quiet_band > 0
    # The same small step up, against the same wide spread between prompts: the quiet series is
    # still rising, the noisy one cannot tell that step from its scatter.
    means = [1.5, 1.55, 1.6, 1.65]
    assert first_verdict(series(means, jitter=0.005)) is None
    assert first_verdict(series(means, jitter=0.4, seed=3)) is not None


def test_an_anchor_in_warmup_does_not_count_and_phrases_read_right():
    flat = series([1.5] * 5, jitter=0.0)  # steps 10..50
    assert first_verdict(flat, min_step=20)["since_step"] == 20
    assert first_verdict(flat[:4], min_step=20) is None
    assert epoch_phrase(8 / 3) == "67% of epoch 3" and epoch_phrase(2.0) == "100% of epoch 2"
    assert epoch_phrase(0.25) == "25% of epoch 1"


def test_a_plateau_at_the_floor_is_not_convergence():
    """tau near 1 at every check: the draft accepts (next to) nothing, which is a broken run,
    not a done one."""
    assert first_verdict(series([1.0] * 8, jitter=0.0)) is None
    assert first_verdict(series([1.08] * 8, jitter=0.0)) is None
    assert first_verdict(series([1.2] * 8, jitter=0.0))["since_step"] == 10


def test_smoke_v1_is_the_first_two_prompts_of_each_v1_workload():
    from draftling.data.sources import prompt_sets_dir

    v1 = [json.loads(line) for line in (prompt_sets_dir() / "v1.jsonl").read_text().splitlines() if line]
    taken: dict = {}
    want = [r for r in v1 if taken.setdefault(r["workload"], []).append(r) or len(taken[r["workload"]]) <= 2]
    smoke = [json.loads(line) for line in (prompt_sets_dir() / "smoke-v1.jsonl").read_text().splitlines() if line]
    assert smoke == want and len(smoke) == 14


def test_the_batched_smoke_bench_measures_each_prompt_as_batch_1_decodes_it():
    """The smoke bench decodes its prompts together (more than its rows, so rows are reused);
    each prompt's tau equals batch-1 speculative decoding's with the same draft (fp32, an
    accepting oracle draft, prompts of different lengths)."""
    from draftling.data.prompt_sets import BenchPrompt
    from draftling.engine import DraftRunner, build_target, speculative_generate
    from draftling.train import convergence
    from tests.helpers import AUX, V, oracle_draft, perm_target

    model = perm_target()
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=1, get_vocab=lambda: {})
    target = wrap_target(model, tokenizer, aux_layer_ids=AUX)
    g = torch.Generator().manual_seed(3)
    prompts = [BenchPrompt(f"p{i}", "w", torch.randint(3, V, (5 + 3 * i,), generator=g).tolist()) for i in range(7)]
    draft = oracle_draft(model)
    taus = SmokeBench(target, prompts, 20, "t", rows=4).measure(draft)
    engine = build_target(model, AUX, 128)
    runner = DraftRunner(draft, model.get_input_embeddings(), 128)
    alone = {}
    for p in prompts:
        _, stats = speculative_generate(
            engine, runner, torch.tensor([p.input_ids]), 20, *convergence.SMOKE_TREE, eos_ids=target.stop_token_ids()
        )
        alone[p.id] = stats.tau
    assert taus == pytest.approx(alone, abs=1e-9)
    assert max(taus.values()) > 1.5  # the oracle accepts: a tau of 1 everywhere would prove nothing


def test_smoke_prompts_read_as_the_release_bench_reads_prompt_sets(tmp_path):
    from tests.helpers import ToyChatTokenizer as _ToyTokenizer
    from tests.helpers import V

    # The shipped set by either syntax, through the chat template, its sha256 checked on the way.
    prompts = load_smoke_prompts("set:smoke-v1", _ToyTokenizer(), V)
    assert [(p.id, p.input_ids) for p in prompts] == [
        (p.id, p.input_ids) for p in load_smoke_prompts("smoke-v1", _ToyTokenizer(), V)
    ]
    assert len(prompts) == PROMPTS and len({p.workload for p in prompts}) == 7
    # A file may mix message records and pre-tokenized rows; an id given twice is refused by file.
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        json.dumps({"id": "a", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]})
        + "\n"
        + json.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"}]})
        + "\n"
    )
    assert [p.input_ids for p in load_smoke_prompts(str(mixed), _ToyTokenizer(), V)][0] == [5]
    mixed.write_text(mixed.read_text() + json.dumps({"id": "a", "input_ids": [5]}) + "\n")
    with pytest.raises(DataError, match=r"mixed\.jsonl: duplicate prompt ids \['a'\]"):
        load_smoke_prompts(str(mixed), _ToyTokenizer(), V)


# ----------------------------------------------------------------------------- through the train loop


@pytest.fixture
def smoke_target(one_thread):
    """conftest's tiny_target, its stub tokenizer with a get_vocab for the smoke bench."""
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=1, get_vocab=lambda: {})
    return wrap_target(tiny_llama(), tokenizer, name="tiny-llama")


@pytest.fixture
def data(tmp_path):
    setup_data(tmp_path)  # 12 train rows: 3 batches of 4 an epoch
    g = torch.Generator().manual_seed(1)
    rows = [
        {
            "id": f"p{i}",
            "workload": ("prose", "code")[i % 2],
            "input_ids": torch.randint(3, TINY_VOCAB, (10 + i,), generator=g).tolist(),
        }
        for i in range(4)
    ]
    (tmp_path / "smoke.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def config(data, steps=20, draft=None, **extra):
    over = {
        "max_steps": steps,
        "batch_size": 4,
        "ttt_steps": 3,
        "log_every": 1,
        "ckpt_every": 2,
        "warmup_steps": 2,
        "lr": 1e-12,
        "keep_checkpoints": 10,
        "smoke_every": 2,
        "smoke_prompts": str(data / "smoke.jsonl"),
        "smoke_max_new_tokens": 12,
        "stop_on_convergence": "true",
        "smoke_max_share": 0,
        **extra,
    }
    draft_keys = [f"draft.{k}={v}" for k, v in (draft or {}).items()]
    return load_config(None, [f"train.{k}={v}" for k, v in over.items()] + draft_keys)


def run(data, target, name, cfg, resume=False):
    return train(
        cfg, target, data / name, data / "train.jsonl", data / "val.jsonl", data / "vocab.safetensors", resume=resume
    )


def records(run_dir, split):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("split") == split]


@pytest.fixture
def plateau(monkeypatch):
    """Every smoke check measures the same taus, above the floor (the tiny draft's own are 1:
    at lr 1e-12 it accepts nothing)."""
    monkeypatch.setattr(SmokeBench, "measure", lambda self, draft: {f"p{k}": 1.5 + 0.1 * k for k in range(4)})


def test_a_draft_that_accepts_nothing_never_converges(data, smoke_target):
    """The tiny draft at lr 1e-12: a flat smoke tau at the floor, chance matches only."""
    result = run(data, smoke_target, "r", config(data, steps=10))
    assert all(r["mean_tau"] < 1.1 and r["delta"] in (None, 0.0) for r in records(data / "r", "smoke"))
    assert result["steps"] == 10 and result["stop_reason"] == "completed"
    assert result["convergence"] == {"converged": False, "checks_run": 5, "checks": 3}


def test_a_flat_smoke_tau_stops_the_run_with_the_head_and_the_verdict(data, smoke_target, plateau, capsys):
    result = run(data, smoke_target, "r", config(data))
    # Checks at 2, 4, 6, 8: the anchor is step 2 (warmup ends there), three flat checks later.
    assert result["steps"] == 8 and result["stop_reason"] == "converged"
    assert result["convergence"]["step"] == 8 and result["convergence"]["since_step"] == 2
    assert (data / "r" / "draft" / "draft.safetensors").is_file()
    assert json.loads((data / "r" / "train_result.json").read_text())["convergence"]["converged"]
    assert "converged at 67% of epoch 3 (step 8)" in capsys.readouterr().out
    smoke = records(data / "r", "smoke")
    assert [r["step"] for r in smoke] == [2, 4, 6, 8] and set(smoke[0]["tau"]) == {"prose", "code"}
    assert len(smoke[0]["per_prompt"]) == 4 and smoke[1]["delta"] == 0.0
    assert [r["step"] for r in records(data / "r", "convergence")] == [8]


def test_without_the_stop_flag_a_run_only_logs_the_verdict(data, smoke_target, plateau):
    result = run(data, smoke_target, "r", config(data, steps=10, stop_on_convergence="false"))
    assert result["steps"] == 10 and result["stop_reason"] == "completed" and result["convergence"]["step"] == 8


def scripted(monkeypatch, means):
    """SmokeBench.measure returns per-prompt taus of mean ``means[i]`` at its i-th call."""
    calls = iter(series(means, jitter=0.02))

    def measure(self, draft):
        return next(calls).taus

    monkeypatch.setattr(SmokeBench, "measure", measure)


def test_a_rise_then_a_plateau_stops_where_the_plateau_has_lasted_m_checks(data, smoke_target, monkeypatch):
    scripted(monkeypatch, [1.2, 1.5, 1.8, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    result = run(data, smoke_target, "r", config(data))
    assert result["steps"] == 14 and result["convergence"]["since_step"] == 8
    scripted(monkeypatch, [1.2 + 0.1 * i for i in range(10)])
    result = run(data, smoke_target, "rising", config(data))
    assert result["steps"] == 20 and result["stop_reason"] == "completed"
    assert result["convergence"] == {"converged": False, "checks_run": 10, "checks": 3}


def test_a_smoke_bench_over_its_share_of_training_time_checks_less_often(
    data, smoke_target, plateau, monkeypatch, capsys
):
    import time

    measure = SmokeBench.measure

    def slow(self, draft):  # far over 5% of two tiny training steps
        time.sleep(0.4)
        return measure(self, draft)

    monkeypatch.setattr(SmokeBench, "measure", slow)
    result = run(data, smoke_target, "r", config(data, steps=10, smoke_max_share=0.05, stop_on_convergence="false"))
    # The first check (at 2) is not judged: it pays one-off compile costs. The second sets the pace.
    assert result["steps"] == 10 and [r["step"] for r in records(data / "r", "smoke")] == [2, 4]
    (paced,) = records(data / "r", "smoke_interval")
    assert paced["step"] == 4 and paced["every"] > 10 and paced["every"] % 2 == 0 and paced["share"] > 0.05
    assert paced["check_s"] >= 0.4 and paced["max_share"] == 0.05
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("smoke bench: a check took"))
    assert f"over train.smoke_max_share=0.05: checking every {paced['every']} steps from here" in line


def test_smoke_checks_do_not_change_training(data, smoke_target):
    # A real learning rate: the weights move, and must move the same with and without the checks.
    run(data, smoke_target, "with", config(data, steps=6, lr=1e-3, stop_on_convergence="false"))
    run(data, smoke_target, "without", config(data, steps=6, lr=1e-3, smoke_every=0, stop_on_convergence="false"))
    a = load_file(str(data / "with" / "draft" / "draft.safetensors"))
    b = load_file(str(data / "without" / "draft" / "draft.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert records(data / "with", "smoke") and not records(data / "without", "smoke")


def test_a_resumed_run_converges_where_the_uninterrupted_one_did(data, smoke_target, plateau):
    run(data, smoke_target, "full", config(data))
    run(data, smoke_target, "cut", config(data))
    for ckpt in list_checkpoints(data / "cut"):  # a kill after step 5: checkpoints 2 and 4 remain
        if int(ckpt.name.split("_")[1]) > 4:
            shutil.rmtree(ckpt)
    shutil.rmtree(data / "cut" / "draft")
    (data / "cut" / "train_result.json").unlink()
    result = run(data, smoke_target, "cut", config(data), resume=True)
    # Losing the checks of steps 2 and 4 would put the anchor at 6 and the verdict at 12.
    assert result["steps"] == 8 and result["convergence"]["since_step"] == 2
    assert result["segment_from_step"] == 4  # its wall time is the resumed segment's
    assert [r["step"] for r in records(data / "cut", "smoke")] == [2, 4, 6, 8]
    assert [r["step"] for r in records(data / "cut", "convergence")] == [8]
    a = load_file(str(data / "full" / "draft" / "draft.safetensors"))
    b = load_file(str(data / "cut" / "draft" / "draft.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Resuming the finished run again: it had converged at its checkpoint, so it stops there.
    assert run(data, smoke_target, "cut", config(data), resume=True)["steps"] == 8
    assert [r["step"] for r in records(data / "cut", "convergence")] == [8]  # replayed, not logged again
    assert [r["segment"] for r in records(data / "cut", "train")] == [0] * 4 + [4] * 4  # then a stop at once


def test_report_writes_markdown_and_plots_with_the_verdict_and_segments(data, smoke_target, plateau, capsys):
    run(data, smoke_target, "r", config(data))
    for ckpt in list_checkpoints(data / "r")[2:]:
        shutil.rmtree(ckpt)
    run(data, smoke_target, "r", config(data), resume=True)
    assert cli.main(["report", str(data / "r")]) == 0
    md = (data / "r" / "report" / "report.md").read_text()
    assert "converged at 67% of epoch 3 (step 8)" in md and "Stopped after 8 steps: converged" in md
    for png in ("loss.png", "accuracy.png", "smoke_tau.png"):
        assert (data / "r" / "report" / png).read_bytes()[:4] == b"\x89PNG" and f"({png})" in md
    segment_rows = [
        line for line in md.split("## Segments")[1].splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")
    ]
    assert len(segment_rows) == 2 and "| 1 | 1-4 | new run |" in segment_rows[0]
    assert "| 2 | 5-8 | resume from step 4 |" in segment_rows[1]
    assert cli.main(["report", str(data / "r"), "--out", str(data / "elsewhere")]) == 0
    assert (data / "elsewhere" / "report.md").is_file()


def test_report_on_a_bad_run_dir_is_one_line_naming_it(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(tmp_path / "nope") in err and "no such run directory" in err
    (tmp_path / "empty").mkdir()
    assert cli.main(["report", str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_smoke_settings_are_checked_when_the_config_loads(data, smoke_target):
    with pytest.raises(ConfigError, match="stop_on_convergence needs the smoke bench"):
        load_config(None, ["train.stop_on_convergence=true"])
    with pytest.raises(ConfigError, match="smoke_every"):
        load_config(None, ["train.smoke_every=-1"])
    with pytest.raises(ConfigError, match="smoke_rows"):
        load_config(None, ["train.smoke_rows=0"])
    with pytest.raises(ConfigError, match=r"train.smoke_max_share=1.5: expected a number in \[0, 1\)"):
        load_config(None, ["train.smoke_max_share=1.5"])
    args = cli.build_parser().parse_args(
        ["train", "--data", "d", "--run-dir", "r", "--stop-on-convergence", "train.smoke_every=5"]
    )
    assert cli.run_config(args, ("stop_on_convergence",)).train.stop_on_convergence
    (data / "one.jsonl").write_text(json.dumps({"input_ids": [5, 6]}) + "\n")
    with pytest.raises(ConfigError, match="at least 2"):
        load_smoke_prompts(str(data / "one.jsonl"), None, TINY_VOCAB)
    with pytest.raises(ConfigError, match="no such prompt file"):
        run(data, smoke_target, "r", config(data, smoke_prompts=str(data / "missing.jsonl")))
    assert not (data / "r").exists()  # refused before the run directory was touched


def test_a_dflash_head_is_smoke_benched_on_its_block_chain(data, smoke_target):
    """The smoke bench decodes a block drafter's one chain (block 4 from ttt_steps 3) at each
    check, per prompt and per workload, where an EAGLE-3 runner would refuse the head."""
    cfg = config(data, steps=4, stop_on_convergence="false", draft={"method": "dflash", "layers": 1})
    result = run(data, smoke_target, "r", cfg)
    smoke = records(data / "r", "smoke")
    assert result["steps"] == 4 and [r["step"] for r in smoke] == [2, 4]
    assert len(smoke[0]["per_prompt"]) == 4 and all(t >= 1.0 for t in smoke[0]["per_prompt"].values())
