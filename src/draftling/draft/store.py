"""draftling's own draft format: ``draft_config.json`` + ``draft.safetensors`` (weights, d2t, t2d).

It is what checkpoints and ``train`` write and what ``bench`` and ``export`` read. The
serving formats (SGLang, speculators) are written by draftling.export.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from draftling.draft.block import METHOD as BLOCK_METHOD
from draftling.draft.block import BlockDraft
from draftling.draft.model import Eagle3Draft
from draftling.draft.vocab import check_vocab_maps
from draftling.errors import DraftlingError, one_line

CONFIG_FILE = "draft_config.json"
WEIGHTS_FILE = "draft.safetensors"


def new_draft(config) -> Eagle3Draft | BlockDraft:
    """A head of the type its config names (``draft_method``; absent = EAGLE-3), freshly built."""
    return BlockDraft(config) if getattr(config, "draft_method", None) == BLOCK_METHOD else Eagle3Draft(config)


def save_draft(draft: Eagle3Draft | BlockDraft, directory: str | Path) -> None:
    """Write into an existing (usually temporary) directory; callers make it atomic."""
    directory = Path(directory)
    state = {k: v.detach().to("cpu").contiguous() for k, v in draft.trainable_state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(draft.config.to_dict(), indent=2) + "\n")


def load_weights(draft, state: dict, where: Path, config_name: str) -> None:
    """``state`` into ``draft``, every weight present and fitting (the rotary table is rebuilt),
    or one line naming the file and what is wrong."""
    try:
        missing, unexpected = draft.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor whose shape does not fit the config
        raise DraftlingError(f"{where}: does not fit {config_name} ({one_line(e)})") from None
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise DraftlingError(f"{where}: missing {missing}, unexpected {unexpected}")


def load_draft(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Eagle3Draft | BlockDraft:
    directory = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise DraftlingError(f"{directory}: not a draftling draft (missing {name})")
    try:
        draft = new_draft(LlamaConfig(**json.loads((directory / CONFIG_FILE).read_text())))
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise DraftlingError(f"{directory / CONFIG_FILE}: not a draft config ({one_line(e)})") from None
    try:
        state = load_file(str(directory / WEIGHTS_FILE))
    except Exception as e:  # safetensors raises its own error type for a truncated or garbage file
        raise DraftlingError(f"{directory / WEIGHTS_FILE}: unreadable ({one_line(e)})") from None
    load_weights(draft, state, directory / WEIGHTS_FILE, CONFIG_FILE)
    if not bool(draft.t2d.any()):
        raise DraftlingError(f"{directory / WEIGHTS_FILE}: t2d is empty; the vocab maps were not saved")
    # The checks the exporters run, on every load: a zeroed or stale d2t serves garbage silently.
    check_vocab_maps(
        draft.d2t,
        draft.t2d,
        int(draft.config.draft_vocab_size),
        int(draft.config.vocab_size),
        where=str(directory / WEIGHTS_FILE),
    )
    return draft.cast_weights(dtype).to(device).eval()  # the rotary table stays fp32, as in training
