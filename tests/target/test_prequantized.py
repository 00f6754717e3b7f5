"""Pre-quantized teachers: checkpoints saved quantized, made here from a tiny random Llama on
the CPU, loaded through load_target (the checkpoint's own quantization_config) and run as
teachers.

- FP8 (transformers' ``quant_method: fp8``, 128x128 blocks) and compressed-tensors FP8
  (per-channel scales) are written by hand in their on-disk format: e4m3 weights and scales
  beside them. The logits must equal a float model holding the test's own dequantized weights.
- GPTQ and AWQ are quantized by their library (transformers' GPTQConfig with gptqmodel and
  optimum; gptqmodel's AWQConfig), which packs the weights; the logits must equal a float model
  holding the weights the loaded layers apply (probed with an identity input).

Each needs its package (skipped without it, as in CI); transformers alone reads the FP8
checkpoint, dequantized on a machine without a GPU. docs/teachers.md records the versions.
"""

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from draftling.errors import TargetError
from draftling.target import load as target_load
from draftling.target import quant
from draftling.target.load import load_target
from draftling.target.quant import has_plain_weights, plain_weight
from draftling.train.teacher import teacher_forward
from tests.conftest import TINY_VOCAB, setup_data
from tests.helpers import saved_tiny_target

# Widths the 4-bit kernels take (group size 32 divides every in_features; out_features a
# multiple of 8); k/v_proj have 64 outputs, half an FP8 block.
FIELDS = dict(hidden_size=128, intermediate_size=256, max_position_embeddings=512, num_hidden_layers=6)
E4M3 = torch.float8_e4m3fn
BLOCK = 128


def word_tokenizer():
    """A word-level tokenizer over TINY_VOCAB words ("w0".."w299") with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(TINY_VOCAB)}, unk_token="w2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w2", pad_token="w0", eos_token="w1")
    tok.chat_template = "{% for m in messages %}w3 {{ m['content'] }} w1 {% endfor %}w4 "
    return tok


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return saved_tiny_target(tmp_path_factory.mktemp("plain"), word_tokenizer(), **FIELDS)


def rewrite(plain, out, quantize, quantization_config):
    """``plain`` copied to ``out`` with every decoder projection's weight replaced by
    ``quantize(weight)`` (a dict of tensors named after it) and the quantization_config set.
    Returns {name: the dequantized weight} for the reference model."""
    shutil.copytree(plain, out)
    tensors, dense = {}, {}
    for name, w in load_file(out / "model.safetensors").items():
        if not name.endswith("proj.weight"):
            tensors[name] = w
            continue
        stored = quantize(w.float())
        dense[name] = stored.pop("dense")
        tensors.update({name.removesuffix("weight") + key: value for key, value in stored.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return dense


def fp8_blocks(w):
    """transformers' FP8 layout: e4m3 weight, one float32 ``weight_scale_inv`` per 128x128 block."""
    o, i = w.shape
    po, pi = -(-o // BLOCK) * BLOCK, -(-i // BLOCK) * BLOCK
    blocks = torch.nn.functional.pad(w, (0, pi - i, 0, po - o)).reshape(po // BLOCK, BLOCK, pi // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(E4M3).max
    q = (blocks / scale[:, None, :, None]).reshape(po, pi)[:o, :i].to(E4M3)
    expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:o, :i]
    return {"weight": q, "weight_scale_inv": scale, "dense": q.float() * expanded}


def fp8_channels(w):
    """compressed-tensors' float-quantized layout: e4m3 weight, a float32 scale per output row."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / torch.finfo(E4M3).max
    q = (w / scale).to(E4M3)
    return {"weight": q, "weight_scale": scale, "dense": q.float() * scale}


FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
CT_FP8_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        }
    },
    "ignore": ["lm_head"],
}


def reference(plain, weights):
    """The float model of ``plain`` with ``weights`` ({name: float weight}) in place."""
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            if name in state and state[name].shape == w.shape:
                state[name].copy_(w)
    return model


def applied_weights(model):
    """{name: the weight each decoder projection applies}, probed with an identity input (GPTQ
    and AWQ layers hold packed ints, no float weight to read), and the model's other float
    tensors as loaded (AWQ folds its scales into the norms before it)."""
    out = {name: t.float() for name, t in model.state_dict().items() if t.dtype.is_floating_point}
    with torch.no_grad():
        for name, module in model.model.layers.named_modules():
            if name.endswith("proj"):
                out[f"model.layers.{name}.weight"] = module(torch.eye(module.in_features)[None])[0].T.float()
    return out


def check_teacher(qdir, plain, dense=None):
    """The checkpoint as a teacher: its logits against the float model with the weights it
    should hold (``dense``, else those its layers apply), within float32 noise; its aux states
    against the unquantized model's (quantization error only); the shapes the draft reads."""
    target = load_target(str(qdir), device="cpu")
    ids = torch.randint(2, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    t2d = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    t2d[:64] = True
    batch = teacher_forward(target, ids, torch.ones_like(ids), t2d)  # first: decompresses what is lazy
    with torch.no_grad():
        logits = target.model(ids).logits.float()
        want = reference(plain, dense if dense is not None else applied_weights(target.model))(ids).logits
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    plain_batch = teacher_forward(load_target(str(plain), device="cpu"), ids, torch.ones_like(ids), t2d)
    assert batch.aux.shape == (2, 16, 3 * FIELDS["hidden_size"]) and batch.draft_logits.shape == (2, 16, 64)
    cos = torch.nn.functional.cosine_similarity(batch.aux.float(), plain_batch.aux.float(), dim=-1).mean()
    assert cos > 0.95, f"aux cosine to the unquantized model {cos:.3f}"
    return target


def test_fp8_checkpoint_loads_dequantized_on_the_cpu(plain_dir, tmp_path, one_thread, caplog):
    dense = rewrite(plain_dir, tmp_path / "fp8", fp8_blocks, FP8_CONFIG)
    caplog.set_level("INFO", logger="draftling.target.load")
    target = check_teacher(tmp_path / "fp8", plain_dir, dense)
    assert "(a fp8 checkpoint)" in caplog.text
    # Without a GPU transformers dequantizes on load: plain float Linears in the asked dtype.
    q_proj = target.model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is torch.nn.Linear and q_proj.weight.dtype == torch.float32
    assert has_plain_weights(target.model)


def test_compressed_tensors_fp8_checkpoint(plain_dir, tmp_path, one_thread):
    pytest.importorskip("compressed_tensors", reason="pip install 'draftling[compressed-tensors]'")
    dense = rewrite(plain_dir, tmp_path / "ct", fp8_channels, CT_FP8_CONFIG)
    target = check_teacher(tmp_path / "ct", plain_dir, dense)
    # Decompressed while it loads (by default only the whole model's first forward would, and
    # the teacher calls the decoder alone): plain float weights in the asked dtype.
    assert target.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    assert has_plain_weights(target.model)


def calibration(n=8, length=48):
    g = torch.Generator().manual_seed(1)
    return [" ".join(f"w{i}" for i in torch.randint(5, TINY_VOCAB, (length,), generator=g).tolist()) for _ in range(n)]


@pytest.fixture(scope="module")
def gptq_dir(plain_dir, tmp_path_factory):
    """The tiny Llama quantized by transformers (GPTQConfig: gptqmodel and optimum) on the CPU."""
    pytest.importorskip("gptqmodel", reason="pip install 'draftling[gptq]'")
    pytest.importorskip("optimum.gptq", reason="pip install 'draftling[gptq]'")
    from transformers import AutoTokenizer, GPTQConfig

    tok = AutoTokenizer.from_pretrained(plain_dir)
    config = GPTQConfig(bits=4, group_size=32, dataset=calibration(), tokenizer=tok, desc_act=False)
    model = AutoModelForCausalLM.from_pretrained(plain_dir, quantization_config=config, device_map={"": "cpu"})
    out = tmp_path_factory.mktemp("gptq")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def awq_dir(plain_dir, tmp_path_factory):
    """The tiny Llama quantized by gptqmodel's AWQ on the CPU (in bfloat16: its AWQ packing
    refuses float32 weights)."""
    pytest.importorskip("gptqmodel", reason="pip install 'draftling[awq]'")
    from transformers import AutoTokenizer

    with pytest.MonkeyPatch.context() as mp:
        # gptqmodel asks for 2 loader threads under a CPU pool of (cores + 1) // 2: 1 on 2 cores.
        mp.setenv("GPTQMODEL_CPU_WORKERS", os.environ.get("GPTQMODEL_CPU_WORKERS", "2"))
        mp.chdir(tmp_path_factory.mktemp("awq-logs"))  # its quantizer writes logs/ into the working directory
        from gptqmodel import AWQConfig, GPTQModel

        config = AWQConfig(bits=4, group_size=32)
        model = GPTQModel.load(str(plain_dir), config, dtype=torch.bfloat16, device="cpu")
        model.quantize(calibration(), batch_size=1)
    out = tmp_path_factory.mktemp("awq")
    model.save(str(out))
    AutoTokenizer.from_pretrained(plain_dir).save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_packed_4bit_checkpoint_runs_on_the_cpu(method, request, plain_dir, one_thread):
    qdir = request.getfixturevalue(f"{method}_dir")
    assert json.loads((qdir / "config.json").read_text())["quantization_config"]["quant_method"] == method
    target = check_teacher(qdir, plain_dir)
    q_proj = target.model.model.layers[0].self_attn.q_proj
    assert plain_weight(q_proj) is None and not has_plain_weights(target.model), type(q_proj).__name__


def train_losses(target_dir, tmp_path, name, steps=10):
    """`draftling train` for ``steps`` steps on one batch with ``target_dir`` as the teacher."""
    from draftling.cli import main

    setup_data(tmp_path, n=8)  # 4 training rows: one batch, seen every step
    args = ["train", "--target", str(target_dir), "--device", "cpu", "--data", str(tmp_path)]
    knobs = [f"train.max_steps={steps}", "train.batch_size=4", "train.ttt_steps=2", "train.warmup_steps=1"]
    run = tmp_path / name
    assert main([*args, "--run-dir", str(run), *knobs, "train.lr=3e-3", "train.log_every=1"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["split"] == "train"]


def assert_learns(losses, steps=10):
    assert len(losses) == steps and all(map(math.isfinite, losses)), losses
    # The soft-label loss is floored by the random teacher's entropy: ~7.8 falling by ~0.3 here.
    assert losses[-1] < losses[0] - 0.1, losses


def test_fp8_teacher_trains(plain_dir, tmp_path, one_thread):
    rewrite(plain_dir, tmp_path / "fp8", fp8_blocks, FP8_CONFIG)
    assert_learns(train_losses(tmp_path / "fp8", tmp_path, "run"))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_packed_4bit_teacher_trains(method, request, tmp_path, one_thread):
    assert_learns(train_losses(request.getfixturevalue(f"{method}_dir"), tmp_path, "run"))


def test_a_second_quantization_or_a_missing_package_is_refused(plain_dir, tmp_path, monkeypatch):
    rewrite(plain_dir, tmp_path / "gptq", fp8_channels, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(TargetError, match=r"quantization quanto-int8: .* already quantized \(gptq checkpoint\)"):
        load_target(str(tmp_path / "gptq"), device="cpu", quantization="quanto-int8")
    monkeypatch.setattr(quant, "_package_present", lambda package: package != "gptqmodel")
    with pytest.raises(TargetError, match=r"gptq checkpoint: .*needs the gptqmodel package.*draftling\[gptq\]"):
        load_target(str(tmp_path / "gptq"), device="cpu")
    assert target_load._checkpoint_method(target_load.resolve_target(str(plain_dir))) is None


def test_a_float8_weight_is_not_plain():
    linear = torch.nn.Linear(4, 3)
    linear.weight = torch.nn.Parameter(linear.weight.detach().to(E4M3), requires_grad=False)
    assert plain_weight(linear) is None
