"""The tokenized data files `draftling data` writes (train.jsonl, val.jsonl): one JSON row per
conversation with ``id``, ``source``, ``input_ids`` and ``loss_mask``, read back here for
every later stage (vocab, train, extract, bench)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftling.errors import DataError


@dataclass
class TokenizedExample:
    id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]


def load_tokenized(path: str | Path, vocab_size: int | None = None) -> list[TokenizedExample]:
    """The rows of a prepared jsonl; ``vocab_size``: refuse a token id outside [0, vocab_size)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: prepared dataset not found (run `draftling data` first)")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                ex = TokenizedExample(
                    str(r["id"]), str(r.get("source", "")), list(r["input_ids"]), list(r["loss_mask"])
                )
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{path.name}:{lineno}: bad tokenized row: {e}") from None
            if len(ex.input_ids) != len(ex.loss_mask):
                raise DataError(f"{path.name}:{lineno}: input_ids and loss_mask differ in length")
            limit = vocab_size if vocab_size is not None else float("inf")
            bad = next((t for t in ex.input_ids if not isinstance(t, int) or not 0 <= t < limit), None)
            if bad is not None:
                raise DataError(
                    f"{path}:{lineno}: token id {bad!r} is outside the target's vocabulary "
                    f"(0..{limit - 1}); was this data made for another target?"
                )
            rows.append(ex)
    if not rows:
        raise DataError(f"{path}: no examples")
    return rows
