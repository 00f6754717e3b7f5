"""Quantized teachers: the config -> quantization_config mapping, how load_target places a
quantized model, the teacher's path for a quantized output head, and (when the optional
package is installed) a real quantized load of a tiny model."""

import importlib.util

import pytest
import torch
from torch import nn

from draftling.config import load_config
from draftling.errors import TargetError
from draftling.target import load as target_load
from draftling.target import quant
from draftling.target.quant import QUANT_METHODS, plain_weight, quantization_config
from draftling.train.teacher import teacher_forward


def test_method_table():
    assert set(QUANT_METHODS) == {"bnb-4bit", "bnb-8bit", "quanto-int8", "quanto-int4", "torchao-int8"}
    assert QUANT_METHODS["torchao-int8"].config_class == "TorchAoConfig"
    assert QUANT_METHODS["torchao-int8"].torchao_type == "Int8WeightOnlyConfig"
    assert {m.extra for m in QUANT_METHODS.values()} == {"bnb", "quanto", "torchao"}


@pytest.mark.parametrize(
    "name, cls, attrs",
    [
        (
            "bnb-4bit",
            "BitsAndBytesConfig",
            {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.bfloat16},
        ),
        ("bnb-8bit", "BitsAndBytesConfig", {"load_in_8bit": True, "load_in_4bit": False}),
        ("quanto-int8", "QuantoConfig", {"weights": "int8", "activations": None}),
        ("quanto-int4", "QuantoConfig", {"weights": "int4"}),
    ],
)
def test_config_mapping(monkeypatch, name, cls, attrs):
    # These transformers configs build without their backend; only the presence check is faked.
    monkeypatch.setattr(quant, "_package_present", lambda package: True)
    cfg = quantization_config(name, torch.bfloat16)
    assert type(cfg).__name__ == cls
    for key, value in attrs.items():
        assert getattr(cfg, key) == value, key


def test_unknown_method_and_missing_package(monkeypatch):
    with pytest.raises(TargetError, match=r"'int3'.*bnb-4bit, bnb-8bit, quanto-int8"):
        quantization_config("int3", torch.float32)
    monkeypatch.setattr(quant, "_package_present", lambda package: False)
    with pytest.raises(TargetError, match=r"needs the bitsandbytes package.*draftling\[bnb\]"):
        quantization_config("bnb-4bit", torch.float32)
    with pytest.raises(TargetError, match=r"needs the optimum package.*draftling\[quanto\]"):
        quantization_config("quanto-int8", torch.float32)


def test_config_field():
    assert load_config().quantization is None
    assert load_config(overrides=["quantization=bnb-4bit"]).quantization == "bnb-4bit"


def test_quantized_load_is_placed_by_from_pretrained(monkeypatch, tiny_target_dir):
    """With a quantization_config the device goes to from_pretrained (device_map) and the
    model is never moved afterwards (bitsandbytes models refuse .to())."""
    from tests.helpers import tiny_llama

    calls = []
    model = tiny_llama()

    def fake_from_pretrained(path, **kwargs):
        calls.append(kwargs)
        return model

    def refuse_to(*args, **kwargs):
        raise AssertionError("a quantized model must not be moved after loading")

    monkeypatch.setattr(quant, "_package_present", lambda package: True)
    monkeypatch.setattr(target_load, "_from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(model, "to", refuse_to)
    target = target_load.load_target(str(tiny_target_dir), dtype="bfloat16", device="cpu", quantization="quanto-int8")
    assert target.model is model
    (kwargs,) = calls
    assert kwargs["device_map"] == {"": "cpu"} and kwargs["dtype"] == torch.bfloat16
    assert type(kwargs["quantization_config"]).__name__ == "QuantoConfig"


class Int8Head(nn.Module):
    """A stand-in for a quantized lm_head: int8 weight plus per-row scale, no float weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        self.register_buffer("weight", torch.round(w / scale).to(torch.int8))
        self.register_buffer("scale", scale)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scale

    def forward(self, x):
        return x @ self.dequantized().T.to(x.dtype)


def test_plain_weight():
    linear = nn.Linear(4, 3)
    assert plain_weight(linear) is linear.weight
    assert plain_weight(Int8Head(linear)) is None

    class Packed(torch.Tensor):  # how tensor-subclass quantizers (torchao, quanto) look
        pass

    sub = nn.Linear(4, 3)
    sub.weight = nn.Parameter(torch.randn(3, 4).as_subclass(Packed), requires_grad=False)
    assert plain_weight(sub) is None


def test_teacher_with_quantized_head(tiny_target, one_thread):
    """A head without float rows: draft logits come from its own output, and match the
    float path on the same (dequantized) weights."""
    model = tiny_target.model
    qhead = Int8Head(model.lm_head)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, model.config.vocab_size, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(model.config.vocab_size, generator=g)[:64]] = True

    model.lm_head = qhead
    quantized = teacher_forward(tiny_target, ids, mask, t2d, chunk_tokens=5)
    model.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    model.lm_head.weight.data.copy_(qhead.dequantized())
    plain = teacher_forward(tiny_target, ids, mask, t2d, chunk_tokens=5)

    torch.testing.assert_close(quantized.draft_logits, plain.draft_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(quantized.target_argmax, plain.target_argmax)
    assert torch.equal(quantized.aux, plain.aux)
    assert quantized.draft_logits.shape == (2, 12, 64)


def _installed(method: str) -> bool:
    package = QUANT_METHODS[method].package
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("method", sorted(QUANT_METHODS))
def test_real_quantized_teacher(method, tiny_target_dir, one_thread):
    """Load a tiny Llama with the method on CPU and run the teacher: needs the optional package."""
    if not _installed(method):
        pytest.skip(
            f"{QUANT_METHODS[method].package} is not installed (pip install 'draftling[{QUANT_METHODS[method].extra}]')"
        )
    plain = target_load.load_target(str(tiny_target_dir), device="cpu")
    target = target_load.load_target(str(tiny_target_dir), device="cpu", quantization=method)
    q_proj = target.model.model.layers[0].self_attn.q_proj
    assert plain_weight(q_proj) is None, "the decoder layers should hold quantized weights"
    vocab = target.config.vocab_size
    ids = torch.randint(2, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:256] = True
    batch = teacher_forward(target, ids, torch.ones_like(ids), t2d)
    ref = teacher_forward(plain, ids, torch.ones_like(ids), t2d)
    h = target.config.hidden_size
    assert batch.aux.shape == (2, 16, 3 * h) and batch.draft_logits.shape == (2, 16, 256)
    assert torch.isfinite(batch.aux).all() and torch.isfinite(batch.draft_logits).all()
    # Quantization error only: the aux states still point the same way as the float model's.
    cos = nn.functional.cosine_similarity(batch.aux.float(), ref.aux.float(), dim=-1).mean()
    assert cos > 0.9, f"{method}: aux cosine to the float model {cos:.3f}"


def test_teacher_compile_auto_skips_quantized_teachers():
    """auto compiles a plain (or dequantized GGUF) teacher on CUDA, never a quantized one,
    and never on the CPU; an explicit setting wins."""
    from draftling.config import TrainConfig
    from draftling.train.settings import compile_teacher
    from tests.helpers import tiny_llama

    model = tiny_llama(layers=2)
    auto = TrainConfig()
    assert compile_teacher(auto, "cuda", model) is True
    assert compile_teacher(auto, "cpu", model) is False
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.weight = torch.nn.Parameter(q_proj.weight.detach().to(torch.int8), requires_grad=False)
    assert compile_teacher(auto, "cuda", model) is False
    assert compile_teacher(TrainConfig(compile_teacher=True), "cuda", model) is True
