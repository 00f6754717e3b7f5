"""Token counts of the prompt text in the prompt files, for the draft vocabulary
(``vocab.prompt_weight``).

A reply often copies tokens from its prompt: names, numbers, code identifiers. The target
predicts those confidently, but a draft vocab built from a few hundred replies rarely holds
them. The prompt files hold far more prompts than are regenerated, and counting their tokens
costs seconds. Validation's prompts are left out, so the vocab never sees its text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from draftling.data.prompts import Conversation
from draftling.errors import DataError
from draftling.io import atomic_path

FILE_NAME = "prompt_token_counts.safetensors"


def prompt_text(conv: Conversation) -> str:
    return "\n".join(m["content"] for m in conv.messages if isinstance(m.get("content"), str))


def count_prompt_tokens(tokenizer, convs: Sequence[Conversation], vocab_size: int, batch: int = 1024) -> torch.Tensor:
    """int64 [vocab_size]: how often each token occurs in the conversations' message text
    (tokenized as plain text, in batches: the chat template would add only role tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for start in range(0, len(convs), batch):
        texts = [prompt_text(c) for c in convs[start : start + batch]]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids = torch.as_tensor(ids, dtype=torch.long)
            counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def write_prompt_counts(
    path: str | Path, counts: torch.Tensor, conversations: int, left_out: int, run: str | None = None
) -> None:
    from safetensors.torch import save_file

    meta = {
        "conversations": str(conversations),
        "validation_conversations_left_out": str(left_out),
        **({"data_run": run} if run else {}),
    }
    with atomic_path(path) as tmp:
        save_file({"counts": counts.contiguous()}, str(tmp), metadata=meta)


def read_prompt_counts(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The counts as int64 [vocab_size] (a shorter tokenizer vocab is zero-padded)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"{path}: prompt token counts not found; vocab.prompt_weight > 0 needs them "
            "(`draftling data` writes them; rerun it, or set vocab.prompt_weight=0)"
        )
    counts = load_file(str(path)).get("counts")
    if counts is None or counts.dim() != 1:
        raise DataError(f"{path}: expected a 1-d tensor 'counts'")
    if len(counts) > vocab_size:
        raise DataError(f"{path}: counts cover {len(counts)} tokens, more than the target vocab ({vocab_size})")
    out = torch.zeros(vocab_size, dtype=torch.long)
    out[: len(counts)] = counts.long()
    return out
