"""The dtype names configs, results and files use, and the torch dtypes they stand for: the one
table every stage reads (the target's load, the draft's parameters, offline caches, memory plans)."""

from __future__ import annotations

import torch

# Every name a config may give a dtype by: the torch names and their usual short forms.
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# The torch names alone (what results and file headers write).
CANONICAL = ("float32", "bfloat16", "float16")


def dtype_name(dtype: torch.dtype) -> str:
    """ "bfloat16" for torch.bfloat16: the name results and provenance record."""
    return str(dtype).removeprefix("torch.")


def dtype_bytes(name: str) -> int:
    """Bytes per element of the dtype called ``name`` (any name in DTYPES)."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name].itemsize
