"""Write and read a block drafter (draft/block.py) in the speculators ``dflash`` layout, the
one speculators 0.9 saves and vLLM 0.32 loads (``DFlashDraftModel``).

The config names the method (``speculators_model_type: dflash``), the block, the mask token,
the aux layers (hidden_states indices, 0 = the embedding output: draftling's own numbering)
and a Qwen3 ``transformer_layer_config`` for the decoder layers. Our blocks attend to
themselves both ways in training (unless ``block_causal``), so every layer is
``full_attention`` and ``sliding_window_non_causal`` says which: vLLM makes every layer
non-causal when it is true and causal when it is false. Tensors keep the module's names;
``d2t``/``t2d`` are written only for a reduced vocabulary (vLLM ignores ``t2d``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftling.draft.block import METHOD, BlockDraft
from draftling.draft.store import load_weights
from draftling.errors import DraftlingError, one_line
from draftling.export.files import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    draft_tensors,
    resolve_dtype,
    weights_dtype_name,
    write_export,
)

ARCHITECTURE = "DFlashDraftModel"
_LAYER_KEYS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_LAYER_KEYS += ("num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings")


def export_dflash(
    draft: BlockDraft,
    out_dir: str | os.PathLike,
    *,
    verifier_name_or_path: str,
    verifier_architectures: list[str],
    dtype: torch.dtype | str = torch.bfloat16,
) -> Path:
    """``draft`` as a speculators ``dflash`` checkpoint (config.json + model.safetensors)."""
    if not verifier_name_or_path or not verifier_architectures:
        raise DraftlingError("export_dflash needs the verifier's name or path and its architectures")
    cfg = draft.config
    full_vocab = int(cfg.draft_vocab_size) == int(cfg.vocab_size)
    dt = resolve_dtype(dtype)
    # speculators registers d2t/t2d only when the draft vocab is smaller than the verifier's.
    tensors = draft_tensors(
        draft, dt, layer_prefix="", include_embedding=False, embedding=None, include_vocab_maps=not full_vocab
    )
    layer = {k: getattr(cfg, k) for k in _LAYER_KEYS}
    layer.update(
        model_type="qwen3",
        attention_bias=False,
        tie_word_embeddings=False,
        rope_parameters=dict(cfg.rope_parameters or {}),
        layer_types=["full_attention"] * int(cfg.num_hidden_layers),
        use_sliding_window=False,
        dtype=weights_dtype_name(tensors),
    )
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": METHOD,
        "transformer_layer_config": layer,
        "draft_vocab_size": int(cfg.draft_vocab_size),
        "block_size": int(cfg.block_size),
        "mask_token_id": int(cfg.mask_token_id),
        "target_hidden_size": int(cfg.target_hidden_size),
        "aux_hidden_state_layer_ids": [int(i) for i in cfg.eagle_aux_hidden_state_layer_ids],
        # vLLM: false makes every layer causal (dflash_config.causal), true none of them.
        "sliding_window_non_causal": not draft.causal,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": METHOD,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(cfg.block_size) - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier_name_or_path), "architectures": list(verifier_architectures)},
        },
        "draftling": {"target_num_hidden_layers": int(cfg.target_num_hidden_layers)},  # engines ignore it
    }
    return write_export(out_dir, config, tensors)


def load_dflash(path: str | os.PathLike) -> BlockDraft:
    """A ``dflash`` checkpoint written by :func:`export_dflash` back as a BlockDraft, from its
    own config (full-vocab checkpoints get identity vocab maps)."""
    from transformers import LlamaConfig

    from draftling.draft.block import block_config_from_target

    path = Path(path)
    raw = read_dflash_config(path)
    layer, ids = raw["transformer_layer_config"], raw["aux_hidden_state_layer_ids"]
    like = LlamaConfig(
        **{k: layer[k] for k in _LAYER_KEYS if k not in ("hidden_act", "num_hidden_layers")},
        rope_parameters=layer.get("rope_parameters"),
        num_hidden_layers=raw.get("draftling", {}).get("target_num_hidden_layers", max(ids) + 1),
    )
    cfg = block_config_from_target(
        like,
        raw["draft_vocab_size"],
        ids,
        raw["block_size"],
        layer["num_hidden_layers"],
        raw["mask_token_id"],
        causal=not raw.get("sliding_window_non_causal", False),
    )
    draft = BlockDraft(cfg)
    try:
        state = load_file(str(path / WEIGHTS_NAME))
    except Exception as e:  # safetensors raises its own error type for a truncated or garbage file
        raise DraftlingError(f"{path / WEIGHTS_NAME}: unreadable ({one_line(e)})") from None
    if "d2t" not in state:
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    load_weights(draft, state, path / WEIGHTS_NAME, CONFIG_NAME)
    return draft


def read_dflash_config(path: Path) -> dict:
    try:
        raw = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError) as e:
        raise DraftlingError(f"{path / CONFIG_NAME}: not a readable dflash config ({one_line(e)})") from None
    kind = raw.get("speculators_model_type") if isinstance(raw, dict) else None
    if kind != METHOD:
        raise DraftlingError(f"{path / CONFIG_NAME}: speculators_model_type is {kind!r}, not 'dflash'")
    return raw
