"""What every export layout shares: the file names engines read, the export dtype, a head's
tensors as a layout saves them, and the atomic write (export/formats.py: SGLang and
speculators EAGLE-3; export/dflash.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftling.draft.model import DraftHead
from draftling.dtypes import dtype_name
from draftling.errors import DraftlingError
from draftling.io import atomic_output_dir, write_json

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``"keep"``/None -> None (keep each tensor's dtype); names like "bfloat16" -> dtype."""
    if dtype is None or dtype == "keep":
        return None
    resolved: Any
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        resolved = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise DraftlingError(f"export dtype must be a floating torch dtype or 'keep', got {dtype!r}")
    return resolved


def write_export(out_dir, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Into a directory the caller has cleared with ``io.check_output_dir(out_dir, "export", ...)``."""
    out_dir = Path(out_dir)
    with atomic_output_dir(out_dir, "export") as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        write_json(tmp / CONFIG_NAME, config)
    return out_dir


def draft_tensors(
    draft: DraftHead,
    dtype: torch.dtype | None,
    *,
    layer_prefix: str,
    include_embedding: bool,
    embedding: torch.Tensor | None,
    include_vocab_maps: bool = True,
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in draft.trainable_state_dict().items():
        t = t.detach().cpu()
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        elif dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if name in ("d2t", "t2d") and not include_vocab_maps:
            continue
        if name.startswith("midlayer."):
            name = layer_prefix + name[len("midlayer.") :]
        out[name] = t.contiguous().clone()
    if include_embedding:
        if embedding is None:  # callers check this first (formats.check_draft)
            raise DraftlingError("include_embedding needs the target's embedding")
        e = embedding.detach().cpu()
        out["embed_tokens.weight"] = (e.to(dtype) if dtype is not None else e).contiguous().clone()
    return out


def weights_dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    return dtype_name(floats.pop()) if len(floats) == 1 else "float32"
