"""Serving-engine conventions, written down once: aux-layer ids and the vocab maps.

Every translation between draftling's own numbering and an engine's lives here, so
the off-by-one that silently collapses acceptance has exactly one place to be wrong
(and one test file that pins it: tests/test_export.py).
"""

from __future__ import annotations

from draftling.draft.vocab import check_vocab_maps  # noqa: F401  (re-exported: one implementation)
from draftling.errors import DraftlingError
from draftling.target.aux import default_aux_layer_ids

# Offset to ADD to a draftling id to get the id an engine expects in its config.
#
# draftling: id i  ==  HF ``output_hidden_states[i]``  (== the input to 0-indexed layer i).
#
# vLLM (vllm/model_executor/models/llama.py, LlamaModel.forward): before running layer
#   ``idx`` it appends ``hidden_states + residual`` when ``idx in aux_hidden_state_layers``,
#   i.e. an explicit id k is the INPUT of layer k == HF hidden_states[k]. vLLM takes the ids
#   from the TOP-LEVEL ``eagle_aux_hidden_state_layer_ids`` of the draft config
#   (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, get_eagle3_aux_layers_from_config);
#   a speculators config forwards its top-level key there
#   (vllm/transformers_utils/configs/speculators/algos.py, update_eagle3). Offset 0.
#
# SGLang (python/sglang/srt/models/llama.py, LlamaForCausalLM.set_eagle3_layers_to_capture):
#   explicit ids become ``layers_to_capture = [k + 1 for k in layer_ids]`` and LlamaModel
#   captures the input of layer ``i`` for i in layers_to_capture, i.e. k is HF
#   hidden_states[k + 1]. SGLang reads the ids only from ``eagle_config`` of the draft config
#   (model_runner: ``eagle_config["eagle_aux_hidden_state_layer_ids"]``). Offset -1.
#
# Both engines' defaults (ids absent) capture HF hidden_states [2, L//2, L-3], which is
# also draftling's default, so a head trained on the defaults can leave the ids out.
_ENGINE_OFFSET = {"draftling": 0, "vllm": 0, "speculators": 0, "sglang": -1}

ENGINES = tuple(_ENGINE_OFFSET)


def _offset(engine: str) -> int:
    try:
        return _ENGINE_OFFSET[engine]
    except KeyError:
        raise DraftlingError(f"unknown serving engine {engine!r}; expected one of {ENGINES}") from None


def to_engine_aux_layer_ids(ids: list[int], engine: str) -> list[int]:
    """Translate draftling aux-layer ids (HF ``output_hidden_states`` indices) into the ids
    ``engine`` expects in its draft config.

    - ``"vllm"`` / ``"speculators"``: k means hidden_states[k], so ids are unchanged.
    - ``"sglang"``: k means hidden_states[k + 1], so each id is written minus 1.

    A head trained on hidden_states[2], [L//2], [L-3] (the default) is therefore written as
    [1, L//2 - 1, L - 4] for SGLang and as [2, L//2, L-3] for vLLM. Raises DraftlingError
    when an id cannot be expressed (hidden_states[0], the embedding, has no SGLang id).
    """
    off = _offset(engine)
    out = [int(i) + off for i in ids]
    if any(i < 0 for i in out):
        raise DraftlingError(
            f"aux layer ids {list(ids)} cannot be expressed for {engine} "
            f"(would be {out}); EAGLE-3 never uses hidden_states[0]"
        )
    return out


def from_engine_aux_layer_ids(ids: list[int], engine: str) -> list[int]:
    """Inverse of :func:`to_engine_aux_layer_ids`: an engine's config ids back to draftling's."""
    off = _offset(engine)
    return [int(i) - off for i in ids]


def is_default_aux_layer_ids(ids: list[int], num_layers: int | None = None) -> bool:
    """Whether ``ids`` (draftling convention) are the EAGLE-3 default [2, L//2, L-3].

    With ``num_layers`` the check is exact. Without it, L is inferred from the last id
    (L = ids[2] + 3) and the ids must then match that L's default.
    """
    ids = [int(i) for i in ids]
    if len(ids) != 3:
        return False
    if num_layers is None:
        num_layers = ids[2] + 3
    return ids == default_aux_layer_ids(num_layers)
