"""The block drafter's speculators ``dflash`` export (export/dflash.py): the names and keys
speculators 0.9 writes and vLLM 0.32 reads, a reduced vocab's maps, and a round trip that
drafts exactly as before."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftling.draft.block import BlockDraft, block_config_from_target
from draftling.errors import DraftlingError
from draftling.export.dflash import export_dflash, load_dflash
from tests.helpers import AUX, perm_target

VERIFIER = {"verifier_name_or_path": "t", "verifier_architectures": ["LlamaForCausalLM"]}


def head(model, vocab=None, layers=2):
    torch.manual_seed(0)
    v = vocab or model.config.vocab_size
    draft = BlockDraft(block_config_from_target(model.config, v, AUX, 4, layers, mask_token_id=1))
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[:v] = True
    draft.set_vocab(torch.zeros(v, dtype=torch.long), t2d)
    return draft


def logits(draft, model):
    ids = torch.tensor([[5, 1, 1, 1]])
    aux = torch.randn(1, 7, 3 * model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    kv = draft.context_kv(draft.context(aux), torch.arange(7)[None])
    h = draft.block_hidden(model.get_input_embeddings()(ids), torch.arange(7, 11)[None], kv, None)
    return draft.compute_logits(h)


def test_the_export_names_what_vllm_reads_and_loads_back(tmp_path):
    model = perm_target()
    draft = head(model)
    out = export_dflash(draft, tmp_path / "d", dtype="keep", **VERIFIER)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["aux_hidden_state_layer_ids"] == AUX and cfg["block_size"] == 4 and cfg["mask_token_id"] == 1
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["sliding_window_non_causal"] is True  # bidirectional blocks, as trained
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["hidden_act"] == "silu" and "model_type" not in cfg
    names = set(load_file(str(out / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight"} <= names
    assert {
        "layers.1.self_attn.q_norm.weight",
        "layers.1.self_attn.k_norm.weight",
        "layers.0.mlp.gate_proj.weight",
    } <= names
    assert not names & {"d2t", "t2d", "embed_tokens.weight"}  # a full vocab: vLLM shares the target's
    assert torch.equal(logits(load_dflash(out), model), logits(draft, model))


def test_a_reduced_vocab_carries_its_maps(tmp_path):
    model = perm_target()
    out = export_dflash(head(model, vocab=64), tmp_path / "d", **VERIFIER)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].shape == (model.config.vocab_size,)
    assert tensors["fc.weight"].dtype == torch.bfloat16


def test_another_format_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    with pytest.raises(DraftlingError, match="not 'dflash'"):
        load_dflash(tmp_path)


def test_a_causal_head_tells_vllm_so_and_loads_back_causal(tmp_path):
    model = perm_target()
    torch.manual_seed(0)
    cfg = block_config_from_target(model.config, model.config.vocab_size, AUX, 4, 1, mask_token_id=1, causal=True)
    out = export_dflash(BlockDraft(cfg), tmp_path / "d", **VERIFIER)
    raw = json.loads((out / "config.json").read_text())
    assert raw["sliding_window_non_causal"] is False  # vLLM: every layer causal
    assert raw["transformer_layer_config"]["dtype"] == "bfloat16"
    assert load_dflash(out).causal
