"""Stage 1: load any HF causal LM (hub id, local dir, GGUF file) and read its aux hidden states."""

from draftling.target.aux import aux_hidden_states, default_aux_layer_ids, validate_aux_layer_ids
from draftling.target.load import Target, load_target, load_target_from_config, resolve_device, resolve_target

__all__ = [
    "Target",
    "aux_hidden_states",
    "default_aux_layer_ids",
    "load_target",
    "load_target_from_config",
    "resolve_device",
    "resolve_target",
    "validate_aux_layer_ids",
]
