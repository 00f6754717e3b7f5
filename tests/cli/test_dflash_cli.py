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
