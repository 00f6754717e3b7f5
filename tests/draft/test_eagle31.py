"""EAGLE-3.1 options of the EAGLE-3 head (draft.fc_norm, draft.norm_before_fc, draft.norm_output):
their weights and names, what each changes in the forward, the engine's losslessness, the
exports' config keys and round trip, and warm starts."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftling.config import load_config
from draftling.draft.model import NORM_FLAGS, Eagle3Draft, draft_config_from_target
from draftling.draft.store import load_draft, save_draft
from draftling.engine import greedy_generate, speculative_generate
from draftling.errors import ConfigError
from draftling.export.formats import export_sglang, load_any_draft, load_sglang_export
from draftling.export.speculators import export_speculators
from draftling.train.warmstart import keep_norms
from tests.helpers import AUX, prompt, random_export_draft, run_draft, runners, tiny, tiny_export_llama

V31 = {"fc_norm": True, "norm_output": True}


@pytest.fixture(scope="module")
def eagle_target():
    return tiny_export_llama()


def test_a_plain_head_is_unchanged_and_each_flag_adds_its_named_weights(eagle_target):
    target = eagle_target
    plain = random_export_draft(target)
    assert not any(k in plain.config.to_dict() for k in NORM_FLAGS)  # plain configs and exports stay as they were
    names = set(plain.trainable_state_dict())
    v31 = random_export_draft(target, **V31)
    assert set(v31.trainable_state_dict()) - names == {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    before_fc = random_export_draft(target, norm_before_fc=True)
    assert set(before_fc.trainable_state_dict()) - names == {"input_norm.weight"}
    h = target.config.hidden_size
    assert before_fc.input_norm.weight.shape == (3 * h,) and v31.fc_norm[1].weight.shape == (h,)
    with pytest.raises(ConfigError, match="exclusive"):
        draft_config_from_target(target.config, 64, AUX, fc_norm=True, norm_before_fc=True)
    with pytest.raises(ConfigError, match="exclusive"):
        load_config(None, ["draft.fc_norm=true", "draft.norm_before_fc=true"])


def test_fc_norm_normalizes_each_aux_state_and_norm_output_feeds_the_normed_state(eagle_target):
    target = eagle_target
    draft = random_export_draft(target, **V31)
    h = target.config.hidden_size
    aux = torch.randn(1, 5, 3 * h)
    scaled = torch.cat([aux[..., :h] * 7.0, aux[..., h:]], dim=-1)  # one aux state at another scale
    assert torch.allclose(draft.fuse(aux), draft.fuse(scaled), atol=1e-5)  # per-state RMS norm removes it
    plain = random_export_draft(target)
    assert not torch.allclose(plain.fuse(aux), plain.fuse(scaled), atol=1e-3)
    out = torch.randn(1, 5, h)
    assert torch.equal(draft.carry(out), draft.norm(out)) and torch.equal(plain.carry(out), out)
    # The logits apply the final norm once either way: from the same layer output, the same logits.
    same = random_export_draft(target, fc_norm=True)
    same.load_state_dict(draft.state_dict())
    assert torch.allclose(draft.compute_logits(draft.carry(out)), same.compute_logits(same.carry(out)), atol=1e-6)


def test_norm_output_changes_the_second_step_only(eagle_target):
    target = eagle_target
    a, b = random_export_draft(target, fc_norm=True), random_export_draft(target, **V31)
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, target.config.vocab_size, (1, 9))
    la, lb = run_draft(a, target, ids), run_draft(b, target, ids)
    first = la.shape[-1] // 2
    assert torch.allclose(la[..., :first], lb[..., :first], atol=1e-5)
    assert not torch.allclose(la[..., first:], lb[..., first:], atol=1e-3)


@pytest.mark.parametrize("flags", [V31, {"norm_before_fc": True, "norm_output": True}])
def test_speculative_equals_greedy_with_an_eagle31_head(flags):
    model = tiny()
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_config_from_target(model.config, 64, AUX, **flags)).eval()
    vocab = model.config.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:64] = True
    draft.set_vocab(torch.zeros(64, dtype=torch.long), t2d)
    target, dr = runners(model, draft)
    ids = prompt()
    want = greedy_generate(target, ids, 30)
    for tree in [(3, 1, 4), (3, 4, 8)]:
        out, stats = speculative_generate(target, dr, ids, 30, *tree)
        assert torch.equal(out, want) and stats.tokens == 30


def test_exports_carry_the_flags_where_vllm_reads_them_and_load_back(tmp_path, eagle_target):
    target = eagle_target
    draft = random_export_draft(target, **V31)
    ids = torch.randint(0, target.config.vocab_size, (1, 9))
    sgl = export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True, dtype="keep")
    cfg = json.loads((sgl / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and "norm_before_fc" not in cfg
    assert {"fc_norm.0.weight", "fc_norm.2.weight"} <= set(load_file(str(sgl / "model.safetensors")))
    spec = export_speculators(
        draft, tmp_path / "spec", verifier_name_or_path="t", verifier_architectures=["LlamaForCausalLM"], dtype="keep"
    )
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True  # top level: vLLM's update_eagle3 reads them there
    assert "fc_norm" not in cfg["transformer_layer_config"]
    for path in (sgl, spec):
        loaded = load_any_draft(path, "cpu", torch.float32)
        assert loaded.norm_output and hasattr(loaded, "fc_norm")
        assert torch.equal(run_draft(draft, target, ids), run_draft(loaded, target, ids))
    save_draft(draft, tmp_path)
    assert torch.equal(run_draft(load_draft(tmp_path), target, ids), run_draft(draft, target, ids))


@pytest.mark.parametrize("flags", [V31, {"norm_before_fc": True}], ids=["fc_norm", "norm_before_fc"])
def test_a_bf16_sglang_export_loads_every_norm_in_bf16_and_runs(tmp_path, eagle_target, flags):
    # The extra norms must follow the stored dtype too, or the fc matmul meets fp32 and bf16.
    draft = random_export_draft(eagle_target, **flags)
    loaded = load_sglang_export(export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True))
    stored = {n: p.to(torch.bfloat16) for n, p in draft.named_parameters()}
    weights = dict(loaded.named_parameters())
    assert weights.keys() == stored.keys() and all(torch.equal(weights[n], stored[n]) for n in stored)
    assert {p.dtype for p in weights.values()} == {torch.bfloat16}
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.randint(0, eagle_target.config.vocab_size, (1, 9))
    logits = run_draft(loaded, tiny_export_llama().to(torch.bfloat16), ids)  # fp32 meeting bf16 would raise
    assert logits.dtype == torch.bfloat16 and logits.isfinite().all()


def test_a_warm_start_keeps_the_heads_norms_and_refuses_new_ones(eagle_target):
    target = eagle_target
    plain, v31 = random_export_draft(target), random_export_draft(target, **V31)
    keep_norms(v31, load_config(None, []).draft, "v31")  # unset flags keep the head's own
    keep_norms(v31, load_config(None, ["draft.fc_norm=true"]).draft, "v31")
    with pytest.raises(ConfigError, match="trained without fc_norm"):
        keep_norms(plain, load_config(None, ["draft.fc_norm=true"]).draft, "plain")


@pytest.mark.parametrize("flags", [{}, V31])
@torch.no_grad()
def test_the_engine_drafts_what_the_module_computes(flags):
    """The engine's prefill and next draft level against draft.step over the same inputs: a
    second level reads the first's carried state, so a normed or raw state in the wrong place
    changes its logits."""
    from draftling.engine.target_model import causal_mask
    from tests.helpers import causal_attend

    model = tiny()
    torch.manual_seed(0)
    draft = random_export_draft(model, aux_ids=AUX, **flags)
    target, dr = runners(model, draft)
    ids = prompt()
    t = ids.shape[1]
    pos = torch.arange(t)
    logits, aux = target(ids, pos, pos, causal_mask(0, t, target.max_seq_len, "cpu"))
    shifted = torch.cat([ids[:, 1:], logits[:, -1:].argmax(-1)], 1)
    h1, lg1 = dr.extend(shifted, aux, 0)
    x1 = draft.draft_to_target(lg1[0].argmax())
    slots = torch.tensor([dr.spec_base])
    mask = (torch.arange(dr.cache_size) < t)[None].clone()
    mask[0, slots] = True
    h2, lg2 = dr.tree_step(x1[None], h1, t, slots, mask)

    embed = model.get_input_embeddings()
    ref1 = draft.step(embed(shifted), draft.fuse(aux), pos[None], causal_attend)
    assert torch.allclose(lg1[0], draft.compute_logits(ref1)[0, -1], atol=1e-4)
    hidden = torch.cat([draft.fuse(aux), ref1[:, -1:]], 1)
    ref2 = draft.step(embed(torch.cat([shifted, x1.view(1, 1)], 1)), hidden, torch.arange(t + 1)[None], causal_attend)
    assert torch.allclose(lg2[0], draft.compute_logits(ref2)[0, -1], atol=1e-4)


def test_the_model_card_names_the_options(tmp_path, eagle_target):
    from draftling.export.release import _variant_lines

    (tmp_path / "draft").mkdir()
    save_draft(random_export_draft(eagle_target, **V31), tmp_path / "draft")
    assert _variant_lines(tmp_path) == [
        "- EAGLE-3.1 options: fc_norm, norm_output (in the export's config; vLLM 0.32 reads them)"
    ]
    save_draft(random_export_draft(eagle_target), tmp_path / "draft")
    assert _variant_lines(tmp_path) == []
