"""A dflash head (draft.method=dflash) through the commands a user runs: train, exact
resume, bench (lossless, one block config), export in speculators' dflash layout, check."""

import json

import torch
from safetensors.torch import load_file

from draftling.cli import main
from tests.helpers import cli_data, cli_train

DFLASH = ["draft.method=dflash", "draft.layers=2"]


def test_a_dflash_head_trains_resumes_benches_exports_and_checks(tmp_path, tiny_target_dir):
    data, common = cli_data(tmp_path, tiny_target_dir)
    assert cli_train(common, data, tmp_path / "whole", 4, *DFLASH) == 0
    assert cli_train(common, data, tmp_path / "cut", 2, *DFLASH) == 0
    assert cli_train(common, data, tmp_path / "cut", 4, *DFLASH, "--resume", "--allow-change", "train.max_steps") == 0
    whole = load_file(str(tmp_path / "whole" / "draft" / "draft.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "draft" / "draft.safetensors"))
    assert "layers.1.self_attn.q_norm.weight" in whole and all(torch.equal(whole[k], cut[k]) for k in whole)
    config = json.loads((tmp_path / "whole" / "draft" / "draft_config.json").read_text())
    assert config["draft_method"] == "dflash" and config["block_size"] == 3

    draft = tmp_path / "whole" / "draft"
    bench = tmp_path / "bench.json"
    args = ["--prompts", str(data / "val.jsonl"), "--num-prompts", "2", "--max-new-tokens", "8", "--out", str(bench)]
    assert main(["bench", *common, "--draft", str(draft), *args]) == 0
    (result,) = json.loads(bench.read_text())["configs"]
    assert result["name"] == "block-3" and result["identical_to_greedy"] == 1.0

    out = tmp_path / "spec"
    cmd = ["export", "--draft", str(draft), "--out", str(out), "--target", str(tiny_target_dir)]
    assert main([*cmd, "--format", "sglang"]) == 2  # a dflash head has one serving layout
    assert main([*cmd, "--format", "speculators", "--verifier-id", "test/tiny-llama"]) == 0
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dflash"
    assert main(["check", str(out), *common]) == 0


def test_a_dflash_head_warm_starts_from_its_export_and_keeps_its_layout(tmp_path, tiny_target_dir, capsys):
    data, common = cli_data(tmp_path, tiny_target_dir)
    assert cli_train(common, data, tmp_path / "base", 2, *DFLASH) == 0
    out = tmp_path / "spec"
    cmd = ["export", "--draft", str(tmp_path / "base" / "draft"), "--out", str(out), "--target", str(tiny_target_dir)]
    assert main([*cmd, "--format", "speculators", "--verifier-id", "test/tiny-llama"]) == 0
    # One step at a negligible lr keeps the weights: the warm head starts from the (bf16) export.
    assert cli_train(common, data, tmp_path / "warm", 1, *DFLASH, "train.lr=1e-12", "--init-from", str(out)) == 0
    base = load_file(str(tmp_path / "base" / "draft" / "draft.safetensors"))
    warm = load_file(str(tmp_path / "warm" / "draft" / "draft.safetensors"))
    for k in (k for k in base if k.startswith("layers.")):
        torch.testing.assert_close(warm[k], base[k].to(torch.bfloat16).float(), atol=1e-6, rtol=0)
        assert not torch.equal(warm[k], base[k]) or base[k].eq(base[k].to(torch.bfloat16).float()).all()
    capsys.readouterr()
    assert cli_train(common, data, tmp_path / "x", 1, "draft.method=dflash", "--init-from", str(out)) == 2
    assert "layout differs: draft.layers=1 (the head's: 2)" in capsys.readouterr().err
    assert cli_train(common, data, tmp_path / "y", 1, "--init-from", str(out)) == 2
    assert "a dflash head, but draft.method=eagle3; set draft.method=dflash" in capsys.readouterr().err
