"""An EAGLE-3.1 head (draft.fc_norm + draft.norm_output) through the commands a user runs:
train, exact resume, bench (lossless), export in both formats, check, and a warm start."""

import json

import torch
from safetensors.torch import load_file

from draftling.cli import main
from tests.helpers import cli_data, cli_train

FLAGS = ["draft.fc_norm=true", "draft.norm_output=true"]


def test_an_eagle31_head_trains_resumes_benches_exports_and_checks(tmp_path, tiny_target_dir):
    data, common = cli_data(tmp_path, tiny_target_dir)
    assert cli_train(common, data, tmp_path / "whole", 4, *FLAGS) == 0
    # Stopped at 2 steps, then resumed to 4: inside the default 50-step warmup the LR does not
    # depend on max_steps, so both runs see one schedule.
    assert cli_train(common, data, tmp_path / "cut", 2, *FLAGS) == 0
    assert cli_train(common, data, tmp_path / "cut", 4, *FLAGS, "--resume", "--allow-change", "train.max_steps") == 0
    whole = load_file(str(tmp_path / "whole" / "draft" / "draft.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "draft" / "draft.safetensors"))
    assert {"fc_norm.0.weight", "fc_norm.2.weight"} <= set(whole)
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    config = json.loads((tmp_path / "whole" / "draft" / "draft_config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True

    draft = tmp_path / "whole" / "draft"
    bench = tmp_path / "bench.json"
    args = ["--prompts", str(data / "val.jsonl"), "--num-prompts", "2", "--max-new-tokens", "8", "--out", str(bench)]
    assert main(["bench", *common, "--draft", str(draft), *args]) == 0
    assert json.loads(bench.read_text())["configs"][0]["identical_to_greedy"] == 1.0

    for fmt in ("sglang", "speculators"):
        named = ["--verifier-id", "test/tiny-llama"] if fmt == "speculators" else []
        out = tmp_path / fmt
        cmd = ["export", "--draft", str(draft), "--out", str(out), "--format", fmt, "--target", str(tiny_target_dir)]
        assert main([*cmd, *named, "--dtype", "float32"]) == 0
        assert json.loads((out / "config.json").read_text())["norm_output"] is True
        assert main(["check", str(out), *common]) == 0

    # A warm start from the export keeps its norms; asking a plain head for them is refused.
    assert cli_train(common, data, tmp_path / "warm", 2, "--init-from", str(tmp_path / "sglang")) == 0
    assert "fc_norm.1.weight" in load_file(str(tmp_path / "warm" / "draft" / "draft.safetensors"))
    plain = tmp_path / "plain"
    assert cli_train(common, data, plain, 2) == 0
    assert cli_train(common, data, tmp_path / "bad", 2, "--init-from", str(plain / "draft"), "draft.fc_norm=true") == 2
