"""EngineOptions.resolve: where "auto" becomes each engine setting, per device and padding."""

import pytest

from draftling.engine import EngineOptions
from draftling.errors import ConfigError


def test_auto_resolves_per_device_and_padding():
    auto = EngineOptions.auto()
    gpu = auto.resolve("cuda", max_draft_tokens=16)
    assert (gpu.cuda_graphs, gpu.compile, gpu.query_pad, gpu.attention) == (True, True, 16, "exact")
    # Unpadded, exact attention buys no identity: the faster bf16 matmul form.
    assert auto.resolve("cuda", 0).attention == "matmul"
    assert EngineOptions.of(auto, query_pad=0).resolve("cuda", 16).attention == "matmul"
    assert auto.unpadded("cuda") == EngineOptions(True, True, 0, "matmul", compile_prefill=False, prefill_graphs=False)
    cpu = auto.resolve("cpu", 16)
    assert (cpu.cuda_graphs, cpu.compile, cpu.query_pad, cpu.attention) == (False, False, 0, "sdpa")
    # "auto" prefills eagerly, resolved or not; asked for, the prefill compiles.
    assert not gpu.prefill_compiled and not cpu.prefill_compiled and not EngineOptions().prefill_compiled
    assert EngineOptions.of(auto, compile_prefill=True).resolve("cuda").compile_prefill is True
    assert EngineOptions.of(auto, compile_prefill=False).resolve("cuda").compile_prefill is False
    # Graphed prefills: off until asked for (not yet timed on a GPU).
    assert not gpu.prefill_graphed and not EngineOptions().prefill_graphed
    assert EngineOptions.of(auto, prefill_graphs=True).resolve("cpu").prefill_graphed
    # What the caller names stays as named.
    assert EngineOptions.of(auto, attention="exact", query_pad=0).resolve("cuda").attention == "exact"
    assert EngineOptions.of(auto, fuse=False).resolve("cuda").fuse is False


def test_bad_options_are_refused():
    with pytest.raises(ConfigError, match="below the largest config's 16"):
        EngineOptions.of(EngineOptions.auto(), query_pad=8).resolve("cuda", 16)
    with pytest.raises(ConfigError, match="fuse must be true or false"):
        EngineOptions(fuse="auto")
    with pytest.raises(ConfigError, match="still holds 'auto'"):
        EngineOptions.auto().check_resolved()
