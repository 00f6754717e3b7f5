"""The one home of training's resolved settings: a TrainConfig's "auto" values turned into
what this device runs with, one function per decision. The trainer, `plan` (train/memory_fit.py) and the training
bench all read them from here; the config has already checked every name (draftling.config).

``plan`` calls the same functions with a device size given instead of queried.
"""

from __future__ import annotations

import dataclasses

import torch

from draftling.config import AUTO, TrainConfig
from draftling.dtypes import DTYPES, dtype_name
from draftling.hardware import BF16_IF_FAST, bf16_matmul_is_faster
from draftling.target.quant import has_plain_weights
from draftling.train.attention import FLEX_BLOCK_SIZE, flex_usable
from draftling.train.ttt import UnrollOptions

# train.memory_policy=auto: when the draft's estimated peak (train/memory.py) without activation
# recomputation and with large loss chunks stays under this share of the device's free
# memory, train that way: each recompute and each chunk costs host time, and a small draft
# beside a small teacher is bound by the host, not by the device.
FAST_MEMORY_SHARE = 0.5
FAST_LOSS_CHUNK_TOKENS = 16384
# "auto" offloads the optimizer once its fp32 state (masters and two moments, 12 bytes per
# param) would take more than this share of the device's memory; below that the host
# round trip costs more step time than the memory is worth.
OFFLOAD_AUTO_SHARE = 0.02
DRAFT_DTYPES = {n: DTYPES[n] for n in ("float32", "bfloat16")}  # what train.draft_dtype allows


def unroll_options(
    tc: TrainConfig, device, training: bool = True, param_dtype: torch.dtype = torch.float32
) -> UnrollOptions:
    """What ``ttt_unroll`` runs with on this device: the config's TTT depth and step weights
    and its memory options (``memory_options``)."""
    return UnrollOptions(
        steps=tc.ttt_steps, step_weight_decay=tc.step_weight_decay, **memory_options(tc, device, training, param_dtype)
    )


def memory_options(tc: TrainConfig, device, training: bool = True, param_dtype: torch.dtype = torch.float32) -> dict:
    """The unroll's memory options (those fields of ``UnrollOptions``) for this device, with the
    config's "auto" values resolved: see TrainConfig for what each one does.
    ``param_dtype``: the draft's device params (autocast only pays over fp32 params)."""
    from draftling.errors import ConfigError

    device = torch.device(device)
    cuda = device.type == "cuda"
    attention = tc.attention
    if attention == "auto":
        attention = "flex" if cuda and flex_usable(device, training)[0] else "sdpa"
    elif attention == "flex":
        ok, why = flex_usable(device, training)
        if not ok:
            raise ConfigError(f"train.attention=flex: {why}; use train.attention=sdpa (or auto)")
    grad_checkpoint = cuda if tc.grad_checkpoint == AUTO else tc.grad_checkpoint
    # The chunked loss and the layer's halves; evaluation runs the loss eagerly (no_grad).
    compile = compile_draft(tc, device)
    compute = tc.compute_dtype
    if compute == "auto":
        compute = "bfloat16" if cuda and param_dtype == torch.float32 else "float32"
    elif compute == BF16_IF_FAST:
        compute = "bfloat16" if bf16_matmul_is_faster(device.type) else "float32"
    return {
        "loss_chunk_tokens": tc.loss_chunk_tokens,
        "grad_checkpoint": grad_checkpoint,
        "attention": attention,
        "compile": bool(compile and tc.loss_chunk_tokens > 0),
        "compile_layer": bool(compile),
        "autocast": None if compute == "float32" else compute,
    }


def pad_multiple(tc: TrainConfig, attention: str) -> int:
    """``train.pad_to_multiple``, "auto" resolved for the batch's resolved ``attention``: flex's
    block size for flex (a block mask per padded length, built once and cached), else 1."""
    if tc.pad_to_multiple != AUTO:
        return tc.pad_to_multiple
    return FLEX_BLOCK_SIZE if attention == "flex" else 1


def compile_draft(tc: TrainConfig, device) -> bool:
    """``train.compile``, "auto" resolved: on CUDA."""
    return torch.device(device).type == "cuda" if tc.compile == AUTO else tc.compile


def compile_teacher(tc: TrainConfig, device, target_model=None) -> bool:
    """Whether the teacher's decoder layers run compiled: ``train.compile_teacher``, by
    default as ``train.compile`` (auto: on CUDA), except for a quantized teacher (bitsandbytes
    and friends bring their own kernels; a GGUF teacher is dequantized, so it is plain). A
    small target's forward on a GPU is mostly unfused elementwise kernels."""
    if tc.compile_teacher != AUTO:
        return tc.compile_teacher
    if target_model is not None and not has_plain_weights(target_model):
        return False
    return compile_draft(tc, device)


def fast_train_config(tc: TrainConfig) -> TrainConfig:
    """What ``train.memory_policy=auto`` trains with when it fits: no recompute unless asked
    for, and large loss chunks."""
    return dataclasses.replace(
        tc,
        grad_checkpoint=False if tc.grad_checkpoint == AUTO else tc.grad_checkpoint,
        loss_chunk_tokens=max(tc.loss_chunk_tokens, FAST_LOSS_CHUNK_TOKENS) if tc.loss_chunk_tokens else 0,
    )


def optimizer_offload(tc: TrainConfig, device, n_params: int | None = None, device_bytes: int | None = None) -> bool:
    """``train.optimizer_offload``, "auto" resolved: on CUDA when the optimizer's fp32 state
    would take over OFFLOAD_AUTO_SHARE of the device (``device_bytes``: its size, else queried)."""
    if tc.optimizer_offload != AUTO:
        return tc.optimizer_offload
    if torch.device(device).type != "cuda":
        return False
    if n_params is None:
        return True
    total = device_bytes if device_bytes is not None else torch.cuda.get_device_properties(device).total_memory
    return 12 * n_params > OFFLOAD_AUTO_SHARE * total


def draft_param_dtype(
    tc: TrainConfig, device, n_params: int | None = None, device_bytes: int | None = None
) -> torch.dtype:
    """The dtype of the draft's device params (``train.draft_dtype``, "auto" resolved: bf16
    exactly when the optimizer is offloaded, which keeps fp32 masters on the host)."""
    if tc.draft_dtype == "auto":
        return torch.bfloat16 if optimizer_offload(tc, device, n_params, device_bytes) else torch.float32
    return DRAFT_DTYPES[tc.draft_dtype]


def recorded_compute_dtype(unroll: UnrollOptions, param_dtype: torch.dtype | None = None) -> str:
    """The compute dtype a run records, from the unroll options it resolved. Without
    ``param_dtype``: train.compute_dtype as resolved (autocast's dtype, "float32" for none), which
    a checkpoint's meta.json keeps so that a resume trains as the run did. With it: the dtype the
    draft computes in, the params' own where no autocast runs (train_result.json's; a bf16 draft
    without autocast computes in bfloat16 while its resolved setting reads "float32")."""
    if unroll.autocast:
        return unroll.autocast
    return "float32" if param_dtype is None else dtype_name(param_dtype)
