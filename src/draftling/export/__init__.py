"""Ship a trained head in the layouts serving engines load (SGLang, vLLM speculators).

Engine numbering of aux-layer ids and the vocab-map checks live in
:mod:`draftling.export.conventions`; the SGLang writer and the loader in
:mod:`draftling.export.formats`, the speculators writer in :mod:`draftling.export.speculators`.
"""

from draftling.export.conventions import (
    ENGINES,
    check_vocab_maps,
    from_engine_aux_layer_ids,
    is_default_aux_layer_ids,
    to_engine_aux_layer_ids,
)
from draftling.export.formats import export_sglang, load_any_draft, load_sglang_export
from draftling.export.speculators import NORM_BEFORE_RESIDUAL, export_speculators

__all__ = [
    "ENGINES",
    "NORM_BEFORE_RESIDUAL",
    "check_vocab_maps",
    "export_sglang",
    "export_speculators",
    "from_engine_aux_layer_ids",
    "is_default_aux_layer_ids",
    "load_any_draft",
    "load_sglang_export",
    "to_engine_aux_layer_ids",
]
