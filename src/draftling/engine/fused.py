"""One matmul for each layer's q/k/v projections and one for its gate/up projections.

At batch 1 a decode step is a chain of matrix-vector products, each reading its weight once;
three small launches where one large one would do leave memory bandwidth unused.
``fuse_layer`` concatenates the weights into one tensor per layer and rebinds the HF modules' own
``weight`` (and ``bias``) parameters as views into it, so memory does not grow and the HF
model's forward, state dict and ``save_pretrained`` see the same values as before.

A layer is fused only when every projection involved is a plain ``nn.Linear`` (no quantized or
LoRA subclass, no accelerate hook that moves weights) with real floating-point weights (no
quantized tensor subclass) of one dtype on one device; a layer that does not qualify runs
unfused. Built once per model: a second engine on the same model finds the fused tensors on
the modules and reuses them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

_ATTR = "_draftling_fused"  # where a fused weight pair lives on its HF module (not a parameter)
# The MLPs whose forward is down(act(gate(x)) * up(x)), the form the fused path computes.
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")


class FusedLinear(NamedTuple):
    """The concatenated weight [sum of outs, in], its bias (or None) and each part's width."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.nn.functional.linear(x, self.weight, self.bias).split(self.sizes, -1)


class FusedLayer(NamedTuple):
    qkv: FusedLinear | None
    gate_up: FusedLinear | None


def _fusable(mods: list) -> bool:
    """Plain nn.Linear modules with real weights of one dtype on one device, biased alike."""
    if any(type(m) is not nn.Linear or hasattr(m, "_hf_hook") for m in mods):
        return False
    ws = [m.weight for m in mods]
    if any(type(w.data) is not torch.Tensor or not w.is_floating_point() for w in ws):
        return False  # a quantized tensor subclass (torchao) or integer weights: not plain
    if any(w.is_meta or w.dtype != ws[0].dtype or w.device != ws[0].device for w in ws):
        return False
    return all((m.bias is None) == (mods[0].bias is None) for m in mods)


def _still_bound(fused: FusedLinear, mods: list[nn.Linear]) -> bool:
    """The modules' weights are still the views made at fusing (not replaced or moved since)."""
    offset = 0
    for m, n in zip(mods, fused.sizes):
        w = m.weight
        if w.untyped_storage().data_ptr() != fused.weight.untyped_storage().data_ptr():
            return False
        if w.data_ptr() != fused.weight[offset].data_ptr() or w.shape[0] != n:
            return False
        offset += n
    return True


@torch.no_grad()
def _fuse(owner, names: tuple[str, ...]) -> FusedLinear | None:
    found = [getattr(owner, n, None) for n in names]
    if any(m is None for m in found) or not _fusable(found):
        return None
    mods: list[nn.Linear] = found  # type: ignore[assignment]  # all plain nn.Linear (_fusable)
    done = getattr(owner, _ATTR, None)
    if done is not None and _still_bound(done, mods):
        return done
    sizes = tuple(m.weight.shape[0] for m in mods)
    weight = torch.cat([m.weight for m in mods])
    bias = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None
    # Rebind each module's parameters as views: the old tensors are freed, memory stays flat.
    for m, w, b in zip(mods, weight.split(sizes), bias.split(sizes) if bias is not None else [None] * len(mods)):
        grad = m.weight.requires_grad
        m.weight = nn.Parameter(w, requires_grad=grad)
        if b is not None:
            m.bias = nn.Parameter(b, requires_grad=grad)
    fused = FusedLinear(weight, bias, sizes)
    object.__setattr__(owner, _ATTR, fused)  # a plain attribute: not in the state dict
    return fused


def fuse_layer(layer) -> FusedLayer:
    """Fuse one Llama-shaped decoder layer's projections where they qualify (see the module)."""
    qkv = _fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
    mlp = layer.mlp
    gate_up = _fuse(mlp, ("gate_proj", "up_proj")) if type(mlp).__name__ in GATED_MLPS else None
    return FusedLayer(qkv, gate_up)
