"""The draft vocabulary: the N most frequent loss-masked target tokens (optionally ranked
together with the prompt files' token frequencies, ``vocab.prompt_weight``).

``d2t`` is an OFFSET table (``target_id = draft_id + d2t[draft_id]``) and ``t2d`` a boolean
membership mask over the target vocab, the layout SGLang and vLLM load. A zeroed ``d2t``
would silently map draft ids to target ids 0..N-1, so the maps carry a hash of the data
they came from and are checked when loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftling.errors import DataError, one_line
from draftling.io import atomic_path, hash_dataset_file  # noqa: F401 (re-exported)


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64 [draft_vocab]
    t2d: torch.Tensor  # bool [target_vocab]
    data_hash: str
    num_distinct: int  # distinct tokens seen in the data (before padding)
    coverage: float  # share of loss-masked tokens inside the draft vocab

    @property
    def draft_ids_in_target(self) -> torch.Tensor:
        return torch.arange(len(self.d2t)) + self.d2t

    @property
    def size(self) -> int:
        return len(self.d2t)


def token_counts(sequences, target_vocab_size: int) -> torch.Tensor:
    """Count loss-masked tokens. ``sequences`` yields (input_ids, loss_mask) pairs."""
    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    for ids, mask in sequences:
        ids = torch.as_tensor(ids, dtype=torch.long)
        mask = torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=target_vocab_size)[:target_vocab_size]
    return counts


def build_vocab(
    counts: torch.Tensor, draft_vocab_size: int, data_hash: str, rank: torch.Tensor | None = None
) -> DraftVocab:
    """Keep the ``draft_vocab_size`` tokens with the highest ``rank`` (default: ``counts``);
    coverage is always the share of ``counts`` kept."""
    target_vocab_size = len(counts)
    if draft_vocab_size > target_vocab_size:
        raise DataError(f"draft_vocab_size {draft_vocab_size} is larger than the target vocab ({target_vocab_size})")
    if draft_vocab_size < 1:
        raise DataError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    # Stable sort: ties (and the unseen tokens used as padding) go by ascending id.
    order = torch.sort(-(counts if rank is None else rank), stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values  # ascending ids keep d2t offsets >= 0
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    total = int(counts.sum())
    coverage = float(counts[chosen].sum()) / total if total else 0.0
    return DraftVocab(d2t, t2d, data_hash, int((counts > 0).sum()), coverage)


def save_vocab(vocab: DraftVocab, path: str | Path) -> None:
    meta = {
        "data_hash": vocab.data_hash,
        "num_distinct": str(vocab.num_distinct),
        "coverage": f"{vocab.coverage:.6f}",
        "draft_vocab_size": str(vocab.size),
        "target_vocab_size": str(len(vocab.t2d)),
    }
    with atomic_path(path) as tmp:
        save_file({"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()}, str(tmp), metadata=meta)


def load_vocab(
    path: str | Path, expect_data_hash: str | None = None, target_vocab_size: int | None = None
) -> DraftVocab:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: vocab file not found (run `draftling vocab` first)")
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except Exception as e:  # safetensors' own error type for a truncated or garbage file
        raise DataError(f"{path}: not a vocab file ({one_line(e)}); rebuild it with `draftling vocab`") from None
    if "d2t" not in tensors or "t2d" not in tensors:
        raise DataError(f"{path}: expected tensors d2t and t2d, found {sorted(tensors)}")
    vocab = DraftVocab(
        tensors["d2t"].long(),
        tensors["t2d"].bool(),
        meta.get("data_hash", ""),
        int(meta.get("num_distinct", 0)),
        float(meta.get("coverage", 0.0)),
    )
    check_vocab(vocab, str(path), target_vocab_size)
    if expect_data_hash is not None and vocab.data_hash != expect_data_hash:
        raise DataError(
            f"{path}: vocab was built from different data (hash {vocab.data_hash[:12]} != "
            f"{expect_data_hash[:12]}); rebuild it with `draftling vocab`"
        )
    return vocab


def check_vocab(vocab: DraftVocab, where: str, target_vocab_size: int | None = None) -> None:
    """The maps must agree with each other; a mismatch is the silent-collapse trap."""
    if target_vocab_size is not None and len(vocab.t2d) != target_vocab_size:
        raise DataError(f"{where}: t2d covers {len(vocab.t2d)} tokens but the target vocab has {target_vocab_size}")
    check_vocab_maps(vocab.d2t, vocab.t2d, vocab.size, len(vocab.t2d), where)


def check_vocab_maps(
    d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, target_vocab_size: int, where: str = "draft"
) -> None:
    """Refuse vocab maps that would serve garbage without an error.

    ``d2t`` is an OFFSET table (target_id = draft_id + d2t[draft_id]); ``t2d`` marks the
    target ids in the draft vocabulary. Engines use d2t only, so a zeroed d2t with a
    reduced draft vocab silently maps draft ids to target ids 0..N-1.
    """
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise DataError(f"{where}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},)")
    if tuple(t2d.shape) != (target_vocab_size,):
        raise DataError(f"{where}: t2d has shape {tuple(t2d.shape)}, expected ({target_vocab_size},)")
    d2t = d2t.detach().cpu().long()
    t2d = t2d.detach().cpu().bool()
    # All-zero offsets are legitimate only when the draft vocab really is ids 0..N-1.
    if draft_vocab_size < target_vocab_size and not bool(d2t.any()) and not bool(t2d[:draft_vocab_size].all()):
        raise DataError(
            f"{where}: d2t is all zeros while draft_vocab_size ({draft_vocab_size}) < target vocab "
            f"({target_vocab_size}); engines would map draft ids to target ids 0..{draft_vocab_size - 1} "
            "and acceptance would collapse silently. Set the vocab maps (Eagle3Draft.set_vocab) "
            "before exporting."
        )
    count = int(t2d.sum())
    if count != draft_vocab_size:
        raise DataError(
            f"{where}: t2d marks {count} target tokens, expected draft_vocab_size "
            f"= {draft_vocab_size} (stale or unset vocab maps; see Eagle3Draft.set_vocab)"
        )
    targets = torch.arange(draft_vocab_size) + d2t
    if int(targets.min()) < 0 or int(targets.max()) >= target_vocab_size:
        raise DataError(f"{where}: d2t maps draft ids outside the target vocab [0, {target_vocab_size})")
    if targets.unique().numel() != draft_vocab_size:
        raise DataError(f"{where}: d2t maps several draft ids to the same target id")
    if not bool(t2d[targets].all()):
        raise DataError(
            f"{where}: d2t and t2d disagree (d2t maps to target ids that t2d "
            "does not mark); the vocab maps are stale or mismatched"
        )


def vocab_summary(vocab: DraftVocab) -> str:
    return json.dumps(
        {
            "draft_vocab_size": vocab.size,
            "distinct_tokens_in_data": vocab.num_distinct,
            "coverage": round(vocab.coverage, 4),
            "data_hash": vocab.data_hash[:16],
        }
    )


def prompt_weighted_rank(counts: torch.Tensor, prompt_counts: torch.Tensor, prompt_weight: float) -> torch.Tensor:
    """A token's share of the loss tokens plus ``prompt_weight`` times its share of the prompt text."""
    rank = counts.double() / max(int(counts.sum()), 1)
    return rank + prompt_weight * prompt_counts.double() / max(int(prompt_counts.sum()), 1)


def build_vocab_file(
    train_path: str | Path, target_vocab_size: int, size: int, out: str | Path, prompt_weight: float = 0.0
) -> DraftVocab:
    """Build the vocab from a tokenized train.jsonl and save it beside the data hash. With
    ``prompt_weight`` > 0 the prompt token counts that `draftling data` wrote beside it join
    the ranking (see ``prompt_weighted_rank``)."""
    from draftling.data.prompt_counts import FILE_NAME, read_prompt_counts
    from draftling.data.runs import check_one_run
    from draftling.data.tokenized import load_tokenized

    data = Path(train_path).parent
    check_one_run(Path(train_path), data / "val.jsonl", data / FILE_NAME)
    rows = load_tokenized(train_path)
    counts = token_counts(((r.input_ids, r.loss_mask) for r in rows), target_vocab_size)
    rank = None
    if prompt_weight > 0:
        prompt_counts = read_prompt_counts(Path(train_path).parent / FILE_NAME, target_vocab_size)
        rank = prompt_weighted_rank(counts, prompt_counts, prompt_weight)
    vocab = build_vocab(counts, size, hash_dataset_file(train_path), rank)
    save_vocab(vocab, out)
    return vocab
