"""`draftling select`: loss shortlists, served speed decides, the report says why."""

import json

import torch

from draftling.bench import select
from draftling.bench.select import SelectOptions, select_checkpoint
from draftling.io import write_jsonl
from draftling.train.trainer import train
from tests.conftest import random_batch, setup_data
from tests.helpers import cfg_for


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
