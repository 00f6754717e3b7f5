"""The engine's fused q/k/v and gate/up projections (engine/fused.py): same outputs as the
unfused engine and as HF, the model's own weights become views (no second copy), and the
model still saves and reloads to the same weights."""

import torch
from torch import nn
from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from draftling.engine import CachedTarget, causal_mask, greedy_generate
from draftling.engine.fused import fuse_layer
from tests.helpers import AUX, prompt, tiny


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_fused_engine_equals_unfused_and_keeps_the_model_whole(tmp_path):
    model = tiny(Qwen2ForCausalLM, Qwen2Config)  # q/k/v carry biases
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    before, seq = _weights(model), prompt(12)
    with torch.no_grad():
        ref = model(seq).logits
    plain = CachedTarget.from_hf(model, AUX, 48, fuse=False)
    assert all(f is None for f in plain.fused)
    want = greedy_generate(plain, seq, 16)
    fused = CachedTarget.from_hf(model, AUX, 48)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    f0 = fused.fused[0]
    assert f0.qkv is not None and f0.gate_up is not None
    # The HF parameters are views into the fused tensors: one copy of the weights.
    pairs = [(attn.q_proj.weight, f0.qkv.weight), (attn.v_proj.weight, f0.qkv.weight)]
    pairs += [(attn.k_proj.bias, f0.qkv.bias), (mlp.up_proj.weight, f0.gate_up.weight)]
    for p, whole in pairs:
        assert p.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert torch.equal(greedy_generate(fused, seq, 16), want)
    pos = torch.arange(12)
    with torch.no_grad():
        got, _ = fused(seq, pos, pos, causal_mask(0, 12, 48, "cpu"))
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(model(seq).logits, ref, atol=0, rtol=0)  # HF's forward unchanged
    again = CachedTarget.from_hf(model, AUX, 48)  # a second engine reuses the fused tensors
    assert again.fused[0].qkv.weight is f0.qkv.weight
    model.save_pretrained(tmp_path)
    reloaded = Qwen2ForCausalLM.from_pretrained(tmp_path)
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_layer_that_cannot_fuse_runs_unfused():
    model = tiny(LlamaForCausalLM)
    layer = model.model.layers[0]

    class Quantized(nn.Linear):  # any Linear subclass (quantized, LoRA) keeps its own forward
        pass

    old = layer.self_attn.k_proj
    layer.self_attn.k_proj = Quantized(old.in_features, old.out_features, bias=False)
    layer.self_attn.k_proj.weight = old.weight
    out = fuse_layer(layer)
    assert out.qkv is None and out.gate_up is not None
    assert fuse_layer(model.model.layers[1]).qkv is not None
    up = model.model.layers[2].mlp.up_proj  # integer weights stand for a quantized tensor
    saved = up.weight
    up.weight = nn.Parameter(saved.to(torch.int8), requires_grad=False)
    assert fuse_layer(model.model.layers[2]).gate_up is None
    up.weight = saved
    seq = prompt(10)
    want = greedy_generate(CachedTarget.from_hf(tiny(LlamaForCausalLM), AUX, 40, fuse=False), seq, 12)
    assert torch.equal(greedy_generate(CachedTarget.from_hf(model, AUX, 40), seq, 12), want)
