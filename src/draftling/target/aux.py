"""The aux-layer convention, written down once.

draftling names an aux layer by its index into HF ``output_hidden_states``:
``hidden_states[0]`` is the embedding output and ``hidden_states[i]`` (i >= 1) is the
output of 0-indexed decoder layer ``i - 1`` (equivalently, the input to layer ``i``).
The EAGLE-3 default is ``[2, L // 2, L - 3]`` for an L-layer target (low, mid, high).

Serving engines disagree on this index: vLLM reads an explicit id ``k`` as
``hidden_states[k]`` (same as ours); SGLang reads ``k`` as ``hidden_states[k + 1]``.
The exporters translate; nothing else in draftling should.

The states are captured with forward hooks on the decoder layers, so any
``AutoModelForCausalLM`` whose decoder layers live in a ``ModuleList`` works without a
per-architecture port, and the full hidden-state tuple is never materialised.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch import nn

from draftling.errors import TargetError


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def validate_aux_layer_ids(ids: list[int], num_layers: int, where: str = "aux_layer_ids") -> list[int]:
    ids = [int(i) for i in ids]
    if len(ids) != 3:
        raise TargetError(f"{where}: expected 3 layer ids (low, mid, high), got {ids}")
    for i in ids:
        # hidden_states[0] is the embedding output and hidden_states[L] is already
        # final-normed in HF; EAGLE-3 uses neither.
        if not 1 <= i <= num_layers - 1:
            raise TargetError(
                f"{where}: layer id {i} out of range for a {num_layers}-layer target "
                f"(valid HF hidden_states indices are 1..{num_layers - 1})"
            )
    return ids


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """Find the decoder-layer ModuleList of an HF causal LM without knowing its class."""
    base = getattr(model, "base_model", model)
    for owner in (base, getattr(base, "model", None), getattr(base, "decoder", None)):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if isinstance(layers, nn.ModuleList):
            return layers
    n = model.config.num_hidden_layers
    candidates = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(candidates) == 1:
        return candidates[0]
    raise TargetError(f"cannot find the decoder layers of {type(model).__name__}")


@contextmanager
def recording_aux_states(model: nn.Module, layer_ids: list[int]):
    """Forward hooks on the aux layers for the duration of the block: yields ``{id: [state
    of each forward call, in order]}``, where the state for id ``i`` is the output of decoder
    layer ``i - 1`` (see module docstring). Many calls: a generate() loop."""
    layers = decoder_layers(model)
    calls: dict[int, list[torch.Tensor]] = {i: [] for i in sorted(set(layer_ids))}
    handles = []
    for hs_index in calls:

        def hook(_module, _inputs, output, hs_index=hs_index):
            calls[hs_index].append(output[0] if isinstance(output, tuple) else output)

        handles.append(layers[hs_index - 1].register_forward_hook(hook))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def aux_hidden_states(model: nn.Module, layer_ids: list[int], **forward_kwargs):
    """Run ``model(**forward_kwargs)`` and return ``(output, [h_low, h_mid, h_high])``."""
    with recording_aux_states(model, layer_ids) as calls:
        out = model(**forward_kwargs)
    return out, [calls[i][-1] for i in layer_ids]


_COMPILED_LAYER_FORWARDS: dict = {}


@contextmanager
def compiled_decoder_layers(model: nn.Module, backend="inductor"):
    """Run the decoder layers' ``forward`` under ``torch.compile`` inside this block.

    Compiling the whole model would put the aux hooks (added per call) inside the graph and
    recompile; compiling each layer's forward leaves the hooks outside, eager, where
    ``aux_hidden_states`` expects them. The class's forward is compiled once as a plain
    function, so one graph serves every layer (the layer is an argument). Layers whose
    forward is already replaced on the instance (accelerate offload hooks, for one) are
    left eager: compiling the class method would bypass that replacement."""
    layers = decoder_layers(model)
    patched = []
    for layer in layers:
        if "forward" in vars(layer):
            continue
        key = (type(layer).forward, str(backend))
        fn = _COMPILED_LAYER_FORWARDS.get(key)
        if fn is None:
            fn = _COMPILED_LAYER_FORWARDS[key] = torch.compile(type(layer).forward, backend=backend)
        layer.forward = functools.partial(fn, layer)
        patched.append(layer)
    try:
        yield len(patched)
    finally:
        for layer in patched:
            del layer.forward  # back to the class's own forward
