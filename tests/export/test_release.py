"""`draftling release`: a hub-ready folder (export, model card, serving configs) whose
speculators export draftling reloads, and a clear line where no hub is reachable."""

import json

import pytest
import torch

from draftling.draft.store import load_draft
from draftling.errors import DraftlingError
from draftling.export.formats import load_any_draft
from draftling.export.release import ReleaseSpec, push, release
from draftling.train.trainer import train
from tests.conftest import setup_data
from tests.helpers import cfg_for, train_run


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_release_folder_reloads_and_says_how_to_serve(tmp_path, tiny_target, fmt):
    setup_data(tmp_path)
    train(
        cfg_for(2),
        tiny_target,
        tmp_path / "run",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
    )
    out = release(ReleaseSpec(str(tmp_path / "run"), str(tmp_path / "rel"), fmt, "org/tiny-llama"), tiny_target)
    assert {"README.md", "serving.json", "config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    head, back = load_draft(tmp_path / "run" / "draft"), load_any_draft(out, "cpu", torch.float32)
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)
    torch.testing.assert_close(back.fc.weight, head.fc.weight.to(torch.bfloat16).float())
    serving = json.loads((out / "serving.json").read_text())
    assert serving["vllm"]["speculative_config"] == {
        "method": "eagle3",
        "model": "<path to this folder>",
        "num_speculative_tokens": 3,
    }
    assert "--speculative-algorithm EAGLE3" in serving["sglang"]["command"]
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: org/tiny-llama\n") and "speculative_config" in card
    assert "- data: replies the target wrote to " in card
    assert "split by task when the records carry a task identity, else id" in card  # data.split_key=auto
    if fmt == "sglang":  # the card names the fingerprint the export carries
        assert "the export's checkpoint fingerprint: config `" in card and "RoPE `{" in card
        assert "no weight fingerprint (`release --weight-fingerprint` adds one)" in card
    else:
        assert "the export records no checkpoint fingerprint" in card
    if fmt == "speculators":
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    with pytest.raises(DraftlingError, match="already|--overwrite"):  # an earlier release is not replaced silently
        release(ReleaseSpec(str(tmp_path / "run"), str(out), fmt, "org/tiny-llama"), tiny_target)


def test_release_with_a_weight_fingerprint_says_so_in_its_card(tmp_path, tiny_target):
    from draftling.target.fingerprint import weight_hash

    setup_data(tmp_path)
    train(
        cfg_for(2),
        tiny_target,
        tmp_path / "run",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
    )
    out = release(ReleaseSpec(str(tmp_path / "run"), str(tmp_path / "rel"), weight_fingerprint=True), tiny_target)
    recorded = json.loads((out / "config.json").read_text())["draftling"]["target_fingerprint"]
    assert recorded["weights"] == weight_hash(tiny_target.model)
    assert (
        f"weights `{recorded['weights']}` (sha256 of a fixed sample of every weight tensor)"
        in (out / "README.md").read_text()
    )


def test_push_without_a_hub_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DraftlingError, match=r"--push org/x: the hub is out of reach \(HF_HUB_OFFLINE is set\)"):
        push(tmp_path, "org/x")


def test_release_ships_the_selected_checkpoint(tmp_path, tiny_target):
    setup_data(tmp_path)
    cfg = cfg_for(4)
    cfg.train.ckpt_every, cfg.train.keep_checkpoints = 2, 0
    train(
        cfg,
        tiny_target,
        tmp_path / "run",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
    )
    run = tmp_path / "run"
    picked = sorted(p.name for p in (run / "checkpoints").iterdir())[0]
    report = {
        "protocol": {"max_prompt_tokens": 7900, "config": "tree-3-4-8", "concurrency": 8},
        "manifest": {"machine": "nvidia-h200: one NVIDIA H200"},
        "selection": {
            "winner": picked,
            "reason": "fastest.",
            "candidates": [{"checkpoint": picked, "val_loss": 1.5, "tau": 1.8, "tok_s": 12.0}],
        },
        "adaptation": {
            "workload": "airline",
            "prompts": 4,
            "base": {"tau": 1.2, "tok_s": 9.0},
            "adapted": {"tau": 1.8, "tok_s": 12.0},
        },
    }
    (run / "selection").mkdir()
    (run / "selection" / "selection.json").write_text(json.dumps(report))
    out = release(ReleaseSpec(str(run), str(tmp_path / "rel"), "sglang", "org/tiny-llama"), tiny_target)
    shipped, chosen = load_any_draft(out, "cpu", torch.float32), load_draft(run / "checkpoints" / picked)
    final = load_draft(run / "draft")
    torch.testing.assert_close(shipped.fc.weight, chosen.fc.weight.to(torch.bfloat16).float())
    assert not torch.equal(chosen.fc.weight, final.fc.weight)  # so the check above tells them apart
    card = (out / "README.md").read_text()
    assert f"`checkpoints/{picked}`" in card and "tau 1.20 -> 1.80" in card and "up to 7900 tokens" in card
    assert "batched engine (nvidia-h200: one NVIDIA H200), tree-3-4-8, concurrency 8" in card
    out2 = release(
        ReleaseSpec(str(run), str(tmp_path / "rel2"), "sglang", "org/tiny-llama", checkpoint="final"), tiny_target
    )
    torch.testing.assert_close(
        load_any_draft(out2, "cpu", torch.float32).fc.weight, final.fc.weight.to(torch.bfloat16).float()
    )
    with pytest.raises(DraftlingError, match="no checkpoint step_9"):
        release(ReleaseSpec(str(run), str(tmp_path / "rel3"), checkpoint="step_9"), tiny_target)


def test_release_serves_the_config_its_bench_found_best_and_names_every_engine(tmp_path, tiny_target):
    setup_data(tmp_path)
    train(
        cfg_for(2),
        tiny_target,
        tmp_path / "run",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
    )
    bench = {
        "date": "2026-12-05",
        "gpu": "nvidia-h200",
        "engine": "draftling 0.1.0",
        "dtype": "bfloat16",
        "prompt_set": {"name": "v1"},
        "caveats": ["n = 56 prompts"],
        "configs": [
            {"name": "chain-3-1-4", "steps": 3, "topk": 1, "draft_tokens": 4, "mean_speedup": 1.36, "mean_tau": 2.4},
            {"name": "tree-5-8-16", "steps": 5, "topk": 8, "draft_tokens": 16, "mean_speedup": 1.52, "mean_tau": 3.1},
            {"name": "tree-3-4-8", "steps": 3, "topk": 4, "draft_tokens": 8, "mean_speedup": 1.45, "mean_tau": 2.9},
        ],
    }
    rec = {
        "format": "sglang",
        "config": "chain-3-1-4",
        "vllm_version": "0.32.0",
        "device": "cpu",
        "draftling_device": "cpu",
        "tau_vllm": 2.31,
        "tau_draftling": 2.35,
        "ratio": 0.983,
        "within_band": True,
        "band": 0.1,
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "served.json").write_text(json.dumps({"date": "2026-12-05", "vllm_check": [rec], "caveats": []}))
    out = release(
        ReleaseSpec(
            str(tmp_path / "run"),
            str(tmp_path / "rel"),
            "sglang",
            "org/tiny-llama",
            bench=str(tmp_path / "bench.json"),
            serve_check=str(tmp_path / "served.json"),
        ),
        tiny_target,
    )
    serving = json.loads((out / "serving.json").read_text())
    assert serving["vllm"]["speculative_config"]["num_speculative_tokens"] == 5  # tree-5-8-16's depth
    assert (
        "--speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 16"
        in serving["sglang"]["command"]
    )
    assert serving["chosen_by"].startswith("tree-5-8-16: the best mean speedup (1.52x)")
    card = (out / "README.md").read_text()
    assert "measured by the engine of draftling 0.1.0 on nvidia-h200, bfloat16, batch 1" in card
    assert "| sglang | chain-3-1-4 | vLLM 0.32.0 (cpu) | 2.31 | 2.35 (cpu) | 0.983 | yes (+-10%) |" in card
    assert "Engine versions checked: vLLM 0.32.0 (cpu)" in card and "omits the embedding" in card
    # Without a bench, the default config, and the card says no bench chose it.
    plain = release(ReleaseSpec(str(tmp_path / "run"), str(tmp_path / "rel2"), "sglang", "org/tiny-llama"), tiny_target)
    assert "no release bench was given" in json.loads((plain / "serving.json").read_text())["chosen_by"]
    assert "Not checked: `draftling serve-check" in (plain / "README.md").read_text()


def test_a_dflash_release_is_the_dflash_layout_served_by_vllm(tmp_path, tiny_target):
    """A block drafter's release: speculators' dflash layout by default (its one layout), a
    vLLM `dflash` speculative_config of block - 1 drafts, no SGLang line, a card that says so."""
    from draftling.draft.block import BlockDraft

    setup_data(tmp_path)
    train_run(tmp_path, tiny_target, "run", 2, **{"draft.method": "dflash", "draft.layers": 1})
    out = release(ReleaseSpec(str(tmp_path / "run"), str(tmp_path / "rel"), target_id="org/tiny-llama"), tiny_target)
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dflash"
    back = load_any_draft(out, "cpu", torch.float32)
    assert isinstance(back, BlockDraft) and back.block_size == 4  # train.ttt_steps=3
    serving = json.loads((out / "serving.json").read_text())
    assert serving["vllm"]["speculative_config"] == {
        "method": "dflash",
        "model": "<path to this folder>",
        "num_speculative_tokens": 3,
    }
    assert serving["sglang"] is None
    card = (out / "README.md").read_text()
    assert "- dflash\n" in card and "# DFlash block draft head for org/tiny-llama" in card
    assert "EAGLE" not in card and "SGLang:" not in card
