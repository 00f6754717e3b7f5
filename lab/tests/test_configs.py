"""The lab's GPU recipe (lab/configs/gpu_smollm2.yaml) loads by its path and holds the measured recipe."""

from draftling.config import load_config
from tests.conftest import CHECKOUT


def test_the_gpu_recipe_loads_by_path_and_holds_the_measured_recipe():
    gpu = load_config(str(CHECKOUT / "lab/configs/gpu_smollm2.yaml"))
    assert gpu.draft.intermediate_size == 4096 and gpu.device == "cuda"
    # The measured recipe (2026-12-03): every non-agent corpus file uncapped, trained until the
    # smoke tau converges.
    assert len(gpu.data.prompts) == 10 and not any("agent" in p for p in gpu.data.prompts)
    assert gpu.data.prompt_cap("shared:math_gsm8k_train.jsonl") == 0
    assert gpu.train.stop_on_convergence and gpu.train.smoke_every == 400
    assert (gpu.train.batch_size, gpu.train.max_steps) == (64, 5600)
    assert gpu.train.ckpt_every_epoch and gpu.train.smoke_max_share == 0.05  # the default pacing
