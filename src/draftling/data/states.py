"""The target's states kept from regeneration (``data.keep_teacher_states``).

Generating a reply runs the target over the prompt and every reply token; training would run
it over the same tokens again to get its aux and final states. The data stage keeps them
instead, one file per split beside the tokenized rows::

    DATA/teacher_states_train.safetensors
        offsets  int64 [n_rows + 1]   row j of train.jsonl is states offsets[j]:offsets[j+1]
        aux      [N_tokens, 3*H]      low/mid/high aux states (the target's dtype)
        final    [N_tokens, H]        final-normed hidden state (the output head's input)
      metadata: data_hash (sha256 of train.jsonl), target, aux_layer_ids

A row's states cover exactly its tokens: with states kept, the data stage writes each row as
the ids the target was fed (see prepare.tokenize_records), and a file whose jsonl changed
since is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftling.errors import DataError
from draftling.io import atomic_path, hash_dataset_file

FORMAT = "1"


def states_path(data_dir: str | Path, split: str) -> Path:
    return Path(data_dir) / f"teacher_states_{split}.safetensors"


def write_states(
    path: str | Path,
    jsonl_path: str | Path,
    rows: list[tuple[torch.Tensor, torch.Tensor]],
    target_name: str,
    aux_layer_ids: list[int],
) -> int:
    """Write (aux, final) per row of ``jsonl_path``, in its order; returns the bytes written."""
    from safetensors.torch import save_file

    offsets = [0]
    for aux, _ in rows:
        offsets.append(offsets[-1] + aux.shape[0])
    tensors = {
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "aux": torch.cat([a for a, _ in rows]).contiguous(),
        "final": torch.cat([f for _, f in rows]).contiguous(),
    }
    meta = {
        "format": FORMAT,
        "data_hash": hash_dataset_file(jsonl_path),
        "target": target_name,
        "aux_layer_ids": json.dumps(list(aux_layer_ids)),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return sum(t.numel() * t.element_size() for t in tensors.values())


class StoredStates:
    """Read-only view of one split's file. ``matches`` says whether it belongs to a jsonl file
    and aux layers; ``rows(j)`` returns row j's (aux, final)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        try:
            self._file = safe_open(str(self.path), "pt")
            self.meta = self._file.metadata() or {}
            self.offsets = self._file.get_tensor("offsets").tolist()
            self._aux = self._file.get_slice("aux")
            self._final = self._file.get_slice("final")
        except Exception as e:  # a truncated or foreign file
            raise DataError(f"{self.path}: unreadable teacher-states file: {e}") from None

    def matches(self, jsonl_path: str | Path, aux_layer_ids: list[int]) -> str | None:
        """None if the file was written for this jsonl and these aux layers, else why not."""
        if self.meta.get("format") != FORMAT:
            return f"format {self.meta.get('format')!r}, expected {FORMAT}"
        if self.meta.get("data_hash") != hash_dataset_file(jsonl_path):
            return f"{Path(jsonl_path).name} changed since the states were kept"
        if json.loads(self.meta.get("aux_layer_ids", "null")) != list(aux_layer_ids):
            return f"kept for aux layers {self.meta.get('aux_layer_ids')}, the target uses {list(aux_layer_ids)}"
        return None

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    def rows(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.offsets[j], self.offsets[j + 1]
        return self._aux[a:b], self._final[a:b]
