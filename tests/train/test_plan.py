"""train/memory.py and memory_fit.py: the memory estimator's terms against the code they model, and `draftling plan`."""

import argparse
import dataclasses

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from draftling.cli import add_plan_parser, cmd_plan
from draftling.config import parse_size
from draftling.draft.block import BlockDraft, block_config_from_target
from draftling.draft.model import Eagle3Draft, draft_config_from_target
from draftling.train.block_loss import MAX_ANCHORS, block_loss, row_anchors
from draftling.train.memory import GIB, BlockShape, DraftShape, MemoryOptions, estimate_train_memory
from draftling.train.memory_fit import target_param_counts, teacher_weight_bytes
from draftling.train.teacher import TeacherBatch
from draftling.train.ttt import ttt_unroll

SHAPE = DraftShape(hidden=512, intermediate=1536, heads=8, kv_heads=2, head_dim=64, vocab=4000, draft_vocab=1000)
B, T, S = 2, 256, 4


def est(shape=SHAPE, batch=B, seq=T, steps=S, **changes):
    return estimate_train_memory(shape, batch, seq, steps, dataclasses.replace(MemoryOptions(), **changes))


def shape_config(shape=SHAPE, layers=6):
    """A target's Llama config (no weights) whose draft has ``shape``."""
    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_hidden_layers=layers,
    )


# --- parameter counts are exact ------------------------------------------------------------


def test_draft_param_count_matches_eagle3draft():
    cfg = shape_config()
    draft = Eagle3Draft(draft_config_from_target(cfg, SHAPE.draft_vocab, [2, 3, 4]))
    real = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    assert DraftShape.from_config(cfg, SHAPE.draft_vocab) == SHAPE
    assert SHAPE.num_params() == real
    assert est()["num_params"] == real


@pytest.mark.parametrize("layers,intermediate", [(1, None), (3, 700)])
def test_block_param_count_matches_blockdraft(layers, intermediate):
    from draftling.config import load_config
    from draftling.train.memory_fit import draft_shape

    cfg = shape_config()
    config = block_config_from_target(cfg, SHAPE.draft_vocab, [2, 3, 4], 5, layers, 0)
    config.intermediate_size = intermediate or config.intermediate_size
    real = sum(p.numel() for p in BlockDraft(config).parameters() if p.requires_grad)
    shape = BlockShape.from_block_config(config, MAX_ANCHORS)
    assert shape.num_params() == real and (shape.layers, shape.block_size) == (layers, 5)
    run = ["draft.method=dflash", f"draft.layers={layers}", "train.ttt_steps=4", f"vocab.size={SHAPE.draft_vocab}"]
    run += [f"draft.intermediate_size={intermediate}"] if intermediate else []
    assert draft_shape(load_config(None, run), cfg) == shape  # what `draftling plan` builds


@pytest.mark.parametrize(
    "build",
    [
        lambda: LlamaForCausalLM(
            LlamaConfig(
                vocab_size=500,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=False,
            )
        ),
        lambda: LlamaForCausalLM(
            LlamaConfig(
                vocab_size=500,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                tie_word_embeddings=True,
            )
        ),
        lambda: Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=500,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        ),  # q/k/v biases
        lambda: MixtralForCausalLM(
            MixtralConfig(
                vocab_size=500,
                hidden_size=64,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
            )
        ),
        lambda: Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=500,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
            )
        ),  # q/k norms
        lambda: LlamaForCausalLM(
            LlamaConfig(
                vocab_size=500,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                attention_bias=True,
                mlp_bias=True,
            )
        ),
    ],
    ids=["llama", "llama-tied", "qwen2-bias", "mixtral-moe", "qwen3", "llama-biases"],
)
def test_teacher_param_count_matches_hf_model(build):
    torch.manual_seed(0)
    model = build()
    assert sum(target_param_counts(model.config).values()) == sum(p.numel() for p in model.parameters())


def test_teacher_weight_bytes_by_dtype_and_quantization():
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        tie_word_embeddings=False,
    )
    counts = target_param_counts(cfg)
    n = sum(counts.values())
    assert teacher_weight_bytes(cfg, "bfloat16") == 2 * n
    assert teacher_weight_bytes(cfg, "float32") == 4 * n
    # 4-bit: the decoder weights at 4.5 bits, embedding and head stay in the compute dtype.
    four = teacher_weight_bytes(cfg, "bfloat16", quantization="bnb-4bit")
    assert four == int(
        counts["layers"] * 4.5 / 8 + 2 * (counts["embedding"] + counts["lm_head"] + counts["final_norm"])
    )
    assert teacher_weight_bytes(cfg, "bfloat16", bits=4.5) == four
    assert four < teacher_weight_bytes(cfg, "bfloat16", quantization="bnb-8bit") < 2 * n


# --- each option moves the terms it should ------------------------------------------------


def test_optimizer_offload_moves_the_state_to_the_host():
    P = SHAPE.num_params()
    on = est(optimizer_offload=True, draft_dtype="bfloat16")
    off_bf16 = est(optimizer_offload=False, draft_dtype="bfloat16")
    off_fp32 = est(optimizer_offload=False, draft_dtype="float32")  # what auto picks without offload
    assert on["optimizer_state"] == 0 and on["host"]["optimizer"] == 16 * P
    assert off_bf16["optimizer_state"] == 4 * P and off_bf16["host"]["optimizer"] == 0  # two bf16 moments
    assert off_fp32["optimizer_state"] == 8 * P
    assert on["phases"]["optimizer_step"] < off_bf16["phases"]["optimizer_step"] < off_fp32["phases"]["optimizer_step"]


def test_draft_dtype_sets_params_and_grads():
    P = SHAPE.num_params()
    for dtype, nbytes in (("bfloat16", 2), ("float32", 4)):
        e = est(draft_dtype=dtype, grad_checkpoint=False)
        assert e["draft_params"] == nbytes * P
        phases = estimate_train_memory(SHAPE, B, T, S, dataclasses.replace(MemoryOptions(), draft_dtype=dtype))
        assert phases["phases"]["build"] >= 4 * P  # placed in fp32, then cast


def test_embedding_on_host_removes_the_table_unless_the_teacher_holds_it():
    on_host, on_device = est(embedding_on_host=True), est(embedding_on_host=False)
    assert on_host["embedding"] == 0 and on_host["host"]["embedding"] == SHAPE.vocab * SHAPE.hidden * 2
    assert on_device["embedding"] == SHAPE.vocab * SHAPE.hidden * 2
    shared = estimate_train_memory(
        SHAPE, B, T, S, dataclasses.replace(MemoryOptions(), embedding_on_host=False), embedding_in_teacher=True
    )
    assert shared["embedding"] == 0


def test_loss_chunking_makes_activations_independent_of_the_draft_vocab():
    wide = dataclasses.replace(SHAPE, draft_vocab=2 * SHAPE.draft_vocab)
    chunked = est()["activations_saved"], est(shape=wide)["activations_saved"]
    plain = est(loss_chunk_tokens=0)["activations_saved"], est(shape=wide, loss_chunk_tokens=0)["activations_saved"]
    assert chunked[0] == chunked[1]
    # Unchunked, every step keeps log-softmax and teacher softmax in fp32 for every token.
    assert plain[1] - plain[0] == S * B * T * 8 * SHAPE.draft_vocab
    assert chunked[0] < plain[0]


def test_grad_checkpoint_keeps_only_step_inputs():
    wide = dataclasses.replace(SHAPE, intermediate=2 * SHAPE.intermediate)
    ckpt = est()["activations_saved"], est(shape=wide)["activations_saved"]
    full = est(grad_checkpoint=False)["activations_saved"], est(shape=wide, grad_checkpoint=False)["activations_saved"]
    assert ckpt[0] == ckpt[1]  # the MLP's activations are recomputed, not kept
    assert full[1] - full[0] == S * B * T * 2 * 2 * SHAPE.intermediate  # compiled: gate and up in bf16
    eager = [est(shape=x, grad_checkpoint=False, compile_layer=False)["activations_saved"] for x in (SHAPE, wide)]
    assert eager[1] - eager[0] == S * B * T * 4 * 2 * SHAPE.intermediate  # gate, silu, up, product
    assert ckpt[0] < full[0] < eager[0]


def test_flex_avoids_the_quadratic_scores_of_sdpa():
    def extra(attention, seq):
        return est(attention=attention, seq=seq)["total"]

    flex_growth = extra("flex", 2 * T) / extra("flex", T)
    sdpa_growth = extra("sdpa", 2 * T) / extra("sdpa", T)
    assert extra("sdpa", T) > extra("flex", T)
    assert sdpa_growth > flex_growth


def test_compile_shrinks_the_loss_chunk():
    assert est(compile=True)["phases"]["loss_backward"] < est(compile=False)["phases"]["loss_backward"]
    assert est(compile=True, loss_chunk_tokens=0)["total"] == est(compile=False, loss_chunk_tokens=0)["total"]


def test_fsdp_wrapper_costs_memory_at_world_size_one():
    """For a param-heavy draft the fp32 grad reduce of the wrapper sets the peak."""
    big = DraftShape(
        hidden=5120, intermediate=27648, heads=64, kv_heads=8, head_dim=128, vocab=155136, draft_vocab=32000
    )
    plain, fsdp = est(shape=big, batch=1, seq=2048, steps=7), est(shape=big, batch=1, seq=2048, steps=7, fsdp=True)
    assert "fsdp_reduce" in fsdp["phases"] and "fsdp_reduce" not in plain["phases"]
    assert fsdp["total"] > plain["total"] and fsdp["peak_phase"] == "fsdp_reduce"
    assert fsdp["phases"]["fsdp_reduce"] >= 8 * big.num_params()  # fp32 reduce input and output


def test_teacher_outputs_and_weights_are_counted():
    tok = B * T
    outputs = tok * (
        3 * SHAPE.hidden * 2 + 2 * SHAPE.draft_vocab + 17
    )  # aux and logits bf16 (the teacher dtype), argmaxes
    offline = estimate_train_memory(SHAPE, B, T, S, MemoryOptions(), teacher_weight_bytes=10 * GIB)
    assert offline["teacher_outputs"] == outputs and "teacher_forward" not in offline["phases"]
    e = estimate_train_memory(SHAPE, B, T, S, MemoryOptions(), teacher_weight_bytes=10 * GIB, teacher_forward_bytes=GIB)
    assert e["teacher_weights"] == 10 * GIB
    assert e["phases"]["teacher_forward"] == e["draft_params"] + 10 * GIB + GIB + outputs
    assert e["total"] == max(e["phases"].values())
    assert e["total"] == sum(
        e[k]
        for k in (
            "draft_params",
            "draft_grads",
            "optimizer_state",
            "embedding",
            "teacher_weights",
            "teacher_outputs",
            "activations",
            "transient",
        )
    )


def test_peak_grows_with_sequence_length():
    totals = [est(seq=t)["total"] for t in (128, 256, 512, 1024)]
    assert totals == sorted(totals) and totals[-1] > totals[0]


def test_parse_size():
    assert parse_size("80GiB") == 80 * GIB
    assert parse_size("141") == 141 * GIB
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5G") == int(1.5 * GIB)
    with pytest.raises(ValueError):
        parse_size("lots")


# --- the estimate against what autograd actually keeps (CPU, eager SDPA, fp32) --------------


def _profiled(fn):
    """(bytes alive at the end, peak bytes) of CPU allocations made inside fn."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return now, peak


@pytest.mark.parametrize("ckpt,chunk", [(False, 0), (False, 64), (True, 0), (True, 64)])
def test_estimate_tracks_what_the_unroll_keeps(ckpt, chunk, one_thread):
    """Saved activations within 20% of the bytes the forward leaves for backward, and the peak
    of forward + backward within 30%, measured with the profiler's allocation events."""
    shape = DraftShape(hidden=256, intermediate=768, heads=4, kv_heads=2, head_dim=64, vocab=2000, draft_vocab=1024)
    b, t, steps = 2, 128, 4
    cfg = shape_config(shape)
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_config_from_target(cfg, shape.draft_vocab, [2, 3, 4]))
    t2d = torch.zeros(shape.vocab, dtype=torch.bool)
    t2d[: shape.draft_vocab] = True
    draft.set_vocab(torch.zeros(shape.draft_vocab, dtype=torch.long), t2d)
    embed = torch.nn.Embedding(shape.vocab, shape.hidden).requires_grad_(False)
    teacher = TeacherBatch(
        torch.randn(b, t, 3 * shape.hidden),
        torch.randn(b, t, shape.draft_vocab),
        torch.zeros(b, t, dtype=torch.long),
        torch.ones(b, t, dtype=torch.bool),
    )
    ids = torch.randint(0, shape.vocab, (b, t))
    ones = torch.ones_like(ids)
    out = {}

    def forward():
        out["loss"], _ = ttt_unroll(
            draft, embed, teacher, ids, ones, ones, steps, grad_checkpoint=ckpt, loss_chunk_tokens=chunk
        )

    saved, fwd_peak = _profiled(forward)
    _, bwd_peak = _profiled(lambda: out["loss"].backward())
    measured_peak = max(fwd_peak, saved + bwd_peak)
    opts = MemoryOptions(
        embedding_on_host=False,
        loss_chunk_tokens=chunk,
        grad_checkpoint=ckpt,
        attention="sdpa",
        compile=False,
        compile_layer=False,
        draft_dtype="float32",
        embed_dtype="float32",
    )
    e = estimate_train_memory(shape, b, t, steps, opts, embedding_in_teacher=True)
    # Measured from the start of the step: params and the teacher's outputs were there before
    # (the unroll's own argmax of the teacher logits, 8 bytes/token, is new).
    estimated_peak = e["total"] - e["draft_params"] - e["teacher_outputs"] + b * t * 8
    assert abs(e["activations_saved"] - saved) <= 0.2 * saved
    assert abs(estimated_peak - measured_peak) <= 0.3 * measured_peak


@pytest.mark.parametrize(
    "dtype,layers,block,intermediate,draft_vocab",
    [
        ("float32", 2, 4, 768, 1024),
        ("bfloat16", 1, 8, 768, 1024),
        ("float32", 1, 4, 2048, 128),  # a narrow vocab: the layer backward sets the peak
    ],
)
def test_block_estimate_tracks_what_block_loss_keeps(dtype, layers, block, intermediate, draft_vocab, one_thread):
    """A dflash head: the same bounds as the unroll's (saved within 20%, peak within 30%),
    measured the same way over one real step of block_loss."""
    shape = BlockShape(
        hidden=256,
        intermediate=intermediate,
        heads=4,
        kv_heads=2,
        head_dim=64,
        vocab=2000,
        draft_vocab=draft_vocab,
        layers=layers,
        block_size=block,
        anchors=MAX_ANCHORS,
    )
    b, t, dt = 2, 128, getattr(torch, dtype)
    torch.manual_seed(0)
    config = block_config_from_target(shape_config(shape), draft_vocab, [2, 3, 4], block, layers, 0)
    draft = BlockDraft(config).to(dt)
    t2d = torch.zeros(shape.vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    draft.set_vocab(torch.zeros(draft_vocab, dtype=torch.long), t2d)
    assert shape.num_params() == sum(p.numel() for p in draft.parameters())
    embed = torch.nn.Embedding(shape.vocab, shape.hidden).requires_grad_(False).to(dt)
    aux, logits = torch.randn(b, t, 3 * shape.hidden, dtype=dt), torch.randn(b, t, draft_vocab, dtype=dt)
    teacher = TeacherBatch(aux, logits, torch.zeros(b, t, dtype=torch.long), torch.ones(b, t, dtype=torch.bool))
    ids = torch.randint(0, shape.vocab, (b, t))
    ones = torch.ones_like(ids)
    anchors = row_anchors(ids, ones, ones)
    out = {}

    def forward():
        out["loss"] = block_loss(draft, embed, ids, ones, ones, teacher, anchors).loss

    saved, fwd_peak = _profiled(forward)
    _, bwd_peak = _profiled(lambda: out["loss"].backward())
    measured_peak = max(fwd_peak, saved + bwd_peak)
    opts = MemoryOptions(embedding_on_host=False, draft_dtype=dtype, embed_dtype=dtype)
    e = estimate_train_memory(shape, b, t, block - 1, opts, embedding_in_teacher=True)
    estimated_peak = e["total"] - e["draft_params"] - e["teacher_outputs"]  # what the step itself allocates
    assert abs(e["activations_saved"] - saved) <= 0.2 * saved
    assert abs(estimated_peak - measured_peak) <= 0.3 * measured_peak


def test_unroll_options_do_not_reach_a_block_estimate():
    shape = BlockShape(**dataclasses.asdict(SHAPE), layers=2, block_size=8)
    plain = estimate_train_memory(shape, B, T, 7, MemoryOptions())
    off = {"grad_checkpoint": False, "loss_chunk_tokens": 0, "compile": False, "compile_layer": False}
    assert est(shape, steps=7, attention="sdpa", **off) == plain
    assert plain["peak_phase"] == "loss_forward"  # all slots' fp32 logits
    wide = est(dataclasses.replace(shape, draft_vocab=2 * SHAPE.draft_vocab), steps=7)["phases"]["loss_forward"]
    assert wide - plain["phases"]["loss_forward"] > 4 * B * MAX_ANCHORS * 8 * SHAPE.draft_vocab


# --- `draftling plan` ------------------------------------------------------------------------


def _plan(argv):
    parser = argparse.ArgumentParser(prog="draftling")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    return cmd_plan(parser.parse_args(["plan", *argv]))


@pytest.fixture
def llama_config_dir(tmp_path):
    """A Llama config.json alone (no weights, no tokenizer): all `draftling plan` reads."""
    LlamaConfig(
        vocab_size=3000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path)
    return str(tmp_path)


def test_plan_cli_fits_and_exits_zero(llama_config_dir, capsys):
    rc = _plan(
        [
            "--target",
            llama_config_dir,
            "--gpu-mem",
            "4GiB",
            "--seq",
            "128",
            "--batch-size",
            "2",
            "vocab.size=512",
            "dtype=bfloat16",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "fits:" in out and "does NOT fit" not in out
    for row in (
        "teacher weights",
        "draft params",
        "draft grads",
        "optimizer state",
        "activations",
        "total",
        "headroom",
    ):
        assert row in out
    assert "largest batch size that fits at seq 128:" in out


def test_plan_cli_does_not_fit_and_exits_one(llama_config_dir, capsys):
    rc = _plan(
        [
            "--target",
            llama_config_dir,
            "--gpu-mem",
            "600MiB",
            "--seq",
            "2048",
            "--batch-size",
            "64",
            "vocab.size=512",
            "dtype=bfloat16",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert "does NOT fit" in out and "short by" in out


def test_plan_cli_options_follow_overrides(llama_config_dir, capsys):
    base = ["--target", llama_config_dir, "--gpu-mem", "80GiB", "--seq", "256", "--batch-size", "2", "vocab.size=512"]
    _plan(base + ["train.optimizer_offload=true"])
    on = capsys.readouterr().out
    _plan(base + ["train.optimizer_offload=false", "train.grad_checkpoint=false", "train.attention=sdpa"])
    off = capsys.readouterr().out
    assert "optimizer_offload on" in on and "(bfloat16)" in on and "host RAM" in on
    assert "optimizer_offload off" in off and "grad_checkpoint off" in off and "attention sdpa" in off
    assert "(float32)" in off


def test_plan_follows_the_auto_memory_policy(llama_config_dir, capsys):
    """memory_policy=auto trains without recompute when that fits; the plan estimates what the
    trainer will run, not the configured fallback."""

    def base(mem):
        return ["--target", llama_config_dir, "--seq", "256", "--batch-size", "2", "--gpu-mem", mem, "vocab.size=512"]

    _plan(base("80GiB"))
    roomy = capsys.readouterr().out
    assert "grad_checkpoint off" in roomy and "memory policy: fast" in roomy
    assert "loss_chunk_tokens 16384" in roomy
    _plan(base("80GiB") + ["train.memory_policy=config"])
    configured = capsys.readouterr().out
    assert "grad_checkpoint on" in configured and "memory policy: as configured" in configured
    _plan(base("530MiB"))  # too tight for the fast settings: the configured ones
    tight = capsys.readouterr().out
    assert "grad_checkpoint on" in tight and "memory policy: as configured" in tight


def test_plan_cli_rejects_a_bad_size(llama_config_dir):
    from draftling.errors import ConfigError

    with pytest.raises(ConfigError, match="gpu-mem"):
        _plan(["--target", llama_config_dir, "--gpu-mem", "huge"])


def test_plan_estimates_a_dflash_head(llama_config_dir, capsys):
    """A dflash head is planned with its own shape and the options its block loss runs with."""
    base = ["--target", llama_config_dir, "--gpu-mem", "4GiB", "--seq", "256", "--batch-size", "2", "vocab.size=512"]
    assert _plan(base + ["draft.method=dflash", "draft.layers=2"]) == 0
    out = capsys.readouterr().out
    assert "fits:" in out and "grad_checkpoint off" in out and "loss_chunk_tokens 0" in out
    assert "memory policy: as configured (a dflash head" in out and "peak: loss forward" in out
    assert "saved for backward over the block loss" in out
    from draftling.config import load_config
    from draftling.train.memory_fit import plan_run

    def total(*overrides):
        cfg = load_config(None, ["draft.method=dflash", "vocab.size=512", *overrides])
        return plan_run(cfg, LlamaConfig.from_pretrained(llama_config_dir), 4 * GIB, 256, 2)["estimate"]["total"]

    assert total("draft.layers=1") < total("draft.layers=2")
    assert total("train.ttt_steps=3") < total("train.ttt_steps=7")  # a block of ttt_steps + 1


def test_plan_is_wired_into_the_cli(llama_config_dir, capsys):
    from draftling import cli

    if "plan" not in cli.COMMANDS:
        pytest.skip("`plan` is not wired into draftling.cli yet")
    rc = cli.main(
        [
            "plan",
            "--target",
            llama_config_dir,
            "--gpu-mem",
            "600MiB",
            "--seq",
            "2048",
            "--batch-size",
            "64",
            "vocab.size=512",
        ]
    )
    assert rc == 1 and "does NOT fit" in capsys.readouterr().out


def test_a_window_bounds_the_sdpa_attention_estimate_and_the_draft_width_counts():
    windowed = dataclasses.replace(SHAPE, window=256)
    full = {t: est(seq=t, attention="sdpa", grad_checkpoint=False)["total"] for t in (8192, 32768)}
    band = {t: est(windowed, seq=t, attention="sdpa", grad_checkpoint=False)["total"] for t in (8192, 32768)}
    assert band[32768] < full[32768] / 10  # the [T, T] probabilities are gone
    assert 3 < band[32768] / band[8192] < 5  # linear in the length, as the banded attention is
    from draftling.config import load_config
    from draftling.train.memory_fit import plan_run

    cfg = load_config(None, ["draft.intermediate_size=4096", "draft.window=512", "vocab.size=1000"])
    target = shape_config(SHAPE, layers=8)
    wide = plan_run(cfg, target, 80 * GIB, seq=2048, batch=4)
    narrow = plan_run(load_config(None, ["draft.window=512", "vocab.size=1000"]), target, 80 * GIB, seq=2048, batch=4)
    assert wide["shape"].intermediate == 4096 and wide["shape"].window == 512
    assert wide["estimate"]["total"] > narrow["estimate"]["total"]  # draft.intermediate_size reaches the estimate
