"""Export formats: round trip, file layout, engine layer-id conventions, refusals."""

import copy
import json
import logging
import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftling.cli import main
from draftling.draft.model import Eagle3Draft, draft_config_from_target
from draftling.draft.store import load_draft, save_draft
from draftling.errors import DraftlingError
from draftling.export import (
    NORM_BEFORE_RESIDUAL,
    check_vocab_maps,
    export_sglang,
    export_speculators,
    files,
    from_engine_aux_layer_ids,
    is_default_aux_layer_ids,
    load_sglang_export,
    to_engine_aux_layer_ids,
)
from draftling.export.cli import DEFAULT_TARGET_HUB_ID, export_draft, verifier_architectures, verifier_hub_id
from draftling.export.formats import load_any_draft
from draftling.target.load import DEFAULT_TARGET, Target, TargetSpec, wrap_target
from draftling.train.draft_setup import place_draft
from tests.helpers import DEFAULT_IDS, DRAFT_VOCAB, VOCAB, run_draft, tiny_config, tiny_export_llama
from tests.helpers import random_export_draft as make_draft

LAYER_NAMES = [
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


@pytest.fixture(scope="module")
def target():
    return tiny_export_llama()


def read_export(path):
    cfg = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return cfg, tensors


def no_leftovers(parent, name):
    return not (parent / name).exists() and not any(p.name.startswith(f".{name}.") for p in parent.iterdir())


# ---------------------------------------------------------------- round trip and file layout


def test_sglang_round_trip_gives_identical_logits(tmp_path, target):
    draft = make_draft(target)
    out = export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True, dtype="keep")
    loaded = load_sglang_export(out)
    ids = torch.randint(0, VOCAB, (2, 12))
    assert torch.equal(run_draft(draft, target, ids), run_draft(loaded, target, ids))
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    assert loaded.config.eagle_aux_hidden_state_layer_ids == DEFAULT_IDS
    assert loaded.config.rope_parameters["rope_theta"] == 500000.0
    assert loaded.embedding is None
    # draft id -> target id survives the trip
    assert torch.equal(loaded.draft_to_target(torch.arange(DRAFT_VOCAB)), draft.t2d.nonzero().squeeze(1))


def test_wider_draft_mlp_round_trips(tmp_path, target):
    # The GPU profile trains a draft MLP wider than the target's; engines build the layer from
    # config.json, so the width must travel with the weights.
    draft = make_draft(target, intermediate_size=3 * target.config.intermediate_size)
    out = export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True, dtype="keep")
    cfg, tensors = read_export(out)
    assert cfg["intermediate_size"] == 384
    assert tensors["midlayer.mlp.gate_proj.weight"].shape == (384, 64)
    loaded = load_sglang_export(out)
    ids = torch.randint(0, VOCAB, (2, 12))
    assert torch.equal(run_draft(draft, target, ids), run_draft(loaded, target, ids))


def test_sglang_bf16_export_casts_weights_only(tmp_path, target):
    draft = make_draft(target)
    out = export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True)
    cfg, tensors = read_export(out)
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert cfg["torch_dtype"] == "bfloat16"
    loaded = load_sglang_export(out)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, draft.lm_head.weight.to(torch.bfloat16))
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("layout", ["draftling", "sglang"])
def test_a_head_loaded_in_bf16_keeps_the_fp32_rotary_table_training_used(tmp_path, target, layout):
    # Rounded to bf16, the table's angles drift with distance: the engine would draft with other
    # positions than training (place_draft) and the serving engines (fp32 tables) use.
    draft = make_draft(target)
    if layout == "draftling":
        path = tmp_path / "d"
        path.mkdir()
        save_draft(draft, path)
    else:
        path = export_sglang(draft, tmp_path / "d", trained_on_default_layers=True, dtype="keep")
    loaded = load_any_draft(path, "cpu", torch.bfloat16)
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    placed = place_draft(copy.deepcopy(draft), "cpu", torch.bfloat16)
    ids = torch.tensor([list(range(1, 200))])  # long enough for the angles to matter
    bf16_target = copy.deepcopy(target).to(torch.bfloat16)
    assert torch.equal(run_draft(loaded, bf16_target, ids), run_draft(placed, bf16_target, ids))


def test_a_dflash_export_loaded_in_bf16_keeps_the_fp32_rotary_table(tmp_path, target):
    from draftling.draft.block import BlockDraft, block_config_from_target
    from draftling.export.dflash import export_dflash

    draft = BlockDraft(block_config_from_target(target.config, DRAFT_VOCAB, DEFAULT_IDS, 4, 1, mask_token_id=2))
    out = export_dflash(draft, tmp_path / "d", verifier_name_or_path="t", verifier_architectures=["LlamaForCausalLM"])
    loaded = load_any_draft(out, "cpu", torch.bfloat16)
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_sglang_file_layout(tmp_path, target):
    draft = make_draft(target)
    out = export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True)
    cfg, tensors = read_export(out)
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    expected |= {f"midlayer.{n}" for n in LAYER_NAMES}
    assert set(tensors) == expected  # no embedding by default
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(tensors["d2t"], draft.d2t) and torch.equal(tensors["t2d"], draft.t2d)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == VOCAB  # TARGET vocab
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert cfg["target_hidden_size"] == 64
    assert cfg["tie_word_embeddings"] is False
    assert cfg["max_position_embeddings"] == 4096
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True}  # defaults: ids omitted
    assert "eagle_aux_hidden_state_layer_ids" not in cfg
    # RoPE in the legacy spelling too, or transformers-4 engines fall back to 10000
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_parameters"]["rope_theta"] == 500000.0


def test_sglang_embedding_only_on_request(tmp_path, target):
    draft = make_draft(target)
    emb = target.get_input_embeddings().weight
    out = export_sglang(
        draft, tmp_path / "sgl", include_embedding=True, embedding=emb, trained_on_default_layers=True, dtype="keep"
    )
    _, tensors = read_export(out)
    assert torch.equal(tensors["embed_tokens.weight"], emb.detach())
    loaded = load_sglang_export(out)
    assert torch.equal(loaded.embedding, emb.detach())
    with pytest.raises(DraftlingError, match="embedding"):
        export_sglang(draft, tmp_path / "x", include_embedding=True, trained_on_default_layers=True)


def test_max_positions_never_below_target(tmp_path, target):
    draft = make_draft(target, max_position_embeddings=2048)
    out = export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True, target_config=target.config)
    assert read_export(out)[0]["max_position_embeddings"] == 4096


# ------------------------------------------------------------------- layer-id conventions


@pytest.mark.parametrize(
    "engine, ours, theirs",
    [
        ("sglang", [1, 3, 4], [0, 2, 3]),
        ("sglang", [2, 15, 27], [1, 14, 26]),  # 30-layer default, if it were written out
        ("vllm", [1, 3, 4], [1, 3, 4]),
        ("speculators", [1, 3, 4], [1, 3, 4]),
        ("draftling", [1, 3, 4], [1, 3, 4]),
    ],
)
def test_engine_layer_id_conventions(engine, ours, theirs):
    assert to_engine_aux_layer_ids(ours, engine) == theirs
    assert from_engine_aux_layer_ids(theirs, engine) == ours


def test_layer_id_convention_edges():
    with pytest.raises(DraftlingError, match="sglang"):
        to_engine_aux_layer_ids([0, 3, 4], "sglang")  # the embedding has no SGLang id
    with pytest.raises(DraftlingError, match="unknown serving engine"):
        to_engine_aux_layer_ids([1, 3, 4], "trt")
    assert is_default_aux_layer_ids([2, 3, 3], 6) and is_default_aux_layer_ids([2, 15, 27])
    assert not is_default_aux_layer_ids([1, 3, 4]) and not is_default_aux_layer_ids([2, 3, 3], 7)


def test_non_default_ids_per_engine_and_back(tmp_path, target):
    draft = make_draft(target, aux_ids=[1, 3, 4])
    sgl = export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=False)
    cfg, _ = read_export(sgl)
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 3], "use_aux_hidden_state": True}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # vLLM reads the top level
    assert load_sglang_export(sgl).config.eagle_aux_hidden_state_layer_ids == [1, 3, 4]

    spec = export_speculators(
        draft, tmp_path / "spec", verifier_name_or_path="org/target", verifier_architectures=["LlamaForCausalLM"]
    )
    assert read_export(spec)[0]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def test_loader_translates_foreign_configs(tmp_path, target):
    draft = make_draft(target, aux_ids=[1, 3, 4])
    out = export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=False)
    cfg = json.loads((out / "config.json").read_text())
    # only SGLang's own key, as another tool would write it
    del cfg["draftling"], cfg["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(cfg))
    assert load_sglang_export(out).config.eagle_aux_hidden_state_layer_ids == [1, 3, 4]
    # no ids at all: the engine defaults, which need the target's depth
    del cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftlingError, match="target_num_layers"):
        load_sglang_export(out)
    assert load_sglang_export(out, target_num_layers=30).config.eagle_aux_hidden_state_layer_ids == [2, 15, 27]
    # an off-by-one between the two spellings is refused, not guessed
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftlingError, match="disagree"):
        load_sglang_export(out)


def test_default_claim_is_checked(tmp_path, target):
    draft = make_draft(target, aux_ids=[1, 3, 4])
    with pytest.raises(DraftlingError, match="trained_on_default_layers"):
        export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True)
    # with the target at hand the check is exact: [2, 3, 3] is not the default of a 7-layer model
    draft = make_draft(target)
    cfg7 = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 7})
    with pytest.raises(DraftlingError, match="default"):
        export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True, target_config=cfg7)
    assert no_leftovers(tmp_path, "sgl")


# ------------------------------------------------------------------------------ refusals


def test_zeroed_d2t_refused(tmp_path, target):
    draft = make_draft(target)
    draft.d2t.zero_()
    with pytest.raises(DraftlingError, match="d2t is all zeros"):
        export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True)
    with pytest.raises(DraftlingError, match="d2t is all zeros"):
        export_speculators(
            draft, tmp_path / "spec", verifier_name_or_path="t", verifier_architectures=["LlamaForCausalLM"]
        )
    assert no_leftovers(tmp_path, "sgl") and no_leftovers(tmp_path, "spec")


def test_wrong_t2d_count_refused(tmp_path, target):
    draft = make_draft(target)
    draft.t2d[(~draft.t2d).nonzero()[0]] = True  # one token too many
    with pytest.raises(DraftlingError, match="t2d marks 65"):
        export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True)
    assert no_leftovers(tmp_path, "sgl")


def test_mismatched_vocab_maps_refused():
    d2t = torch.arange(4) * 2 - torch.arange(4)  # -> targets 0, 2, 4, 6
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[0, 2, 4, 7]] = True
    with pytest.raises(DraftlingError, match="disagree"):
        check_vocab_maps(d2t, t2d, 4, 10)
    t2d[[7, 6]] = torch.tensor([False, True])
    check_vocab_maps(d2t, t2d, 4, 10)
    check_vocab_maps(torch.zeros(10, dtype=torch.long), torch.ones(10, dtype=torch.bool), 10, 10)


def test_failed_write_leaves_previous_export_intact(tmp_path, target, monkeypatch):
    draft = make_draft(target)
    out = export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True)
    before = (out / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(files, "save_file", boom)  # the write every layout shares
    with pytest.raises(OSError):
        export_sglang(make_draft(target, seed=7), out, trained_on_default_layers=True)
    with pytest.raises(OSError):
        export_sglang(draft, tmp_path / "fresh", trained_on_default_layers=True)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sgl"]


def test_loader_refuses_zeroed_d2t(tmp_path, target):
    out = export_sglang(make_draft(target), tmp_path / "sgl", trained_on_default_layers=True)
    cfg, tensors = read_export(out)
    tensors["d2t"] = torch.zeros_like(tensors["d2t"])
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(DraftlingError, match="d2t is all zeros"):
        load_sglang_export(out)


# ---------------------------------------------------------------------------- speculators


def test_speculators_layout(tmp_path, target):
    draft = make_draft(target)
    out = export_speculators(
        draft,
        tmp_path / "spec",
        verifier_name_or_path="org/target",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=5,
    )
    cfg, tensors = read_export(out)
    assert cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["speculators_config"] == {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]},
    }
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert cfg["norm_before_residual"] is False and NORM_BEFORE_RESIDUAL is False
    assert cfg["target_hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == DEFAULT_IDS  # always explicit for vLLM
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["vocab_size"] == VOCAB and layer["hidden_size"] == 64
    assert layer["rope_theta"] == 500000.0 and layer["tie_word_embeddings"] is False
    assert "draft_vocab_size" not in layer and "eagle_aux_hidden_state_layer_ids" not in layer

    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    expected |= {f"layers.0.{n}" for n in LAYER_NAMES}
    assert set(tensors) == expected
    assert torch.equal(
        tensors["layers.0.hidden_norm.weight"], draft.midlayer.hidden_norm.weight.detach().to(torch.bfloat16)
    )
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool


def test_speculators_output_loads_back_through_the_same_names(tmp_path, target):
    # layers.0.* is accepted by the loader too (vLLM maps midlayer. -> layers.0.)
    draft = make_draft(target)
    out = export_speculators(
        draft, tmp_path / "spec", verifier_name_or_path="t", verifier_architectures=["LlamaForCausalLM"], dtype="keep"
    )
    cfg, tensors = read_export(out)
    sgl_cfg = {
        **cfg["transformer_layer_config"],
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
    }
    (out / "config.json").write_text(json.dumps(sgl_cfg))
    loaded = load_sglang_export(out)
    ids = torch.randint(0, VOCAB, (1, 9))
    assert torch.equal(run_draft(draft, target, ids), run_draft(loaded, target, ids))


def test_speculators_requires_verifier(tmp_path, target):
    draft = make_draft(target)
    with pytest.raises(DraftlingError, match="verifier_architectures"):
        export_speculators(draft, tmp_path / "spec", verifier_name_or_path="t", verifier_architectures=[])
    assert no_leftovers(tmp_path, "spec")


# ------------------------------------------- what speculators 0.9.0 found in the metadata


def save_draft_dir(path, draft):
    path.mkdir(parents=True)
    save_draft(draft, path)
    return path


def as_target(model, name, spec=None):
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=1)
    wrapped = wrap_target(model, tokenizer, name=name)
    return wrapped if spec is None else Target(spec, wrapped.model, tokenizer, wrapped.aux_layer_ids)


def test_verifier_architectures_when_the_config_has_none(tmp_path, target):
    # A model loaded from a GGUF file has config.architectures = None (so has a fresh one).
    target.config.architectures = None
    assert verifier_architectures(target) == ["LlamaForCausalLM"]  # from the class
    base = types.SimpleNamespace(config=types.SimpleNamespace(architectures=None, model_type="llama"))
    assert verifier_architectures(base) == ["LlamaForCausalLM"]  # from model_type
    named = types.SimpleNamespace(config=types.SimpleNamespace(architectures=["MyForCausalLM"]))
    assert verifier_architectures(named) == ["MyForCausalLM"]  # the config wins
    odd = types.SimpleNamespace(config=types.SimpleNamespace(architectures=[], model_type="nope"))
    with pytest.raises(DraftlingError, match="architecture"):
        verifier_architectures(odd)

    draft_dir = save_draft_dir(tmp_path / "draft", make_draft(target))
    out = export_draft(draft_dir, tmp_path / "spec", "speculators", target=as_target(target, "org/tiny"))
    verifier = read_export(out)[0]["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]}


def test_verifier_is_a_hub_id_never_a_local_path(tmp_path, target, monkeypatch):
    gguf = TargetSpec(DEFAULT_TARGET, str(tmp_path), str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert verifier_hub_id(gguf) == DEFAULT_TARGET_HUB_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert verifier_hub_id(TargetSpec("org/name", "org/name")) == "org/name"  # a hub id, as is
    assert verifier_hub_id(TargetSpec("org/name", "org/name"), "other/id") == "other/id"
    cached = tmp_path / "hub" / "models--Org--Some-Model" / "snapshots" / "0123abc"
    cached.mkdir(parents=True)
    assert verifier_hub_id(TargetSpec(str(cached), str(cached))) == "Org/Some-Model"

    local = tmp_path / "models" / "mine"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({"_name_or_path": "org/base"}))
    monkeypatch.chdir(tmp_path)
    for spec in (
        TargetSpec(str(local), str(local)),  # absolute
        TargetSpec("models/mine", "models/mine"),  # relative, looks like org/name
        TargetSpec("x.gguf", str(tmp_path), str(tmp_path / "x.gguf")),
        TargetSpec("in-memory", "in-memory"),
    ):
        with pytest.raises(DraftlingError, match="pass --verifier-id") as e:
            verifier_hub_id(spec)
        assert "\n" not in str(e.value)
    with pytest.raises(DraftlingError, match="--verifier-id org/base if it is that model"):
        verifier_hub_id(TargetSpec(str(local), str(local)))  # a hint, not a guess
    assert verifier_hub_id(TargetSpec(str(local), str(local)), "org/mine") == "org/mine"
    for bad in (str(local), "models/mine", "./x", "~/x", "a/b/c", "org--x/y"):
        with pytest.raises(DraftlingError, match="--verifier-id"):
            verifier_hub_id(TargetSpec("org/name", "org/name"), bad)

    # Through export_draft: the default target's short name never reaches the config.
    draft_dir = save_draft_dir(tmp_path / "draft", make_draft(target))
    out = export_draft(draft_dir, tmp_path / "spec", "speculators", target=as_target(target, "t", gguf))
    assert read_export(out)[0]["speculators_config"]["verifier"]["name_or_path"] == DEFAULT_TARGET_HUB_ID
    with pytest.raises(DraftlingError, match="pass --verifier-id"):
        export_draft(
            draft_dir,
            tmp_path / "spec2",
            "speculators",
            target=as_target(target, "t", TargetSpec(str(local), str(local))),
        )
    out = export_draft(
        draft_dir,
        tmp_path / "spec3",
        "speculators",
        verifier_id="org/mine",
        target=as_target(target, "t", TargetSpec(str(local), str(local))),
    )
    assert read_export(out)[0]["speculators_config"]["verifier"]["name_or_path"] == "org/mine"
    assert no_leftovers(tmp_path, "spec2")


def test_export_cli_speculators_needs_target_and_a_hub_id(tmp_path, target, capsys):
    draft_dir = save_draft_dir(tmp_path / "draft", make_draft(target))
    base = ["export", "--draft", str(draft_dir), "--out", str(tmp_path / "out")]
    assert main([*base, "--format", "speculators"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs --target" in err and len(err.splitlines()) == 1
    # A local target is refused before it loads (this one could not load: its config is empty).
    local = tmp_path / "local-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert main([*base, "--format", "speculators", "--target", str(local)]) == 2
    err = capsys.readouterr().err.strip()
    assert "pass --verifier-id" in err and len(err.splitlines()) == 1
    assert main([*base, "--verifier-id", "org/x"]) == 2  # sglang has no verifier
    assert "--format speculators only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sglang_export_warns_about_non_default_layers(tmp_path, target, caplog):
    default_dir = save_draft_dir(tmp_path / "default", make_draft(target))
    custom_dir = save_draft_dir(tmp_path / "custom", make_draft(target, aux_ids=[1, 3, 4]))
    with caplog.at_level(logging.WARNING, logger="draftling.export.cli"):
        export_draft(default_dir, tmp_path / "a")
        assert not caplog.records
        export_draft(custom_dir, tmp_path / "b")
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "[1, 3, 4]" in record.getMessage() and "--format speculators" in record.getMessage()
    assert "speculators convert" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="draftling.export.cli"):
        export_draft(custom_dir, tmp_path / "c", "speculators", target=as_target(target, "org/tiny"))
    assert not caplog.records  # ids are read there


@pytest.mark.parametrize("dtype, name", [("bfloat16", "bfloat16"), ("keep", "float32")])
def test_speculators_layer_config_has_dtype(tmp_path, target, dtype, name):
    out = export_speculators(
        make_draft(target),
        tmp_path / "spec",
        verifier_name_or_path="org/t",
        verifier_architectures=["LlamaForCausalLM"],
        dtype=dtype,
    )
    cfg, tensors = read_export(out)
    assert tensors["fc.weight"].dtype == getattr(torch, name)
    assert cfg["torch_dtype"] == name  # the top-level one stays
    layer = cfg["transformer_layer_config"]
    assert layer["dtype"] == name and layer["torch_dtype"] == name
    assert LlamaConfig(**layer).dtype == getattr(torch, name)


def test_every_draft_load_checks_the_vocab_maps(tmp_path, target):
    draft = make_draft(target)
    draft.d2t.zero_()  # t2d still marks the real draft vocab
    draft_dir = save_draft_dir(tmp_path / "zeroed", draft)
    for load in (load_draft, lambda p: load_any_draft(p, "cpu", torch.float32)):
        with pytest.raises(DraftlingError, match="d2t is all zeros") as e:
            load(draft_dir)
        assert str(draft_dir / "draft.safetensors") in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DraftlingError, match="d2t is all zeros"):
        export_draft(draft_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    stale = make_draft(target)
    stale.t2d.copy_(make_draft(target, seed=5).t2d)  # maps from other data
    with pytest.raises(DraftlingError, match="disagree"):
        load_draft(save_draft_dir(tmp_path / "stale", stale))

    # An SGLang export without t2d: a t2d rebuilt from a zeroed d2t would agree with it.
    out = export_sglang(make_draft(target), tmp_path / "sgl", trained_on_default_layers=True)
    _, tensors = read_export(out)
    del tensors["t2d"]
    tensors["d2t"] = torch.zeros_like(tensors["d2t"])
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(DraftlingError, match="d2t is all zeros and there is no t2d"):
        load_any_draft(out, "cpu", torch.float32)

    # What the checks accept: real maps, and a zero d2t whose draft vocab IS ids 0..N-1
    # (build_vocab pads with the lowest unused ids, so small data can give exactly that).
    assert torch.equal(load_draft(save_draft_dir(tmp_path / "ok", make_draft(target))).d2t, make_draft(target).d2t)
    prefix = make_draft(target)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[:DRAFT_VOCAB] = True
    prefix.set_vocab(torch.zeros(DRAFT_VOCAB, dtype=torch.long), t2d)
    assert not load_draft(save_draft_dir(tmp_path / "prefix", prefix)).d2t.any()


def test_check_accepts_a_fitting_export_and_names_every_mismatch(tmp_path):
    """`draftling check`: sizes, aux layers and the recorded target fingerprint."""
    import json as _json
    import types as _types

    from draftling.export.check import check_export
    from draftling.export.cli import record_fingerprint
    from draftling.target.fingerprint import fingerprint

    torch.manual_seed(0)
    target_cfg = tiny_config(num_hidden_layers=6, max_position_embeddings=2048)
    draft = Eagle3Draft(draft_config_from_target(target_cfg, 300, [2, 3, 3]))
    draft.set_vocab(torch.zeros(300, dtype=torch.long), torch.ones(300, dtype=torch.bool))
    out = export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=True, dtype="keep")
    tok = _types.SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1}, chat_template="t")
    record_fingerprint(out, fingerprint(target_cfg, tok))
    assert any("tokenizer hash" in line for line in check_export(out, target_cfg, tok))
    other = LlamaConfig(**{**target_cfg.to_dict(), "hidden_size": 96, "num_hidden_layers": 2})
    with pytest.raises(DraftlingError) as e:
        check_export(out, other, _types.SimpleNamespace(get_vocab=lambda: {"a": 0}, chat_template="t"))
    msg = str(e.value)
    assert "hidden size: head 64, target 96" in msg and "of a 2-layer target" in msg
    assert "config hash" in msg and "tokenizer hash" in msg and "\n" not in msg
    assert _json.loads((out / "config.json").read_text())["draftling"]["target_fingerprint"]["config"]


def _tiny_export(tmp_path, target_dir, name, *flags):
    """An SGLang export, with --target, of a random head for the target saved in ``target_dir``."""
    from draftling.target.load import load_target_config

    cfg = load_target_config(str(target_dir))
    draft_dir = tmp_path / "draft"
    if not draft_dir.is_dir():
        torch.manual_seed(0)
        draft = Eagle3Draft(draft_config_from_target(cfg, 64, [2, 3, 4]))
        draft.set_vocab(torch.zeros(64, dtype=torch.long), torch.arange(cfg.vocab_size) < 64)
        save_draft_dir(draft_dir, draft)
    out = tmp_path / name
    assert main(["export", "--draft", str(draft_dir), "--out", str(out), "--target", str(target_dir), *flags]) == 0
    return out


def _changed_target(tmp_path, target_dir, name, config=None, weight=False):
    """A copy of the target with its config.json updated by ``config`` and/or one weight changed."""
    import shutil

    copy = tmp_path / name
    shutil.copytree(target_dir, copy)
    if weight:
        model = LlamaForCausalLM.from_pretrained(copy)
        with torch.no_grad():
            model.model.layers[3].mlp.up_proj.weight.mul_(1.01)  # a fine-tune: every element moves a little
        model.save_pretrained(copy)
    if config:
        path = copy / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return copy


def test_check_fails_on_a_changed_rope(tmp_path, tiny_target_dir, capsys):
    from draftling.target.fingerprint import rope_params
    from draftling.target.load import load_target_config

    export = _tiny_export(tmp_path, tiny_target_dir, "export")
    recorded = json.loads((export / "config.json").read_text())["draftling"]["target_fingerprint"]
    assert recorded["rope"] == rope_params(load_target_config(str(tiny_target_dir)))
    assert recorded["rope"]["rope_theta"] is not None  # read from rope_parameters under transformers 5
    assert main(["check", str(export), "--target", str(tiny_target_dir)]) == 0
    capsys.readouterr()
    for i, rope in enumerate(
        [
            {"rope_type": "linear", "factor": 2.0, "rope_theta": recorded["rope"]["rope_theta"]},
            {"rope_type": "default", "rope_theta": 1234.0},
        ]
    ):
        scaled = _changed_target(tmp_path, tiny_target_dir, f"rope{i}", {"rope_parameters": rope, "rope_scaling": rope})
        assert main(["check", str(export), "--target", str(scaled)]) == 2
        err = capsys.readouterr().err.strip()
        assert "target rope: recorded" in err and "\n" not in err
        assert ('"factor": 2.0' in err) if i == 0 else ('"rope_theta": 1234.0' in err)


def test_a_changed_weight_fails_check_only_where_both_carry_a_weight_fingerprint(tmp_path, tiny_target_dir, capsys):
    plain = _tiny_export(tmp_path, tiny_target_dir, "plain")
    weighed = _tiny_export(tmp_path, tiny_target_dir, "weighed", "--weight-fingerprint")
    assert "weights" not in json.loads((plain / "config.json").read_text())["draftling"]["target_fingerprint"]
    assert main(["check", str(weighed), "--target", str(tiny_target_dir)]) == 0
    assert "ok: target weights hash: recorded" in capsys.readouterr().out
    retrained = _changed_target(tmp_path, tiny_target_dir, "retrained", weight=True)
    assert main(["check", str(weighed), "--target", str(retrained)]) == 2
    err = capsys.readouterr().err.strip()
    assert "target weights hash: recorded" in err and "config hash" not in err and "\n" not in err
    assert main(["check", str(plain), "--target", str(retrained)]) == 0  # neither side hashes weights
    assert "no weight fingerprint recorded" in capsys.readouterr().out


def test_the_weight_hash_ignores_the_load_dtype_and_sees_one_changed_tensor(tiny_target_dir):
    from draftling.target.fingerprint import weight_hash

    model = LlamaForCausalLM.from_pretrained(tiny_target_dir)
    h = weight_hash(model)
    assert weight_hash(LlamaForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.bfloat16)) == h
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # 64 elements: the whole tensor is the sample
    assert weight_hash(model) != h


def test_weight_fingerprint_needs_the_target_and_the_sglang_format(tmp_path):
    from draftling.export.cli import check_weight_fingerprint

    with pytest.raises(DraftlingError, match="needs --target"):
        check_weight_fingerprint(True, "sglang", False)
    with pytest.raises(DraftlingError, match="only the sglang format"):
        check_weight_fingerprint(True, "speculators", True)
    check_weight_fingerprint(False, "speculators", False)
