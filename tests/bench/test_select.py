"""`draftling select`: loss shortlists, served speed decides, the report says why."""

import json
import types

import pytest
import torch

from draftling.bench import select
from draftling.bench.select import SelectOptions, select_checkpoint
from draftling.cli import build_parser
from draftling.io import write_jsonl
from draftling.target.load import wrap_target
from draftling.train.trainer import train
from tests.conftest import random_batch, setup_data
from tests.helpers import cfg_for, oracle_draft, perm_target, random_draft, tiny_draft_dir, tiny_llama


def prompt_set(path):
    rows = random_batch(n=4, t=12, seed=9)
    write_jsonl(
        path, [{"id": f"p{i}", "workload": "held-out", "input_ids": r["input_ids"][:6]} for i, r in enumerate(rows)]
    )
    return path


def test_selection_picks_the_fastest_not_the_lowest_loss(tmp_path, tiny_target):
    tiny_target.tokenizer.get_vocab = dict  # the stub tokenizer: no end-of-turn token beyond eos
    setup_data(tmp_path)
    train(
        cfg_for(6, **{"train.ckpt_every": 2, "train.keep_checkpoints": 0}),
        tiny_target,
        tmp_path / "run",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
    )
    opts = SelectOptions(
        prompts=str(prompt_set(tmp_path / "held.jsonl")),
        data=str(tmp_path),
        shortlist=3,
        config="chain-3-1-4",
        concurrency=2,
        max_new_tokens=6,
        base=str(tmp_path / "run"),
    )  # a run: its final head
    losses = {
        c: select.val_loss(
            tiny_target,
            tmp_path / "run" / "checkpoints" / c,
            select.load_config(tmp_path / "run" / "config.yaml"),
            select.load_tokenized(tmp_path / "val.jsonl"),
        )
        for c in ("step_0000002", "step_0000004", "step_0000006")
    }
    lowest = min(losses, key=losses.get)
    real = select.measure_head(
        tiny_target, select.load_any_draft(tmp_path / "run" / "draft", "cpu", torch.float32), [[5, 6, 7]], opts
    )
    assert real["tok_s"] > 0 and real["identical"] == 1.0 and real["tau"] >= 1.0  # the real measurement runs
    assert real["plain_tok_s"] > 0 and abs(real["speedup"] - real["tok_s"] / real["plain_tok_s"]) < 1e-9

    def measure(target, draft, ids, o):  # served speed made to disagree with the loss ranking
        slow = (
            draft.fc.weight.sum().item()
            == select.load_any_draft(tmp_path / "run" / "checkpoints" / lowest, "cpu", torch.float32)
            .fc.weight.sum()
            .item()
        )
        return {"tok_s": 10.0 if slow else 20.0 + draft.fc.weight.abs().sum().item() % 1, "tau": 1.5, "identical": 1.0}

    report = select_checkpoint(tiny_target, tmp_path / "run", opts, measure=measure)
    sel = report["selection"]
    assert [c["checkpoint"] for c in sel["candidates"]] == sorted(losses, key=losses.get)
    assert sel["winner"] != lowest and "the lowest-loss " + lowest in sel["reason"]
    on_disk = json.loads((tmp_path / "run" / "selection" / "selection.json").read_text())
    assert set(on_disk) >= {"date", "selection", "adaptation"} and on_disk["protocol"]["max_prompt_tokens"] == 6
    assert on_disk["protocol"]["prompts"] == "held.jsonl"  # the file's name and hash, not the path
    assert set(on_disk["adaptation"]) == {"workload", "prompts", "base", "adapted"}
    assert set(on_disk["selection"]["candidates"][0]) >= {"checkpoint", "val_loss", "tau", "tok_s"}
    assert "**(winner)**" in (tmp_path / "run" / "selection" / "selection.md").read_text()


# ------------------------------------------------- repeats, spread and ties (a fake measure)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny target and a trained run with checkpoints at steps 2, 4 and 6, its data beside it."""
    tmp = tmp_path_factory.mktemp("select")
    target = wrap_target(tiny_llama(), types.SimpleNamespace(pad_token_id=0, eos_token_id=1), name="tiny-llama")
    target.tokenizer.get_vocab = dict
    setup_data(tmp)
    cfg = cfg_for(6, **{"train.ckpt_every": 2, "train.keep_checkpoints": 0})
    train(cfg, target, tmp / "run", tmp / "train.jsonl", tmp / "val.jsonl", tmp / "vocab.safetensors")
    prompt_set(tmp / "held.jsonl")
    tiny_draft_dir(target, tmp / "base", seed=5)  # another head, for --base
    return target, tmp


def fake_measure(tmp, figures: dict[str, list[float]], calls: list[str]):
    """tok/s ``figures[name][i]`` on the i-th call for the head saved as ``name`` (or "base");
    each call's head name goes to ``calls``."""
    heads = {c.name: c for c in (tmp / "run" / "checkpoints").iterdir()} | {"base": tmp / "base"}
    sums = {select.load_any_draft(p, "cpu", torch.float32).fc.weight.sum().item(): n for n, p in heads.items()}

    def measure(target, draft, ids, o):
        name = sums[draft.fc.weight.sum().item()]
        tok_s = figures[name][sum(c == name for c in calls)]
        calls.append(name)
        return {"tok_s": tok_s, "tau": 1.5, "identical": 1.0, "requests": len(ids)}

    return measure


def select_with(run, figures, calls, **opts):
    target, tmp = run
    o = SelectOptions(prompts=str(tmp / "held.jsonl"), data=str(tmp), max_new_tokens=6, out=str(tmp / "sel"), **opts)
    return select_checkpoint(target, tmp / "run", o, measure=fake_measure(tmp, figures, calls))


def test_a_clear_winner_ships_and_the_report_shows_each_run(run):
    figures = {"step_0000002": [20, 22, 21], "step_0000004": [30, 32, 31], "step_0000006": [10, 11, 12]}
    report = select_with(run, figures, calls := [])
    sel, proto = report["selection"], report["protocol"]
    assert sel["winner"] == "step_0000004" and sel["decision"]["tie"] is False and sel["decision"]["tied"] == []
    assert (
        "clear of the runner-up" in sel["decision"]["why"] and "step_0000002's fastest (22.0" in sel["decision"]["why"]
    )
    row = next(r for r in sel["candidates"] if r["checkpoint"] == "step_0000004")
    assert row["tok_s_runs"] == [30, 32, 31] and (row["tok_s_min"], row["tok_s_max"]) == (30, 32)
    assert row["tok_s_median"] == row["tok_s"] == 31 and row["step"] == 4 and row["tau"] == 1.5
    # SelectOptions' defaults: concurrency 16, 3 repeats; the 4 prompts repeat to fill the 16 rows
    assert (proto["concurrency"], proto["repeats"], proto["n"], proto["requests"]) == (16, 3, 4, 16)
    assert len(calls) == 9 and report["caveats"][0].startswith(
        "Concurrency 16: each run decodes 16 requests (4 held-out prompts, repeated in turn to fill the rows)"
    )
    assert report["caveats"][1].startswith("Repeats 3: each candidate ran 3 times")
    assert any("min-max" in c for c in report["caveats"]) and any("Device: cpu" in c for c in report["caveats"])
    md = (run[1] / "sel" / "selection.md").read_text()
    assert "| step_0000004 **(winner)** |" in md and "30.0-32.0 | 30.0 / 32.0 / 31.0 |" in md
    assert "Decision: no tie" in md and "(tied)" not in md


def test_overlapping_spreads_are_a_tie_and_the_earlier_checkpoint_ships(run):
    # step 6 is fastest by median (30) but step 4's range (27-30.5) overlaps its (29-31); step 2's does not
    figures = {"step_0000002": [10, 11, 12], "step_0000004": [28, 30.5, 27], "step_0000006": [30, 29, 31]}
    report = select_with(run, figures, [])
    sel = report["selection"]
    d = sel["decision"]
    assert d["tie"] is True and d["fastest"] == "step_0000006" and sel["winner"] == d["winner"] == "step_0000004"
    assert d["tied"] == ["step_0000006", "step_0000004"] and "earliest checkpoint, step_0000004, ships" in d["why"]
    assert sel["reason"] == d["why"]
    md = (run[1] / "sel" / "selection.md").read_text()
    assert "| step_0000004 **(winner)** (tied) |" in md and "| step_0000006 (tied) |" in md and "a tie" in md


def test_a_tie_needs_overlap_only_one_way_round():
    # the runner-up's median inside the fastest's range, the fastest's outside the runner-up's
    rows = [
        {"checkpoint": "step_0000002", "step": 2, "tok_s_median": 28.0, "tok_s_min": 27.5, "tok_s_max": 28.5},
        {"checkpoint": "step_0000004", "step": 4, "tok_s_median": 30.0, "tok_s_min": 25.0, "tok_s_max": 31.0},
    ]
    assert select.decide(rows)["winner"] == "step_0000002" and select.decide(rows)["tie"]
    rows[0]["tok_s_max"] = 24.9  # now clear
    assert select.decide(rows)["winner"] == "step_0000004" and not select.decide(rows)["tie"]


def test_repeats_go_in_turns_across_candidates_and_the_base(run):
    figures = {"step_0000002": [1, 2], "step_0000004": [3, 4], "step_0000006": [5, 6], "base": [1, 1]}
    report = select_with(run, figures, calls := [], repeats=2, concurrency=2, base=str(run[1] / "base"))
    order = [c["checkpoint"] for c in report["selection"]["candidates"]]  # lowest loss first
    assert calls == [*order, "base", *order, "base"]
    assert report["adaptation"]["base"]["tok_s"] == 1 and report["adaptation"]["adapted"]["tok_s"] == 5.5
    assert report["protocol"]["requests"] == 4  # 4 prompts fill 2 rows without repeating


def test_the_head_meter_builds_one_engine_and_warms_each_head_once(as_captured):
    model = perm_target()
    target = wrap_target(model, types.SimpleNamespace(pad_token_id=0, eos_token_id=1, get_vocab=dict), name="perm")
    drafts = [oracle_draft(model), random_draft(model, seed=1)]  # one that is accepted, one that is not
    opts = SelectOptions(prompts="-", data="-", config="chain-3-1-4", concurrency=2, max_new_tokens=8)
    meter, ids = select.HeadMeter(), select.fill_rows([[5, 6, 7]], 2)
    runs = [meter(target, d, ids, opts) for _ in range(2) for d in drafts]
    assert len(meter.engines) == 1 and len(meter.runners) == 2 and ids == [[5, 6, 7], [5, 6, 7]]
    assert all(r["tok_s"] > 0 and r["identical"] == 1.0 and r["requests"] == 2 for r in runs)
    assert runs[0]["tau"] == runs[2]["tau"] > runs[1]["tau"] == runs[3]["tau"]  # greedy: the same each run
    for i, d in enumerate(drafts):  # on an engine of its own: the same figures
        alone = select.measure_head(target, d, ids, opts)
        assert (alone["tau"], alone["identical"]) == (runs[i]["tau"], runs[i]["identical"])


def test_the_cli_defaults_are_a_serving_load_and_three_repeats():
    args = build_parser().parse_args(["select", "RUN", "--data", "D", "--prompts", "P"])
    assert (args.select_concurrency, args.repeats) == (16, 3)
    assert (SelectOptions("P", "D").concurrency, SelectOptions("P", "D").repeats) == (16, 3)
    help_text = build_parser()._subparsers._group_actions[0].choices["select"].format_help()
    assert "(default 16)" in help_text and "--repeats" in help_text


def test_a_dflash_run_is_selected_by_a_tree_of_its_drafts(tmp_path):
    """select on a dflash run: each checkpoint decodes its block chain through the batched
    engine (real measurements) as the tree select asks for by default (its depth fits the block), identical to plain, and the report names that config."""
    target = wrap_target(tiny_llama(), types.SimpleNamespace(pad_token_id=0, eos_token_id=1), name="tiny-llama")
    target.tokenizer.get_vocab = dict
    setup_data(tmp_path)
    cfg = cfg_for(
        4, **{"train.ckpt_every": 2, "train.keep_checkpoints": 0, "draft.method": "dflash", "draft.layers": 1}
    )
    train(
        cfg, target, tmp_path / "run", tmp_path / "train.jsonl", tmp_path / "val.jsonl", tmp_path / "vocab.safetensors"
    )
    opts = SelectOptions(
        prompts=str(prompt_set(tmp_path / "held.jsonl")), data=str(tmp_path), concurrency=2, max_new_tokens=6, repeats=1
    )
    report = select_checkpoint(target, tmp_path / "run", opts)
    rows = report["selection"]["candidates"]
    assert {r["checkpoint"] for r in rows} == {"step_0000002", "step_0000004"}
    assert all(r["config"] == "tree-3-4-8" and r["identical"] == 1.0 and r["tok_s"] > 0 for r in rows)
    assert report["protocol"]["config"] == "tree-3-4-8" and report["selection"]["winner"] in {
        r["checkpoint"] for r in rows
    }
