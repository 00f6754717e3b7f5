"""Write a trained EAGLE-3 head in the vLLM "speculators" layout (``Eagle3Speculator``).

The checks, tensors, layer config and atomic write it shares with the SGLang layout are in
export/formats.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftling.draft.model import NORM_FLAGS, Eagle3Draft
from draftling.errors import DraftlingError
from draftling.export.conventions import to_engine_aux_layer_ids
from draftling.export.files import draft_tensors, resolve_dtype, weights_dtype_name, write_export
from draftling.export.formats import check_draft, llama_layer_fields

SPECULATORS_ARCHITECTURE = "Eagle3Speculator"

# Our decoder layer keeps the UN-normed h on the residual and feeds hidden_norm(h) only
# into the attention input (draft/model.py, Eagle3DecoderLayer.forward). In speculators'
# terms that is norm_before_residual = False. Confirmed in:
# - vllm-project/speculators src/speculators/models/eagle3/model_definitions.py
#   (Eagle3FirstLayerMixin.forward): ``residual = hidden`` is taken before
#   ``hidden = self.hidden_norm(hidden)``, and only ``if self.norm_before_residual:
#   residual = hidden`` swaps in the normed one; config default False
#   (src/speculators/models/eagle3/config.py).
# - vllm-project/vllm vllm/model_executor/models/llama_eagle3.py: ``norm_before_residual``
#   picks ``_norm_before_residual`` (residual = hidden_norm(h)) over
#   ``_norm_after_residual`` (residual = h, then hidden_norm) -- ours is the latter.
# - vllm/transformers_utils/configs/speculators/algos.py (update_eagle3) reads
#   ``config_dict.get("norm_before_residual", True)``: an absent key means True there, the
#   opposite of our layer, so the key is always written explicitly.
NORM_BEFORE_RESIDUAL = False


@dataclass(frozen=True)
class ExportWeights:
    """What model.safetensors holds beside the head's own tensors, and in which dtype."""

    include_embedding: bool = False
    embedding: torch.Tensor | None = None  # the target's, needed with include_embedding
    dtype: torch.dtype | str = torch.bfloat16  # floating tensors cast to it ("keep" keeps them)


def export_speculators(
    draft: Eagle3Draft,
    out_dir: str | os.PathLike,
    *,
    verifier_name_or_path: str,
    verifier_architectures: list[str],
    speculative_tokens: int = 3,
    target_config=None,
    **weights,
) -> Path:
    """Write ``draft`` in the vLLM "speculators" layout (``Eagle3Speculator``).

    Tensor names follow speculators' Eagle3 model and its EAGLE-3 converter
    (``midlayer.`` -> ``layers.0.``; ``fc.``, ``norm.``, ``lm_head.``, ``d2t``, ``t2d``,
    ``embed_tokens.`` kept). Aux-layer ids are always written, in vLLM numbering.
    ``norm_before_residual`` is written explicitly (False; see NORM_BEFORE_RESIDUAL), and the
    EAGLE-3.1 flags at the top. ``weights``: ExportWeights' fields (as export_sglang takes them).
    """
    w = ExportWeights(**weights)
    _check_verifier(verifier_name_or_path, verifier_architectures, speculative_tokens)
    check_draft(draft, target_config, w.include_embedding, w.embedding)
    ids = [int(i) for i in draft.config.eagle_aux_hidden_state_layer_ids]
    dt = resolve_dtype(w.dtype)
    full_vocab = int(draft.config.draft_vocab_size) == int(draft.config.vocab_size)
    # speculators registers d2t/t2d only when draft_vocab_size != the verifier's vocab.
    tensors = draft_tensors(
        draft, dt, layer_prefix="layers.0.", include_embedding=w.include_embedding, embedding=w.embedding,
        include_vocab_maps=not full_vocab,
    )  # fmt: skip

    weights_dtype = weights_dtype_name(tensors)
    layer_cfg = llama_layer_fields(draft, target_config)
    norms = {k: layer_cfg.pop(k) for k in NORM_FLAGS if k in layer_cfg}  # vLLM reads them at the top
    # vLLM builds the draft's HF config from this nested one: without a dtype there it is
    # left to the engine's default. Both spellings: transformers 5 reads ``dtype``, 4 ``torch_dtype``.
    layer_cfg["dtype"] = layer_cfg["torch_dtype"] = weights_dtype
    cfg: dict[str, Any] = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_cfg,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": str(verifier_name_or_path),
                "architectures": [str(a) for a in verifier_architectures],
            },
        },
        "draft_vocab_size": int(draft.config.draft_vocab_size),
        "norm_before_residual": NORM_BEFORE_RESIDUAL,
        "target_hidden_size": int(getattr(draft.config, "target_hidden_size", draft.config.hidden_size)),
        "eagle_aux_hidden_state_layer_ids": to_engine_aux_layer_ids(ids, "speculators"),
        "torch_dtype": weights_dtype,
        **norms,
    }
    return write_export(out_dir, cfg, tensors)


def _check_verifier(verifier_name_or_path: str, verifier_architectures, speculative_tokens) -> None:
    """Refuse a missing verifier, architectures that are not a list of names, or < 1 token."""
    if not verifier_name_or_path:
        raise DraftlingError("export_speculators needs verifier_name_or_path (the target model)")
    if (
        not isinstance(verifier_architectures, (list, tuple))
        or not verifier_architectures
        or not all(isinstance(a, str) and a for a in verifier_architectures)
    ):
        raise DraftlingError(
            f"verifier_architectures must be a non-empty list of names, got {verifier_architectures!r}"
        )
    if int(speculative_tokens) < 1:
        raise DraftlingError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
