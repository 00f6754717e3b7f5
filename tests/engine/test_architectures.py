"""Every architecture family the engine claims, on tiny random fp32 configs built here (CPU).

Per architecture: the engine's plain output equals HF generate's greedy output, speculative
chain and tree output (greedy, and sampled with top_k=1) equal plain output, batched
decoding equals batch-1 decoding, the aux states the engine and training capture equal HF's
hidden_states, a 2-step training run works, and an SGLang export round-trips. Sliding-window
configs (gemma3, gpt_oss, phi3, mistral) use a window of 8 under a 13-token prompt and 24
new tokens, so the window cuts in both in prefill and in decoding. A model type the
installed transformers lacks is skipped with the reason.
"""

import logging
import types

import pytest
import torch
import transformers

from draftling.engine import DraftRunner, GeneralCachedTarget, build_target, greedy_generate, speculative_generate
from draftling.engine.generate import batch_generate
from draftling.engine.target_model import CachedTarget, UnsupportedArchitecture, causal_mask
from draftling.export import export_sglang, load_sglang_export
from draftling.target.aux import aux_hidden_states
from draftling.target.load import wrap_target
from tests.conftest import TINY_VOCAB, setup_data
from tests.helpers import AUX, TOY_TOKEN_IDS, TREES, oracle_draft, random_draft, run_draft, tiny, train_run
from tests.host_reads import HostReads

pytestmark = pytest.mark.usefixtures("one_thread")

V, PROMPT, NEW, WINDOW, SIZE = TINY_VOCAB, 13, 24, 8, 80
SLIDING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
# model_type: (config class, model class, config overrides, engine path)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, CachedTarget),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, CachedTarget),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        },
        GeneralCachedTarget,
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW, "layer_types": SLIDING},
        GeneralCachedTarget,
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": WINDOW}, GeneralCachedTarget),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {"head_dim": 16}, GeneralCachedTarget),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {  # MLA: key head dim 24, value 12
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 12,
            "num_key_value_heads": 4,
        },
        GeneralCachedTarget,
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {  # attention sinks, sliding layers, MoE
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": SLIDING,
        },
        GeneralCachedTarget,
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}, GeneralCachedTarget),
}


def build(arch, seed=0, **extra):
    cfg_name, model_name, over, _ = ARCHS[arch]
    if not hasattr(transformers, cfg_name) or not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    model_cls, cfg_cls = getattr(transformers, model_name), getattr(transformers, cfg_name)
    model = tiny(model_cls, cfg_cls, seed, **{**TOY_TOKEN_IDS, **over, **extra})
    with torch.no_grad():  # HF zero-inits these; make them matter
        for name, p in model.named_parameters():
            if name.endswith(("sinks", ".bias")):
                p.normal_(0, 0.5)
    return model


def prompt(n=PROMPT, seed=1):
    return torch.randint(3, V, (1, n), generator=torch.Generator().manual_seed(seed))


_CACHE: dict = {}


def model_and_plain(arch):
    """(model, engine, plain engine tokens [1, NEW]), made once per architecture."""
    if arch not in _CACHE:
        model = build(arch)
        target = build_target(model, AUX, SIZE)
        _CACHE[arch] = model, target, greedy_generate(target, prompt(), NEW)
    return _CACHE[arch]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_plain_engine_equals_hf_generate(arch):
    model, target, plain = model_and_plain(arch)
    assert type(target) is ARCHS[arch][3]
    with torch.no_grad():
        ref = model.generate(prompt(), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None)
    assert plain[0].tolist() == ref[0, PROMPT:].tolist()


@pytest.mark.parametrize("tree", TREES, ids=lambda t: "-".join(map(str, t)))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_speculative_equals_plain(arch, tree):
    model, target, plain = model_and_plain(arch)
    draft = DraftRunner(random_draft(model), model.get_input_embeddings(), SIZE)
    out, stats = speculative_generate(target, draft, prompt(), NEW, *tree)
    assert out.tolist() == plain.tolist()
    # Sampling with top_k=1 is greedy: the lossless acceptance path must agree too.
    out, _ = speculative_generate(
        target, draft, prompt(), NEW, *tree, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0)
    )
    assert out.tolist() == plain.tolist()
    assert_committed_cache_is_fresh(model, target, torch.cat([prompt(), plain], 1), stats.cache_len)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_speculative_with_an_accepting_draft(arch):
    """A random draft accepts almost nothing, so trees would never be compacted. Scaled-up
    embeddings make the target nearly layer-free, which ``oracle_draft`` predicts: long
    accepted paths, moved K/V (checked against a fresh prefill, layer by layer)."""
    accepting_draft_decodes_as_plain(arch)


@pytest.mark.parametrize("arch", ["gemma3", "deepseek_v3", "gpt_oss"])
def test_accepting_draft_as_under_graph_capture(arch, as_captured):
    """The same, with every graphed function's first call run three times, as CUDA-graph
    capture does (the as_captured fixture): per-layer cache shapes survive the repeats."""
    accepting_draft_decodes_as_plain(arch)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_accepting_draft_compiled_and_padded(arch):
    """The GPU's engine settings, compiled, on the CPU: the warm-up traces a plain step whose
    positions and cache slots are one tensor; a tree's nodes have slots beside their positions.
    Before 2026-12-03 the compiled forward kept reading slots = positions, so trees decoded
    wrong tokens (the Gemma 3 270M release bench: 0 of 56 tree outputs equal plain)."""
    accepting_draft_decodes_as_plain(arch, compile=True, query_pad=16, attention="exact")


def accepting_draft_decodes_as_plain(arch, **engine):
    model = build(arch)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(30.0)
    target = build_target(model, AUX, SIZE, **engine)
    plain = greedy_generate(target, prompt(), NEW)
    draft = oracle_draft(model, num_key_value_heads=4, num_attention_heads=4, head_dim=16)  # any target's heads
    runner = DraftRunner(draft, model.get_input_embeddings(), SIZE)
    for tree in TREES:
        out, stats = speculative_generate(target, runner, prompt(), NEW, *tree)
        assert out.tolist() == plain.tolist(), tree
        assert stats.compactions > 0 or tree[1] == 1
        assert_committed_cache_is_fresh(model, target, torch.cat([prompt(), plain], 1), stats.cache_len)
        out, _ = speculative_generate(
            target, runner, prompt(), NEW, *tree, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0)
        )
        assert out.tolist() == plain.tolist(), tree


@pytest.mark.parametrize("arch", ["gemma3", "mistral", "phi3", "gpt_oss"])
def test_padded_exact_engine_equals_plain(arch):
    """The GPU's engine settings (every pass padded to 16 queries, exact attention) on the
    sliding-window architectures: pad rows must not go NaN where a window leaves their mask
    empty (exact attention would spread it from the pad slots), so the tokens equal plain."""
    model, _, plain = model_and_plain(arch)
    target = build_target(model, AUX, SIZE, query_pad=16, attention="exact")
    assert greedy_generate(target, prompt(), NEW).tolist() == plain.tolist()
    draft = DraftRunner(random_draft(model), model.get_input_embeddings(), SIZE)
    out, _ = speculative_generate(target, draft, prompt(), NEW, 3, 4, 8)
    assert out.tolist() == plain.tolist()


def assert_committed_cache_is_fresh(model, target, seq, n):
    """The committed cache prefix equals a fresh prefill of the emitted text: compaction moved
    the right K/V in every layer, whatever its shape."""
    fresh = build_target(model, AUX, SIZE)
    pos = torch.arange(n)
    with torch.no_grad():
        fresh(seq[:, :n], pos, pos, causal_mask(0, n, SIZE, "cpu"))
    for i in range(len(target.layers)):
        for got, want in zip(target.kv(i), fresh.kv(i)):
            torch.testing.assert_close(got[:, :, :n], want[:, :, :n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_batched_equals_batch_one(arch):
    model, _, _ = model_and_plain(arch)
    prompts = [prompt(n, seed=n) for n in (13, 5, 10)]
    want = [greedy_generate(build_target(model, AUX, SIZE), p, 12)[0].tolist() for p in prompts]
    target = build_target(model, AUX, SIZE, batch_size=2)
    assert [r.tokens for r in batch_generate(target, [p[0] for p in prompts], 12)] == want
    draft = DraftRunner(random_draft(model), model.get_input_embeddings(), SIZE, batch_size=2)
    got = batch_generate(target, [p[0] for p in prompts], 12, draft=draft, tree=(3, 4, 8))
    assert [r.tokens for r in got] == want


def test_regeneration_engine_serves_a_general_path_target():
    """data.regen.engine=on takes any architecture the engine serves; auto keeps HF generate
    for the general path (its regeneration speed is not yet measured against HF generate)."""
    from draftling.config import DataConfig, RegenConfig
    from draftling.engine.replies import reply_engine_for

    model, _, _ = model_and_plain("gemma3")
    target = wrap_target(model, types.SimpleNamespace(pad_token_id=0, eos_token_id=1), name="tiny-gemma3")
    assert reply_engine_for(DataConfig(regen=RegenConfig(engine="auto")), target) is None
    replies = reply_engine_for(DataConfig(regen=RegenConfig(engine="on", batch_size=2)), target)
    prompts = [prompt(n, seed=n)[0].tolist() for n in (13, 5, 10)]
    want = [greedy_generate(build_target(model, AUX, SIZE), torch.tensor(p), 12)[0].tolist() for p in prompts]
    assert [r for r, stop in replies(model)(prompts, 12, None)] == want


@pytest.mark.parametrize("arch", list(ARCHS))
def test_aux_states_match_hf_hidden_states(arch):
    model, target, _ = model_and_plain(arch)
    ids = prompt()
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
        _, captured = aux_hidden_states(model, AUX, input_ids=ids)
        pos = torch.arange(PROMPT)
        _, aux = target(ids, pos, pos, causal_mask(0, PROMPT, SIZE, "cpu"))
    want = [ref[i] for i in AUX]
    for got, w in zip(captured, want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=0)
    torch.testing.assert_close(aux, torch.cat(want, -1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_two_training_steps_and_export_round_trip(arch, tmp_path):
    model = build(arch)
    target = wrap_target(
        model, types.SimpleNamespace(pad_token_id=0, eos_token_id=1), name=f"tiny-{arch}", aux_layer_ids=AUX
    )
    setup_data(tmp_path)
    result = train_run(tmp_path, target, "run", 2)
    assert result is not None
    from draftling.draft.store import load_draft

    draft = load_draft(tmp_path / "run" / "draft").eval()
    assert draft.config.eagle_aux_hidden_state_layer_ids == AUX
    loaded = load_sglang_export(export_sglang(draft, tmp_path / "sgl", trained_on_default_layers=False, dtype="keep"))
    ids = prompt()
    assert torch.equal(run_draft(draft, model, ids), run_draft(loaded, model, ids))


def test_general_path_equals_fast_path_on_llama_family():
    for arch in ("llama", "qwen3"):
        model = build(arch)
        fast, general = CachedTarget.from_hf(model, AUX, SIZE), GeneralCachedTarget.from_hf(model, AUX, SIZE)
        ids, pos = prompt(), torch.arange(PROMPT)
        with torch.no_grad():
            for got, want in zip(
                general(ids, pos, pos, causal_mask(0, PROMPT, SIZE, "cpu")),
                fast(ids, pos, pos, causal_mask(0, PROMPT, SIZE, "cpu")),
            ):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert greedy_generate(general, ids, NEW).tolist() == greedy_generate(fast, ids, NEW).tolist()


GENERAL = [arch for arch, spec in ARCHS.items() if spec[3] is GeneralCachedTarget]
LOGGER = "draftling.engine.general_target"


@pytest.mark.slow  # compiles on the CPU: 5-25 s each on 2 cores
@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral", "qwen3_moe", "gpt_oss"])
def test_general_path_compiled_equals_eager(arch, caplog):
    """The whole forward compiled (inductor, dynamic=False) on the CPU, fp32: the greedy tokens,
    then one more decode pass's logits, aux states and every layer's K/V equal the eager
    engine's. Llama takes the general path here on purpose."""
    model = build(arch)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        compiled = GeneralCachedTarget.from_hf(model, AUX, SIZE, compile=True)
    assert compiled.compile and "runs without" not in caplog.text
    eager = GeneralCachedTarget.from_hf(model, AUX, SIZE)
    out = greedy_generate(compiled, prompt(), NEW)
    assert out.tolist() == greedy_generate(eager, prompt(), NEW).tolist()
    n = PROMPT + NEW - 1  # the last token's slot: a pass of greedy_step's shapes (no recompile)
    pos, mask = torch.tensor([[n]]), torch.arange(SIZE)[None, None] <= n
    with torch.no_grad():
        for got, want in zip(compiled.decode(out[:, -1:], pos, pos, mask), eager.decode(out[:, -1:], pos, pos, mask)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for i in range(len(eager.layers)):
        for got, want in zip(compiled.kv(i), eager.kv(i)):
            torch.testing.assert_close(got[:, :, : n + 1], want[:, :, : n + 1], atol=1e-5, rtol=1e-5)


def test_general_path_runs_eager_when_compile_fails(monkeypatch, caplog):
    from draftling.engine import general_target

    def broken(fn):
        def run(*args):
            raise RuntimeError("no compiler here\nmore detail")

        return run

    model, _, plain = model_and_plain("gemma3")
    monkeypatch.setattr(general_target, "compile_once", broken)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        target = build_target(model, AUX, SIZE, compile=True)
    assert not target.compile and not target.options.compile
    assert caplog.text.count("Gemma3ForCausalLM: the general engine path runs without compile") == 1
    assert "no compiler here" in caplog.text and "more detail" not in caplog.text  # one line
    assert greedy_generate(target, prompt(), NEW).tolist() == plain.tolist()
    assert model.config._attn_implementation != "draftling_engine"  # the model's own is back


@pytest.mark.parametrize("arch", GENERAL)
def test_general_decode_step_reads_nothing_back(arch):
    """What a CUDA graph needs of the model's forward, on the CPU: a decode step reads no value
    back to the host (no .item(), nonzero, .tolist()); on CUDA the warm-up checks it for real."""
    _, target, plain = model_and_plain(arch)
    with torch.no_grad(), HostReads() as reads:
        target.fast_greedy(plain[:, -1:], torch.tensor([PROMPT + NEW - 1]))
    assert reads.calls == []


# ---------------------------------------------------------------- CUDA graphs (run on the GPU only)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
# MoE experts run grouped_mm, whose CUDA kernel is bf16 only: in fp32 its fallback reads the group
# sizes back to the host, so graphs are refused there, with the reason logged.
ON_GPU = [
    ("llama", torch.float32),
    ("gemma3", torch.float32),
    ("mistral", torch.float32),
    ("qwen3_moe", torch.bfloat16),
    ("qwen3_moe", torch.float32),
    ("gpt_oss", torch.bfloat16),
]
MAY_REFUSE = {"qwen3_moe", "gpt_oss"}  # the expert kernels decide


def accepting_on_gpu(arch, dtype, **extra):
    """``arch`` with scaled-up embeddings (long accepted paths, so moved K/V) and its oracle
    draft, on the GPU in ``dtype``."""
    model = build(arch, **extra)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(30.0)
    draft = oracle_draft(model, num_key_value_heads=4, num_attention_heads=4, head_dim=16)
    return model.to("cuda", dtype), draft.to("cuda", dtype)


def gpu_engine(model, **mode):
    """The GPU's padded engine (16 queries, exact attention), general path; ``mode``: graphs, compile."""
    return GeneralCachedTarget.from_hf(model, AUX, SIZE, query_pad=16, attention="exact", **mode)


def decode_all(target, draft, ids):
    """Plain greedy tokens, then speculative chain and tree (host and device rounds) tokens
    and accept lengths."""
    runner = DraftRunner(draft, target.embed, SIZE)
    outs = [greedy_generate(target, ids, NEW).tolist()]
    for tree in TREES[:2]:
        for device_rounds in (False, True):
            out, stats = speculative_generate(target, runner, ids, NEW, *tree, device_rounds=device_rounds)
            outs.append((out.tolist(), stats.accept_lengths))
    return outs


@cuda
@pytest.mark.parametrize("arch,dtype", ON_GPU, ids=lambda x: str(x).replace("torch.", ""))
def test_general_path_cuda_graphs_match_eager(arch, dtype, caplog):
    """Graphed decode passes (plain steps, fused rounds, K/V moves) replay what eager runs: token
    for token and round for round. Graphs are off only with the reason logged."""
    model, draft = accepting_on_gpu(arch, dtype)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        graphed = gpu_engine(model, cuda_graphs=True)
    assert graphed.cuda_graphs != ("runs without cuda_graphs" in caplog.text)
    assert graphed.cuda_graphs or arch in MAY_REFUSE, caplog.text
    ids = prompt().cuda()
    got = decode_all(graphed, draft, ids)
    assert got == decode_all(gpu_engine(model), draft, ids)
    if dtype == torch.float32:
        assert_all_plain(got, model, ids)


@cuda
@pytest.mark.parametrize("arch,dtype", ON_GPU, ids=lambda x: str(x).replace("torch.", ""))
def test_general_path_compile_and_graphs_match_compile(arch, dtype, caplog):
    """Compiled and graphed replays what compiled alone runs; in fp32 its greedy tokens also
    equal the eager engine's."""
    model, draft = accepting_on_gpu(arch, dtype)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        both = gpu_engine(model, compile=True, cuda_graphs=True)
    assert both.compile or (arch in MAY_REFUSE and "runs without compile" in caplog.text), caplog.text
    assert both.cuda_graphs or (arch in MAY_REFUSE and "runs without cuda_graphs" in caplog.text), caplog.text
    ids = prompt().cuda()
    got = decode_all(both, draft, ids)
    assert got == decode_all(gpu_engine(model, compile=both.compile), draft, ids)
    if dtype == torch.float32:
        assert_all_plain(got, model, ids)


def assert_all_plain(outs, model, ids):
    """Every decode of ``decode_all`` (plain, chain and tree) equals the eager engine's greedy
    tokens: graphed == eager alone would pass if both decoded trees wrong the same way."""
    plain = greedy_generate(gpu_engine(model), ids, NEW).tolist()
    assert [outs[0]] + [out for out, _ in outs[1:]] == [plain] * len(outs)


@cuda
def test_general_path_refuses_graphs_for_a_host_sync(caplog):
    """Qwen3-MoE's eager experts loop over nonzero() on the host: the warm-up finds the sync,
    graphs are off with the reason in one line, and decoding still equals eager."""
    model, draft = accepting_on_gpu("qwen3_moe", torch.float32, experts_implementation="eager")
    if model.config._experts_implementation != "eager":
        pytest.skip("this transformers has no eager experts implementation to pick")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        target = gpu_engine(model, cuda_graphs=True)
    assert not target.cuda_graphs
    assert caplog.text.count("Qwen3MoeForCausalLM: the general engine path runs without cuda_graphs") == 1
    ids = prompt().cuda()
    assert decode_all(target, draft, ids) == decode_all(gpu_engine(model), draft, ids)


def test_unservable_models_get_one_clear_error():
    if not hasattr(transformers, "MambaForCausalLM"):
        pytest.skip("transformers has no Mamba")
    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=4)
    ).eval()
    with pytest.raises(UnsupportedArchitecture, match="Mamba"):
        build_target(mamba, AUX, SIZE)
    llama = build("llama")
    llama.config.layer_types = ["linear_attention"] * 4
    with pytest.raises(UnsupportedArchitecture, match="linear_attention"):
        build_target(llama, AUX, SIZE)


def test_a_per_layer_type_rope_gives_the_draft_its_own_full_attention_copy():
    """Gemma 3 keeps one RoPE set per layer type; the draft (one layer over the whole context)
    takes the full-attention set, and building it leaves the target's config as it was."""
    import copy

    from draftling.draft.model import draft_config_from_target

    config = build("gemma3").config
    before = copy.deepcopy(config.rope_parameters)
    draft = draft_config_from_target(config, 16, AUX)
    assert config.rope_parameters == before and "rope_theta" not in vars(config)
    assert draft.rope_parameters["rope_theta"] == before["full_attention"]["rope_theta"]
    assert draft.rope_parameters is not config.rope_parameters["full_attention"]
