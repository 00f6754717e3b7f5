"""The attention of the EAGLE-3 training-time-test (TTT) unroll (see train/ttt.py).

Attention at step j: the query at t sees the step-0 keys at positions <= t (causal) and
the keys of steps 1..j at position t only (the diagonal), as a tree branch would. With a
sliding window W (the draft config's ``sliding_window``), the step-0 keys are only those at
positions > t+j-W: the query sits at position t+j, and the engine windows by position.

Backends: "sdpa" (explicit scores; works everywhere, with backward on CPU) or "flex"
(``flex_attention`` over the concatenated keys with a TTT ``mask_mod``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from draftling.draft.model import repeat_kv

ATTENTION_BACKENDS = ("sdpa", "flex")


def ttt_attention(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    backend: str = "sdpa",
    window: int = 0,
) -> torch.Tensor:
    """Attention of TTT step j = len(keys) - 1, stateless.

    q: [B, nh, T, d]; keys[0]/values[0]: the step-0 keys/values [B, nkv, T, d] (causal);
    keys[i]/values[i] for i > 0: step i's keys/values, seen at the query's own position only.
    ``window`` > 0: the query at row t sits at position t+j and sees the step-0 keys at
    positions t+j-W+1 .. t only, as the engine's sliding window does; its own branch (the
    diagonal) stays visible.
    """
    if backend == "flex":
        return flex_ttt_attention(q, keys, values, window)
    if backend != "sdpa":
        raise ValueError(f"unknown TTT attention backend {backend!r}; known: {ATTENTION_BACKENDS}")
    if window:
        return banded_ttt_attention(q, keys, values, window)
    n_rep = q.shape[1] // keys[0].shape[1]
    k0, v0 = repeat_kv(keys[0], n_rep), repeat_kv(values[0], n_rep)
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
    scale = 1.0 / math.sqrt(q.shape[-1])
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    s0 = (q @ k0.transpose(-1, -2)) * scale
    s0 = s0.masked_fill(~causal, float("-inf"))
    sd = torch.stack([(q * repeat_kv(dk, n_rep)).sum(-1) for dk in keys[1:]], dim=-1) * scale  # [B,h,T,j]
    p = torch.cat([s0, sd], dim=-1).float().softmax(-1).to(q.dtype)
    out = p[..., :t] @ v0
    dv = torch.stack([repeat_kv(dv, n_rep) for dv in values[1:]], dim=-2)  # [B,h,T,j,d]
    return out + (p[..., t:, None] * dv).sum(-2)


def banded_ttt_attention(q, keys, values, window: int) -> torch.Tensor:
    """:func:`ttt_attention` with a window, in query blocks of at least ``window`` rows: a
    block attends to the step-0 keys of itself and the block before (which hold its band), so
    memory is O(T*W) and no [T, T] tensor exists. Blocks come from ``split`` (not slicing):
    its backward is one concatenation, where a slice's would zero a [T, d] gradient per block."""
    t, j = q.shape[2], len(keys) - 1
    n_rep, scale = q.shape[1] // keys[0].shape[1], 1.0 / math.sqrt(q.shape[-1])
    block = min(max(window, 64), t)  # a floor, so a tiny window does not mean thousands of blocks
    qs = q.split(block, 2)
    ks, vs = repeat_kv(keys[0], n_rep).split(block, 2), repeat_kv(values[0], n_rep).split(block, 2)
    sds = dvs = [None] * len(qs)
    if j:  # the diagonal (steps 1..j at the query's own row): [B,h,T,j] scores, [B,h,T,j,d] values
        sds = (torch.stack([(q * repeat_kv(k, n_rep)).sum(-1) for k in keys[1:]], dim=-1) * scale).split(block, 2)
        dvs = torch.stack([repeat_kv(v, n_rep) for v in values[1:]], dim=-2).split(block, 2)
    outs = []
    for i, (qb, sdb, dvb) in enumerate(zip(qs, sds, dvs)):
        a, e = i * block, i * block + qb.shape[2]
        kb, vb = (ks[0], vs[0]) if i == 0 else (torch.cat(ks[i - 1 : i + 1], 2), torch.cat(vs[i - 1 : i + 1], 2))
        rows = torch.arange(a, e, device=q.device)[:, None]
        cols = torch.arange(e - kb.shape[2], e, device=q.device)[None]
        seen = (cols <= rows) & (cols > rows + j - window)  # the query at row t sits at position t+j
        s = (qb @ kb.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
        p = (s if sdb is None else torch.cat([s, sdb], dim=-1)).float().softmax(-1).to(q.dtype)
        out = p[..., : kb.shape[2]] @ vb
        outs.append(out if dvb is None else out + (p[..., kb.shape[2] :, None] * dvb).sum(-2))
    return torch.cat(outs, dim=2)


def ttt_mask_mod(t: int | torch.Tensor, window: int = 0, n_blocks: int = 1):
    """The TTT mask over keys [K0 (T), K1 (T), ..., Kj (T)] concatenated: block 0 causal
    (kv <= q), block i > 0 diagonal (kv - i*T == q). ``t`` may be a 0-dim tensor, so a
    compiled kernel does not specialise (and recompile) on every sequence length.
    ``window`` > 0 (with ``n_blocks`` = j + 1): block 0 only within the window of the
    query's position q+j, as in :func:`banded_ttt_attention`."""
    if window:
        reach = n_blocks - 1 - window  # kv > q + j - W

        def mask_mod(b, h, q_idx, kv_idx):
            step0 = (kv_idx <= q_idx) & (kv_idx > q_idx + reach)
            return step0 | ((kv_idx >= t) & (kv_idx % t == q_idx))

        return mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | ((kv_idx >= t) & (kv_idx % t == q_idx))

    return mask_mod


# flex_attention's block size (torch's default). A block mask is built per sequence length and
# cached; batches padded to a multiple of it (train.pad_to_multiple) reuse a few masks.
FLEX_BLOCK_SIZE = 128
_BLOCK_MASKS: dict = {}
_FLEX_FNS: dict = {}


def ttt_block_mask(t: int, n_blocks: int, device: torch.device, window: int = 0):
    from torch.nn.attention.flex_attention import create_block_mask

    key = (t, n_blocks, str(device), window)
    mask = _BLOCK_MASKS.get(key)
    if mask is None:
        if len(_BLOCK_MASKS) > 256:  # batch lengths vary; keep the cache bounded
            _BLOCK_MASKS.clear()
        t_value = torch.tensor(t, device=device)
        mask_mod = ttt_mask_mod(t_value, window, n_blocks)
        mask = create_block_mask(
            mask_mod,
            None,
            None,
            t,
            n_blocks * t,
            device=device,
            BLOCK_SIZE=FLEX_BLOCK_SIZE,
            _compile=torch.device(device).type == "cuda",
        )
        _BLOCK_MASKS[key] = mask
    return mask


def _flex_fn(device_type: str):
    """flex_attention itself: compiled on CUDA (a fused kernel with a backward); on other
    devices the eager reference path (forward only on CPU in torch 2.13)."""
    fn = _FLEX_FNS.get(device_type)
    if fn is None:
        from torch.nn.attention.flex_attention import flex_attention

        fn = torch.compile(flex_attention, dynamic=None) if device_type == "cuda" else flex_attention
        _FLEX_FNS[device_type] = fn
    return fn


def flex_ttt_attention(q, keys, values, window: int = 0) -> torch.Tensor:
    t = q.shape[2]
    mask = ttt_block_mask(t, len(keys), q.device, window)
    k = keys[0] if len(keys) == 1 else torch.cat(list(keys), dim=2)
    v = values[0] if len(values) == 1 else torch.cat(list(values), dim=2)
    return _flex_fn(q.device.type)(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def flex_usable(device: torch.device | str, training: bool = True) -> tuple[bool, str]:
    """Whether the flex backend can run here, and why not."""
    device = torch.device(device)
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as e:  # pragma: no cover - torch without flex
        return False, f"torch.nn.attention.flex_attention is not available ({e})"
    if device.type == "cpu" and training:
        return False, "flex_attention has no backward on CPU in this torch"
    if device.type not in ("cuda", "cpu"):
        return False, f"flex_attention is not used on {device.type}"
    return True, ""


class TTTAttention:
    """Stateful convenience wrapper around :func:`ttt_attention`: remembers the keys and
    values of every call. The unroll itself keeps that state explicit instead, so a step
    can be recomputed under activation checkpointing."""

    def __init__(self, backend: str = "sdpa", window: int = 0):
        self.backend, self.window = backend, window
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q, k, v):
        self.keys.append(k)
        self.values.append(v)
        return ttt_attention(q, self.keys, self.values, self.backend, self.window)
