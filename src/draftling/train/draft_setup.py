"""The draft a run trains: built on the host (random init, vocab maps, a warm start), the memory
policy resolved (train.memory_policy, the rule in memory_fit.fast_settings_fit), cast and placed
on the device; and a plain copy with the full weights for saving (``host_draft``)."""

from __future__ import annotations

import torch

from draftling.config import RunConfig, TrainConfig
from draftling.draft.block import METHOD as BLOCK_METHOD
from draftling.draft.block import BlockDraft, block_config_from_target
from draftling.draft.model import NORM_FLAGS, Eagle3Draft, draft_config_from_target, init_from_target
from draftling.draft.store import new_draft
from draftling.errors import ConfigError
from draftling.target import Target
from draftling.train.distributed import full_model_state, is_sharded, unwrap
from draftling.train.memory import DraftShape, MemoryOptions
from draftling.train.memory_fit import fast_settings_fit
from draftling.train.settings import (
    FAST_MEMORY_SHARE,
    draft_param_dtype,
    memory_options,
    optimizer_offload,
    pad_multiple,
)
from draftling.train.warmstart import WarmStart, keep_norms, keep_window


def build_draft(cfg: RunConfig, target: Target, vocab, warm: WarmStart | None = None) -> Eagle3Draft | BlockDraft:
    if warm is not None:
        keep_method(warm.draft, cfg, warm.report["init_from"])
    if cfg.draft.method == BLOCK_METHOD:
        return build_block_draft(cfg, target, vocab, warm)
    if warm is not None:  # --init-from: the head's working copy, its maps already set
        keep_window(warm.draft, cfg.draft.window, warm.report["init_from"])
        keep_norms(warm.draft, cfg.draft, warm.report["init_from"])
        return warm.draft
    overrides: dict = {k: getattr(cfg.draft, k) for k in NORM_FLAGS}
    if cfg.draft.intermediate_size is not None:
        if cfg.draft.intermediate_size < 1:
            raise ConfigError(
                f"draft.intermediate_size={cfg.draft.intermediate_size}: expected a positive "
                "width or null (the target's)"
            )
        overrides["intermediate_size"] = cfg.draft.intermediate_size
    config = draft_config_from_target(target.config, vocab.size, target.aux_layer_ids, cfg.draft.window, **overrides)
    draft = Eagle3Draft(config)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    if cfg.draft.init_from_target:
        init_from_target(draft, target.model, vocab.t2d)
    return draft


def build_block_draft(cfg: RunConfig, target: Target, vocab, warm) -> BlockDraft:
    """A dflash head: ``train.ttt_steps`` drafts a block (its anchor makes ttt_steps + 1), its
    output side started from the target's (the published design keeps the target's head)."""
    dc = cfg.draft
    unsupported = {"window": dc.window, **{k: getattr(dc, k) for k in NORM_FLAGS}}
    if any(unsupported.values()):
        names = ", ".join(f"draft.{k}" for k, v in unsupported.items() if v)
        raise ConfigError(f"draft.method=dflash does not take {names} (EAGLE-3 options)")
    if warm is not None:  # --init-from: the head's working copy, its layout and maps kept
        return warm.draft
    mask = dc.mask_token_id if dc.mask_token_id is not None else mask_token(target)
    steps = cfg.train.ttt_steps
    config = block_config_from_target(
        target.config, vocab.size, target.aux_layer_ids, steps + 1, dc.layers, mask, causal=dc.block_causal
    )
    if dc.intermediate_size is not None:
        config.intermediate_size = dc.intermediate_size
    draft = BlockDraft(config)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    init_from_target(draft, target.model, vocab.t2d)
    return draft


def keep_method(draft, cfg: RunConfig, where: str) -> None:
    """A warm start goes on training the head it loads: its type, and for a dflash head its
    block (train.ttt_steps + 1) and depth (draft.layers), are the head's; a run asking for
    another is refused rather than silently trained as something else."""
    method = getattr(draft.config, "draft_method", None) or "eagle3"
    if method != cfg.draft.method:
        raise ConfigError(
            f"--init-from {where}: a {method} head, but draft.method={cfg.draft.method}; set draft.method={method}"
        )
    if isinstance(draft, BlockDraft):
        own = {"train.ttt_steps": draft.block_size - 1, "draft.layers": len(draft.layers)}
        asked = {"train.ttt_steps": cfg.train.ttt_steps, "draft.layers": cfg.draft.layers}
        wrong = [f"{k}={asked[k]} (the head's: {own[k]})" for k in own if own[k] != asked[k]]
        if wrong:
            raise ConfigError(f"--init-from {where}: the dflash head's layout differs: {', '.join(wrong)}")


def mask_token(target: Target) -> int:
    """The tokenizer's mask token, else its pad, else its eos (speculators' order, less a new token)."""
    tok = target.tokenizer
    for name in ("mask_token_id", "pad_token_id", "eos_token_id"):
        value = getattr(tok, name, None)
        if isinstance(value, int):
            return value
    raise ConfigError("draft.mask_token_id: the tokenizer has no mask, pad or eos token; set one")


def resolve_memory_policy(
    tc: TrainConfig,
    device,
    shape: DraftShape,
    batch: int,
    seq: int,
    param_dtype: torch.dtype,
    offload: bool,
    embed_dtype,
) -> tuple[TrainConfig, str]:
    """The TrainConfig to train with, and why: memory_fit.fast_settings_fit over the memory free on
    the device. ``shape``: the draft's; ``batch``: sequences per process and step; ``seq``: the
    longest sequence; ``embed_dtype``: the target's (a dtype or its name)."""
    device = torch.device(device)
    if tc.memory_policy == "config" or device.type != "cuda":
        return tc, "as configured"

    def options_for(fast: TrainConfig) -> tuple[MemoryOptions, int]:
        mem = memory_options(fast, device, param_dtype=param_dtype)
        options = MemoryOptions.from_unroll_options(
            mem,
            optimizer_offload=offload,
            draft_dtype=param_dtype,
            embed_dtype=embed_dtype,
            embedding_on_host=tc.embedding_on_host,
        )
        multiple = pad_multiple(fast, mem["attention"])  # batches are padded up to it
        return options, -(-seq // multiple) * multiple

    free = torch.cuda.mem_get_info(device)[0]
    fit = fast_settings_fit(tc, shape, batch, free, options_for)
    need, gib = fit.need, 2**30
    if fit.fits:
        return fit.config, (
            f"fast: estimated draft peak {need / gib:.1f} GiB of {free / gib:.1f} GiB free, so no "
            f"recompute and loss chunks of {fit.config.loss_chunk_tokens}"
        )
    return tc, (
        f"as configured: the fast settings would need ~{need / gib:.1f} GiB, over "
        f"{FAST_MEMORY_SHARE:.0%} of the {free / gib:.1f} GiB free"
    )


def place_draft(draft, device, dtype: torch.dtype):
    """Cast the draft's weights (on the host, so the device never holds an fp32 copy of a
    bf16 draft) and move it to the device; the rotary table stays fp32."""
    return draft.cast_weights(dtype).to(device)


def prepare_draft(cfg: RunConfig, target: Target, vocab, device, sharded: bool = False, warm: WarmStart | None = None):
    """Build the draft and place it on the device as training needs it. Returns
    (draft, optimizer offload on?, the draft's compute dtype).

    Build order: the teacher (the target) is already loaded and resident. The draft is built
    on the CPU (random init, vocab maps, optional warm start from the target's head) and moved
    to the device once, after the teacher, so none of its build-time temporaries touch device
    memory. train.build_on_host=false moves it as built instead (same weights: the init runs
    on the host RNG either way)."""
    tc = cfg.train
    with torch.device("cpu"):
        draft = build_draft(cfg, target, vocab, warm)
    if not tc.build_on_host:
        draft = draft.to(device)
    n_params = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    offload = optimizer_offload(tc, device, n_params)
    param_dtype = draft_param_dtype(tc, device, n_params)
    # FSDP keeps fp32 shards and casts for compute itself (its mixed-precision policy).
    place_draft(draft, device, torch.float32 if sharded else param_dtype)
    return draft, offload, param_dtype


def host_draft(objective, config) -> Eagle3Draft | BlockDraft:
    """A plain draft with the full weights, for saving (gathers shards on every rank)."""
    draft = unwrap(objective)
    if not is_sharded(draft):
        return draft
    copy = new_draft(config)
    copy.load_state_dict(full_model_state(objective), strict=False)
    return copy


def param_counts(draft: torch.nn.Module, target: Target) -> dict:
    """What the draft trains and what its forward reads frozen (its own frozen parameters and the
    target's input embedding, which it embeds tokens with), the target's parameters, and the
    trainable share of the target's: a head that trains the wrong thing shows here."""
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)
    frozen += target.input_embeddings().weight.numel()
    total = sum(p.numel() for p in target.model.parameters())
    return {
        "trainable": trainable,
        "frozen": frozen,
        "target": total,
        "share_of_target": trainable / total if total else None,
    }


def params_line(p: dict) -> str:
    share = f" ({p['share_of_target']:.1%} of the target's {p['target'] / 1e6:.2f}M)" if p["share_of_target"] else ""
    return (
        f"{p['trainable'] / 1e6:.2f}M trainable params{share}, {p['frozen'] / 1e6:.2f}M frozen "
        "(the target's embedding included)"
    )
