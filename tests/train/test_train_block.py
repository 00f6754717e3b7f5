"""A dflash head through the trainer: it learns, its metrics are per block slot, resume is
exact (weights and optimizer), and the saved head loads back as a block drafter."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftling.draft.block import BlockDraft
from draftling.draft.store import load_draft
from draftling.errors import ConfigError
from draftling.train.checkpoint import list_checkpoints, load_train_state
from tests.conftest import setup_data
from tests.helpers import train_run as run
from tests.helpers import whole_and_resumed

DFLASH = {"draft.method": "dflash", "draft.layers": 2}


def test_a_dflash_head_learns_and_loads_back(tmp_path, tiny_target):
    setup_data(tmp_path)
    run(tmp_path, tiny_target, "b", 8, **DFLASH)
    records = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert len(train[0]["acc"]) == 3  # train.ttt_steps=3: a block of 4, three drafts
    assert train[-1]["loss"] < train[0]["loss"]
    draft = load_draft(tmp_path / "b" / "draft")
    assert isinstance(draft, BlockDraft) and draft.block_size == 4 and len(draft.layers) == 2
    assert draft.config.mask_token_id >= 0


def test_a_resumed_dflash_run_equals_an_uninterrupted_one(tmp_path, tiny_target):
    setup_data(tmp_path)
    whole_and_resumed(tmp_path, tiny_target, 6, 2, **DFLASH)
    a = load_file(str(tmp_path / "full" / "draft" / "draft.safetensors"))
    b = load_file(str(tmp_path / "cut" / "draft" / "draft.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (load_train_state(list_checkpoints(tmp_path / r)[-1]) for r in ("full", "cut"))
    for k, v in sa["optimizer"]["state"].items():
        assert torch.equal(v["exp_avg_sq"], sb["optimizer"]["state"][k]["exp_avg_sq"])


def test_eagle3_options_are_refused_for_a_dflash_head(tmp_path, tiny_target):
    setup_data(tmp_path)
    with pytest.raises(ConfigError, match=r"does not take draft\.fc_norm"):
        run(tmp_path, tiny_target, "x", 2, **DFLASH, **{"draft.fc_norm": "true"})
    with pytest.raises(ConfigError, match="one layer"):
        run(tmp_path, tiny_target, "y", 2, **{"draft.layers": 2})
