"""What every export layout shares: the file names engines read, the export dtype, and the
atomic write (export/formats.py: SGLang and speculators EAGLE-3; export/dflash.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

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
