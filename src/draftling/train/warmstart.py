"""Warm-start (`train --init-from DIR`): go on training an existing head instead of a new one.

The head keeps its own vocab maps: its lm_head rows were trained for those tokens, and a map
built from the new data would silently pair them with other tokens (acceptance collapses with
no error). So training uses the head's d2t/t2d and reports how much of the new data they cover.
``--rebuild-vocab`` (draft.rebuild_vocab) switches to the new data's map: the rows of tokens in
both maps move to their new draft ids, the rows of tokens that enter are re-initialised from the
target's output head, and the report says how many. The source is only read: training works on a
copy, whatever format the caller loaded it from.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from draftling.draft.model import NORM_FLAGS, Eagle3Draft, draft_window, norm_flags, set_window
from draftling.draft.store import new_draft
from draftling.draft.vocab import DraftVocab, token_counts
from draftling.errors import ConfigError
from draftling.target import Target


@dataclass(frozen=True)
class InitDraft:
    """What the caller loaded for ``--init-from``: the draft, where it came from, and whether
    to rebuild its vocab map from the new data."""

    draft: Eagle3Draft
    where: str
    rebuild_vocab: bool = False


@dataclass
class WarmStart:
    draft: Eagle3Draft  # the working copy training starts from (CPU, fp32)
    vocab: DraftVocab  # the maps training uses
    report: dict


def check_fits(draft: Eagle3Draft, target: Target, where: str) -> None:
    """Refuse a draft built for another target, naming each mismatch with its numbers."""
    cfg, tcfg = draft.config, target.config
    wrong = []
    hidden = getattr(cfg, "target_hidden_size", cfg.hidden_size)
    if hidden != tcfg.hidden_size:
        wrong.append(f"target hidden size {hidden}, the target has {tcfg.hidden_size}")
    if draft.t2d.numel() != tcfg.vocab_size:
        wrong.append(f"target vocab {draft.t2d.numel()}, the target has {tcfg.vocab_size}")
    aux = [int(i) for i in getattr(cfg, "eagle_aux_hidden_state_layer_ids", [])]
    if aux != list(target.aux_layer_ids):
        wrong.append(f"aux layers {aux}, the target run uses {list(target.aux_layer_ids)}")
    if wrong:
        raise ConfigError(f"--init-from {where}: the draft does not fit {target.spec.name}: {'; '.join(wrong)}")


def keep_window(draft: Eagle3Draft, window: int, where: str) -> None:
    """The sliding window a warm-started head trains with: its own, or draft.window where set
    (a full-attention head can learn a window). Two different windows are refused: the head
    was trained for its own, and which one is meant is not ours to guess."""
    own = draft_window(draft.config)
    if window and own and window != own:
        raise ConfigError(
            f"--init-from {where}: the head was trained with a window of {own} but "
            f"draft.window={window}; set draft.window={own} (or 0 to keep the head's)"
        )
    if window:
        set_window(draft.config, window)


def keep_norms(draft: Eagle3Draft, dc, where: str) -> None:
    """A warm-started head keeps its own EAGLE-3.1 norms: a flag in ``dc`` (the draft config
    section) the head was not trained with is refused rather than added untrained."""
    own = norm_flags(draft.config)
    asked = [k for k in NORM_FLAGS if getattr(dc, k) and not own[k]]
    if asked:
        raise ConfigError(
            f"--init-from {where}: the head was trained without {', '.join(asked)}; a warm start keeps the head's "
            f"layout, so unset draft.{asked[0]} (or train a new head with it)"
        )


def coverage(t2d: torch.Tensor, examples) -> float:
    """The share of the loss-masked tokens of ``examples`` inside the map ``t2d``."""
    counts = token_counts(((ex.input_ids, ex.loss_mask) for ex in examples), t2d.numel())
    total = int(counts.sum())
    return int(counts[t2d].sum()) / total if total else 0.0


def warm_start(init: InitDraft, target: Target, data_vocab: DraftVocab, examples) -> WarmStart:
    check_fits(init.draft, target, init.where)
    source = copy.deepcopy(init.draft).float().cpu()
    kept = coverage(source.t2d, examples)
    report = {
        "init_from": init.where,
        "kept_map_coverage": kept,
        "new_map_coverage": coverage(data_vocab.t2d, examples),
        "rebuild_vocab": init.rebuild_vocab,
    }
    if not init.rebuild_vocab:
        vocab = DraftVocab(source.d2t.clone(), source.t2d.clone(), data_vocab.data_hash, int(source.t2d.sum()), kept)
        return WarmStart(source, vocab, report)
    draft, entered = rebuilt(source, target, data_vocab)
    report["tokens_entered"] = entered
    return WarmStart(draft, data_vocab, report)


def rebuilt(source: Eagle3Draft, target: Target, vocab: DraftVocab) -> tuple[Eagle3Draft, int]:
    """``source`` with ``vocab``'s maps: every weight kept but the head's rows, which follow
    their tokens to the new draft ids; a token new to the map gets the target's head row."""
    config = copy.deepcopy(source.config)
    config.draft_vocab_size = vocab.size
    draft = new_draft(config)  # an EAGLE-3 or a dflash head, as the source
    state = {k: v for k, v in source.state_dict().items() if not k.startswith(("lm_head.", "d2t", "t2d"))}
    draft.load_state_dict(state, strict=False)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    old_row = torch.full((vocab.t2d.numel(),), -1, dtype=torch.long)
    old_row[source.draft_to_target(torch.arange(source.d2t.numel()))] = torch.arange(source.d2t.numel())
    new_ids = vocab.draft_ids_in_target
    rows = old_row[new_ids]
    head = target.model.get_output_embeddings().weight.detach().float().cpu()
    with torch.no_grad():
        draft.lm_head.weight.copy_(head[new_ids])  # the target's row for every token ...
        kept = rows >= 0
        draft.lm_head.weight[kept] = source.lm_head.weight[rows[kept]]  # ... but those the head knows
    return draft, int((~kept).sum())
