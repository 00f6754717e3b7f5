"""Memory options of the trainer, each against the plain path on the CPU:
chunked head/loss, checkpointed TTT steps, flex attention, optimizer offload, host embedding."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftling.config import load_config
from draftling.draft.model import repeat_kv
from draftling.errors import ConfigError
from draftling.train.attention import TTTAttention, flex_usable, ttt_attention, ttt_mask_mod
from draftling.train.host_embed import HostEmbedding
from draftling.train.optim import OffloadedAdamW, build_optimizer
from draftling.train.settings import memory_options, optimizer_offload
from draftling.train.teacher import teacher_forward
from draftling.train.ttt import shift_left, ttt_unroll
from tests.conftest import setup_data
from tests.helpers import spaced_vocab_draft as make_draft
from tests.helpers import tiny_llama
from tests.helpers import train_run as run


def setup_unroll(b=3, t=16, seed=3, vocab=64):
    model = tiny_llama()
    draft = make_draft(model, vocab=vocab)
    torch.manual_seed(seed)
    ids = torch.randint(0, 300, (b, t))
    attn = torch.ones_like(ids)
    attn[1, t - 3 :] = 0  # one padded row
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, t // 3 :] = 1
    target = type("T", (), {"model": model, "aux_layer_ids": [2, 3, 4], "output_head": lambda self: model.lm_head})()
    teacher = teacher_forward(target, ids, attn, draft.t2d)
    return model, draft, teacher, ids, loss_mask, attn


def run_unroll(draft, embed, teacher, ids, loss_mask, attn, steps=4, **opts):
    draft.zero_grad(set_to_none=True)
    loss, counts = ttt_unroll(draft, embed, teacher, ids, loss_mask, attn, steps, **opts)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    return loss.detach(), counts, grads


def assert_same(ref, got, loss_exact=False):
    (l0, c0, g0), (l1, c1, g1) = ref, got
    if loss_exact:
        assert torch.equal(l0, l1)
    else:
        torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)
    for name in ("valid", "correct", "chain_valid", "chain_correct"):
        assert getattr(c1, name) == getattr(c0, name), name
    for a, b in zip(c0.loss_sum, c1.loss_sum):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a))


# --- 1. chunked head / loss / metrics ----------------------------------------------------


@pytest.mark.parametrize("chunk", [3, 5, 4096])
def test_chunked_loss_matches_plain(chunk):
    model, draft, teacher, ids, loss_mask, attn = setup_unroll(b=4, t=24)
    embed = model.get_input_embeddings()
    ref = run_unroll(draft, embed, teacher, ids, loss_mask, attn)
    got = run_unroll(draft, embed, teacher, ids, loss_mask, attn, loss_chunk_tokens=chunk)
    assert ref[1].valid[0] > 2 * 5  # several chunks per step for the small sizes
    assert_same(ref, got)


def test_chunked_loss_with_no_valid_token_still_touches_the_head():
    """An all-masked batch must update the same params as the plain path (zero grads,
    not missing ones), or AdamW would treat the head differently."""
    model, draft, teacher, ids, loss_mask, attn = setup_unroll()
    loss_mask = torch.zeros_like(loss_mask)
    embed = model.get_input_embeddings()
    ref = run_unroll(draft, embed, teacher, ids, loss_mask, attn)
    got = run_unroll(draft, embed, teacher, ids, loss_mask, attn, loss_chunk_tokens=8)
    assert got[1].valid == [0, 0, 0, 0]
    assert_same(ref, got)


def test_chunked_loss_keeps_no_full_batch_logits_for_backward():
    """Outside the checkpointed chunks autograd keeps no [B*T, V_draft] tensor (the plain
    path keeps several); inside, a chunk's logits are recomputed in backward."""
    vocab = 96  # a width no other tensor of the tiny model has
    model, draft, teacher, ids, loss_mask, attn = setup_unroll(vocab=vocab)
    b, t = ids.shape

    def biggest_saved(**opts):
        sizes = [0]

        def pack(x):
            if x.dim() and x.shape[-1] == vocab:
                sizes.append(x.numel())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss, _ = ttt_unroll(draft, model.get_input_embeddings(), teacher, ids, loss_mask, attn, 3, **opts)
        loss.backward()
        return max(sizes)

    assert biggest_saved() >= b * t * vocab
    assert biggest_saved(loss_chunk_tokens=8) == 0


def test_chunked_eval_matches_plain_without_grad():
    model, draft, teacher, ids, loss_mask, attn = setup_unroll()
    with torch.no_grad():
        l0, c0 = ttt_unroll(draft, model.get_input_embeddings(), teacher, ids, loss_mask, attn, 3)
        l1, c1 = ttt_unroll(
            draft,
            model.get_input_embeddings(),
            teacher,
            ids,
            loss_mask,
            attn,
            3,
            loss_chunk_tokens=6,
            grad_checkpoint=True,
        )
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    assert c1.correct == c0.correct and c1.chain_correct == c0.chain_correct


# --- 2. gradient checkpointing over the unroll -------------------------------------------


def test_grad_checkpoint_matches_plain():
    model, draft, teacher, ids, loss_mask, attn = setup_unroll()
    embed = model.get_input_embeddings()
    ref = run_unroll(draft, embed, teacher, ids, loss_mask, attn)
    got = run_unroll(draft, embed, teacher, ids, loss_mask, attn, grad_checkpoint=True)
    assert_same(ref, got, loss_exact=True)


def test_autocast_computes_in_bf16_and_stays_close_to_fp32():
    model, draft, teacher, ids, loss_mask, attn = setup_unroll()
    embed = model.get_input_embeddings()
    seen = []
    hook = draft.midlayer.self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ref = run_unroll(draft, embed, teacher, ids, loss_mask, attn)
    got = run_unroll(draft, embed, teacher, ids, loss_mask, attn, autocast="bfloat16")
    hook.remove()
    assert seen == [torch.float32] * 4 + [torch.bfloat16] * 4
    (l0, c0, g0), (l1, c1, g1) = ref, got
    assert not torch.equal(l0, l1)  # bf16 really ran
    torch.testing.assert_close(l1, l0, rtol=2e-2, atol=0)
    assert c1.valid == c0.valid and c1.valid[0] > 0
    assert all(g.dtype == torch.float32 for g in g1.values())  # params and grads stay fp32
    for name in g0:
        cos = F.cosine_similarity(g1[name].flatten(), g0[name].flatten(), dim=0)
        assert cos > 0.98, name


def test_all_memory_options_together_match_plain():
    model, draft, teacher, ids, loss_mask, attn = setup_unroll()
    ref = run_unroll(draft, model.get_input_embeddings(), teacher, ids, loss_mask, attn)
    host = HostEmbedding(model.get_input_embeddings().weight, "cpu")
    got = run_unroll(draft, host, teacher, ids, loss_mask, attn, grad_checkpoint=True, loss_chunk_tokens=9)
    assert_same(ref, got)


def test_stateful_attention_is_the_explicit_state_one():
    torch.manual_seed(0)
    b, h, kvh, t, d = 2, 4, 2, 6, 8
    ks = [torch.randn(b, kvh, t, d) for _ in range(3)]
    vs = [torch.randn(b, kvh, t, d) for _ in range(3)]
    qs = [torch.randn(b, h, t, d) for _ in range(3)]
    attend = TTTAttention()
    for j in range(3):
        torch.testing.assert_close(
            attend(qs[j], ks[j], vs[j]), ttt_attention(qs[j], ks[: j + 1], vs[: j + 1]), atol=0, rtol=0
        )


# --- 3. flex attention -------------------------------------------------------------------


def explicit_ttt_reference(q, ks, vs, j):
    """Position by position: step-0 keys <= t, keys of steps 1..j at t only."""
    n_rep = q.shape[1] // ks[0].shape[1]
    outs = []
    for pos in range(q.shape[2]):
        keys = torch.cat([ks[0][:, :, : pos + 1]] + [ks[i][:, :, pos : pos + 1] for i in range(1, j + 1)], 2)
        vals = torch.cat([vs[0][:, :, : pos + 1]] + [vs[i][:, :, pos : pos + 1] for i in range(1, j + 1)], 2)
        outs.append(
            F.scaled_dot_product_attention(q[:, :, pos : pos + 1], repeat_kv(keys, n_rep), repeat_kv(vals, n_rep))
        )
    return torch.cat(outs, 2)


def test_ttt_mask_mod_is_causal_block_then_diagonals():
    t, n = 5, 4
    q = torch.arange(t)[:, None]
    kv = torch.arange(n * t)[None, :]
    dense = ttt_mask_mod(t)(0, 0, q, kv)
    expect = torch.zeros(t, n * t, dtype=torch.bool)
    for qi in range(t):
        expect[qi, : qi + 1] = True
        for i in range(1, n):
            expect[qi, i * t + qi] = True
    assert torch.equal(dense, expect)


def _flex_devices():
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    return devices


@pytest.mark.parametrize("device", _flex_devices())
def test_flex_attention_matches_explicit_keys(device):
    ok, why = flex_usable(device, training=False)
    if not ok:
        pytest.skip(f"flex attention not usable on {device}: {why}")
    torch.manual_seed(0)
    b, h, kvh, t, d, steps = 2, 4, 2, 7, 16, 4
    qs = [torch.randn(b, h, t, d, device=device) for _ in range(steps)]
    ks = [torch.randn(b, kvh, t, d, device=device) for _ in range(steps)]
    vs = [torch.randn(b, kvh, t, d, device=device) for _ in range(steps)]
    for j in range(steps):
        got = ttt_attention(qs[j], ks[: j + 1], vs[: j + 1], backend="flex")
        torch.testing.assert_close(got, explicit_ttt_reference(qs[j], ks, vs, j), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            got, ttt_attention(qs[j], ks[: j + 1], vs[: j + 1], backend="sdpa"), atol=1e-5, rtol=1e-5
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention has no backward on CPU (torch 2.13)")
def test_flex_unroll_grads_match_sdpa_on_cuda():
    model, draft, teacher, ids, loss_mask, attn = setup_unroll()
    model, draft = model.cuda(), draft.cuda()
    teacher = type(teacher)(
        *(x.cuda() for x in (teacher.aux, teacher.draft_logits, teacher.target_argmax, teacher.in_draft))
    )
    ids, loss_mask, attn = ids.cuda(), loss_mask.cuda(), attn.cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    embed = model.get_input_embeddings()
    ref = run_unroll(draft, embed, teacher, ids, loss_mask, attn)
    got = run_unroll(
        draft, embed, teacher, ids, loss_mask, attn, attention="flex", grad_checkpoint=True, loss_chunk_tokens=8
    )
    assert_same(ref, got)


def test_flex_training_on_cpu_is_refused_with_a_reason():
    cfg = load_config(None, ["train.attention=flex"])
    with pytest.raises(ConfigError, match="flex"):
        memory_options(cfg.train, "cpu")
    assert memory_options(cfg.train, "cpu", training=False)["attention"] == "flex"


def test_auto_defaults_resolve_per_device():
    tc = load_config(None, []).train
    assert tc.loss_chunk_tokens == 2048 and tc.embedding_on_host is False
    cpu = memory_options(tc, "cpu")
    assert cpu == {
        "loss_chunk_tokens": 2048,
        "grad_checkpoint": False,
        "attention": "sdpa",
        "compile": False,
        "compile_layer": False,
        "autocast": None,
    }
    assert optimizer_offload(tc, "cpu") is False
    assert optimizer_offload(tc, "cuda") is True
    assert memory_options(tc, "cuda")["grad_checkpoint"] is True
    assert memory_options(tc, "cuda")["compile"] is True
    # bf16 autocast on CUDA over fp32 params only; bf16 params compute in bf16 already.
    assert memory_options(tc, "cuda")["autocast"] == "bfloat16"
    assert memory_options(tc, "cuda", param_dtype=torch.bfloat16)["autocast"] is None
    assert memory_options(load_config(None, ["train.compute_dtype=float32"]).train, "cuda")["autocast"] is None
    with pytest.raises(ConfigError, match="compute_dtype"):
        memory_options(load_config(None, ["train.compute_dtype=fp8"]).train, "cuda")
    unchunked = load_config(None, ["train.loss_chunk_tokens=0"]).train
    assert memory_options(unchunked, "cuda")["compile"] is False  # no chunks to compile
    assert memory_options(unchunked, "cuda")["compile_layer"] is True
    forced = load_config(None, ["train.grad_checkpoint=true", "train.optimizer_offload=true"]).train
    assert memory_options(forced, "cpu")["grad_checkpoint"] is True and optimizer_offload(forced, "cpu")


def test_memory_policy_trades_recompute_for_speed_only_when_the_plan_says_it_fits(monkeypatch):
    from transformers import LlamaConfig

    from draftling.train.draft_setup import resolve_memory_policy
    from draftling.train.memory import DraftShape

    target_config = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152
    )
    tc = load_config(None, []).train
    args = (DraftShape.from_config(target_config, 32000), 8, 2048, torch.float32, False, "bfloat16")
    # On the CPU nothing changes.
    assert resolve_memory_policy(tc, "cpu", *args)[0] is tc
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (120 * gib, 141 * gib))
    fast, why = resolve_memory_policy(tc, "cuda:0", *args)
    assert fast.grad_checkpoint is False and fast.loss_chunk_tokens == 16384 and why.startswith("fast")
    assert memory_options(fast, "cuda")["grad_checkpoint"] is False
    # Too little free memory for the fast settings: as configured (recompute on, 2048 rows).
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * gib, 32 * gib))
    kept, why = resolve_memory_policy(tc, "cuda:0", *args)
    assert kept is tc and memory_options(kept, "cuda")["grad_checkpoint"] is True and "as configured" in why
    # An explicit grad_checkpoint and policy "config" are respected.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (120 * gib, 141 * gib))
    forced = load_config(None, ["train.grad_checkpoint=true"]).train
    assert resolve_memory_policy(forced, "cuda:0", *args)[0].grad_checkpoint is True
    as_set = load_config(None, ["train.memory_policy=config"]).train
    assert resolve_memory_policy(as_set, "cuda:0", *args)[0] is as_set
    with pytest.raises(ConfigError, match="memory_policy"):
        resolve_memory_policy(load_config(None, ["train.memory_policy=fastest"]).train, "cuda:0", *args)


# --- 4. optimizer offload ----------------------------------------------------------------


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 5), (5,), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _run_steps(opt, sched, params, steps, start=0):
    for s in range(start, start + steps):
        for p, g in zip(params, _grads(s, params)):
            p.grad = g.to(p.dtype)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def _sched(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def test_offloaded_adamw_equals_adamw_fp32():
    # The offloaded masters step with the fused AdamW kernel: against a fused AdamW the result
    # is bit-identical; against the plain builder's default kernel only rounding may differ
    # (5e-10 after 5 steps on an AMD EPYC, 0 on an Intel Xeon).
    fused_p, plain_p, off_p = (_params(torch.float32) for _ in range(3))
    fused = torch.optim.AdamW(fused_p, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    plain, plain_s = build_optimizer(plain_p, 1e-2, (0.9, 0.95), 0.01, offload=False)
    off, off_s = build_optimizer(off_p, 1e-2, (0.9, 0.95), 0.01, offload=True)
    assert isinstance(off, OffloadedAdamW) and off_s is off.optimizer
    _run_steps(fused, _sched(fused), fused_p, 5)
    _run_steps(plain, _sched(plain_s), plain_p, 5)
    _run_steps(off, _sched(off_s), off_p, 5)
    for a, b, c, m, start in zip(fused_p, off_p, plain_p, off.masters, _params(torch.float32)):
        assert torch.equal(a, b) and torch.equal(a, m)
        torch.testing.assert_close(c, b, rtol=1e-6, atol=1e-8)
        assert (b - start).abs().max() > 1e-3  # the steps moved it
    st_fused, st_off = fused.state_dict(), off.state_dict()
    for k, v in st_fused["state"].items():
        assert torch.equal(v["exp_avg"], st_off["state"][k]["exp_avg"])
        assert torch.equal(v["exp_avg_sq"], st_off["state"][k]["exp_avg_sq"])
    assert plain.state_dict()["param_groups"][0]["lr"] == st_off["param_groups"][0]["lr"]


def test_offloaded_adamw_bf16_params_fp32_masters():
    ref_p, off_p = _params(torch.float32), _params(torch.bfloat16)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, betas=(0.9, 0.95))
    off = OffloadedAdamW(off_p, lr=1e-2, betas=(0.9, 0.95))
    # The masters start from the bf16 params; start the reference there too.
    with torch.no_grad():
        for r, p in zip(ref_p, off_p):
            r.copy_(p.float())
    _run_steps(ref, _sched(ref), ref_p, 5)
    _run_steps(off, _sched(off.optimizer), off_p, 5)
    for r, p, m in zip(ref_p, off_p, off.masters):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        torch.testing.assert_close(p.float(), r, atol=1e-2, rtol=1e-2)  # bf16 rounding of the copy
        torch.testing.assert_close(p, m.to(torch.bfloat16), atol=0, rtol=0)  # params = rounded masters
        torch.testing.assert_close(m, r, atol=1e-3, rtol=1e-3)  # only grads went through bf16


def test_offloaded_adamw_resume_is_exact_with_low_precision_params():
    full_p = _params(torch.bfloat16)
    full = OffloadedAdamW(full_p, lr=1e-2, betas=(0.9, 0.95))
    full_s = _sched(full.optimizer)
    _run_steps(full, full_s, full_p, 5)

    cut_p = _params(torch.bfloat16)
    cut = OffloadedAdamW(cut_p, lr=1e-2, betas=(0.9, 0.95))
    cut_s = _sched(cut.optimizer)
    _run_steps(cut, cut_s, cut_p, 3)
    opt_state, sched_state = cut.state_dict(), cut_s.state_dict()
    weights = [p.detach().clone() for p in cut_p]

    new_p = _params(torch.bfloat16, seed=9)  # a fresh process: other initial weights
    new = OffloadedAdamW(new_p, lr=1e-2, betas=(0.9, 0.95))
    new_s = _sched(new.optimizer)
    with torch.no_grad():
        for p, w in zip(new_p, weights):
            p.copy_(w)
    new.load_state_dict(opt_state)
    new_s.load_state_dict(sched_state)
    _run_steps(new, new_s, new_p, 2, start=3)
    for a, b in zip(full_p, new_p):
        assert torch.equal(a, b)
    for a, b in zip(full.masters, new.masters):
        assert torch.equal(a, b)


def test_offloaded_adamw_loads_a_plain_adamw_checkpoint():
    plain_p, off_p = _params(torch.float32), _params(torch.float32, seed=4)
    plain = torch.optim.AdamW(plain_p, lr=1e-2)
    _run_steps(plain, _sched(plain), plain_p, 2)
    off = OffloadedAdamW(off_p, lr=1e-2)
    with torch.no_grad():
        for p, q in zip(off_p, plain_p):
            p.copy_(q)
    off.load_state_dict(plain.state_dict())
    for m, q in zip(off.masters, plain_p):
        assert torch.equal(m, q)


# --- 5. embedding in host RAM ------------------------------------------------------------


def test_host_embedding_equals_plain_lookup():
    model = tiny_llama(layers=2)
    embed = model.get_input_embeddings()
    host = HostEmbedding(embed.weight, "cpu")
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (3, 11))
    lookup = host.for_batch(ids)
    for n in range(0, 6):
        shifted = shift_left(ids, n)
        assert torch.equal(lookup(shifted), embed(shifted))
    assert torch.equal(host(ids), embed(ids))
    assert host.weight.device.type == "cpu" and not host.weight.requires_grad


# --- wired through train() ---------------------------------------------------------------


def test_train_with_all_memory_options_matches_plain(tmp_path, tiny_target, capsys):
    setup_data(tmp_path)
    run(tmp_path, tiny_target, "plain", 4, **{"train.loss_chunk_tokens": 0})
    run(
        tmp_path,
        tiny_target,
        "mem",
        4,
        **{
            "train.loss_chunk_tokens": 7,
            "train.grad_checkpoint": "true",
            "train.optimizer_offload": "true",
            "train.embedding_on_host": "true",
            "train.draft_dtype": "float32",
        },
    )  # exactness is checked at one precision
    out = capsys.readouterr().out
    assert "grad_checkpoint True" in out and "optimizer_offload True" in out
    a = load_file(str(tmp_path / "plain" / "draft" / "draft.safetensors"))
    b = load_file(str(tmp_path / "mem" / "draft" / "draft.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=1e-4, msg=k)


def test_auto_draft_dtype_is_bf16_only_with_offload_and_keeps_rotary_fp32(tiny_target):
    from draftling.config import TrainConfig
    from draftling.draft.model import Eagle3Draft, draft_config_from_target
    from draftling.train.draft_setup import place_draft
    from draftling.train.settings import draft_param_dtype

    assert draft_param_dtype(TrainConfig(), "cpu") == torch.float32
    assert draft_param_dtype(TrainConfig(optimizer_offload=True), "cpu") == torch.bfloat16
    assert draft_param_dtype(TrainConfig(optimizer_offload=True, draft_dtype="float32"), "cpu") == torch.float32
    draft = Eagle3Draft(draft_config_from_target(tiny_target.config, 64, [1, 3, 4]))
    place_draft(draft, "cpu", torch.bfloat16)
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    assert draft.rotary_emb.inv_freq.dtype == torch.float32
    assert draft.d2t.dtype == torch.long


# --- 6. compiled loss chunks (train.compile) ---------------------------------------------


def test_compiled_loss_chunks_match_eager_with_one_graph_for_all_sizes():
    """compile= runs the checkpointed chunk through torch.compile (aot_eager here: the same
    dynamo capture and autograd split as inductor, without codegen). Loss, grads and counts
    equal the eager chunks, and chunks of other sizes or batches of other lengths reuse the
    one dynamic graph instead of recompiling."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model, draft, teacher, ids, loss_mask, attn = setup_unroll(b=4, t=24)
    embed = model.get_input_embeddings()
    opts = {"loss_chunk_tokens": 7, "grad_checkpoint": True}
    ref = run_unroll(draft, embed, teacher, ids, loss_mask, attn, **opts)
    got = run_unroll(draft, embed, teacher, ids, loss_mask, attn, compile=counter, **opts)
    assert_same(ref, got)
    assert counter.frame_count == 1
    # Another chunk size and another batch shape: still the same graph.
    model2, draft2, teacher2, ids2, loss_mask2, attn2 = setup_unroll(b=3, t=17, seed=5)
    ref2 = run_unroll(draft2, model2.get_input_embeddings(), teacher2, ids2, loss_mask2, attn2, loss_chunk_tokens=5)
    got2 = run_unroll(
        draft2, model2.get_input_embeddings(), teacher2, ids2, loss_mask2, attn2, loss_chunk_tokens=5, compile=counter
    )
    assert_same(ref2, got2)
    assert counter.frame_count == 1
    # Without grad (evaluation) the chunks run eagerly: no graph for no_grad.
    with torch.no_grad():
        l0, _ = ttt_unroll(draft, embed, teacher, ids, loss_mask, attn, 3, loss_chunk_tokens=7)
        l1, _ = ttt_unroll(draft, embed, teacher, ids, loss_mask, attn, 3, loss_chunk_tokens=7, compile=counter)
    torch.testing.assert_close(l1, l0)
    assert counter.frame_count == 1


@pytest.mark.parametrize("ckpt", [False, True])
def test_compiled_layer_halves_match_eager_with_one_graph_per_half(ckpt):
    """compile_layer= compiles the decoder layer around its attention. Loss, grads and counts
    equal the eager layer, with or without checkpointing, and a batch of another length
    reuses the two dynamic graphs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model, draft, teacher, ids, loss_mask, attn = setup_unroll(b=3, t=20)
    embed = model.get_input_embeddings()
    ref = run_unroll(draft, embed, teacher, ids, loss_mask, attn, grad_checkpoint=ckpt)
    got = run_unroll(draft, embed, teacher, ids, loss_mask, attn, grad_checkpoint=ckpt, compile_layer=counter)
    assert_same(ref, got)
    # attention_inputs and attention_to_output; SDPA's step-0 output has other strides than
    # the later steps' explicit attention, which costs the output half one more graph.
    frames = counter.frame_count
    assert 2 <= frames <= 3
    short = (
        teacher_forward(
            type("T", (), {"model": model, "aux_layer_ids": [2, 3, 4], "output_head": lambda self: model.lm_head})(),
            ids[:, :13],
            attn[:, :13],
            draft.t2d,
        ),
        ids[:, :13],
        loss_mask[:, :13],
        attn[:, :13],
    )
    assert_same(
        run_unroll(draft, embed, *short, grad_checkpoint=ckpt),
        run_unroll(draft, embed, *short, grad_checkpoint=ckpt, compile_layer=counter),
    )
    assert counter.frame_count == frames


@pytest.mark.parametrize("on_host", [True, False])
def test_build_order_flag_decides_whether_the_device_sees_the_fp32_build(tmp_path, tiny_target, monkeypatch, on_host):
    from draftling.draft.model import Eagle3Draft

    moves = []
    original = Eagle3Draft.to

    def recording_to(self, *args, **kwargs):
        moves.append(self.fc.weight.dtype)  # the weights' dtype when the draft is moved
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Eagle3Draft, "to", recording_to)
    setup_data(tmp_path)
    run(
        tmp_path,
        tiny_target,
        "r",
        1,
        **{"train.optimizer_offload": "true", "train.build_on_host": str(on_host).lower()},
    )
    # On the host the draft is cast to bf16 before its first move; off, it moves as built (fp32).
    assert moves[0] == (torch.bfloat16 if on_host else torch.float32)
