"""`draftling check EXPORT --target T`: does a head fit a target, before anyone serves it?

Checked: the target's hidden size and vocabulary against the head's, the aux layer ids against
the target's layer count, the vocab maps (on load), and, where the export recorded one, the
target checkpoint's fingerprint (config and tokenizer hashes, RoPE parameters, and the weight
hash where the export carries one; target/fingerprint.py says what each guarantees)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftling.errors import DraftlingError
from draftling.export.formats import load_any_draft
from draftling.target.fingerprint import HASHED, fingerprint


def check_export(path, config, tokenizer=None, weights=None) -> list[str]:
    """What fits, one line each; a DraftlingError naming every mismatch if anything does not.
    ``weights``: a callable giving the target's weight hash (it loads the weights), called only
    when the export carries one."""
    path = Path(path)
    draft = load_any_draft(path, "cpu", torch.float32)  # refuses broken vocab maps
    dc = draft.config
    layers = int(config.num_hidden_layers)
    ids = [int(i) for i in dc.eagle_aux_hidden_state_layer_ids]
    hidden = int(getattr(dc, "target_hidden_size", dc.hidden_size))
    wrong, ok = [], []
    for what, have, want in (
        ("hidden size", hidden, config.hidden_size),
        ("vocab", draft.t2d.numel(), config.vocab_size),
    ):
        (ok if have == want else wrong).append(f"{what}: head {have}, target {want}")
    in_range = all(1 <= i <= layers for i in ids)
    (ok if in_range else wrong).append(f"aux layers {ids} (HF hidden_states indices) of a {layers}-layer target")
    recorded = _recorded_fingerprint(path)
    if recorded:
        compare_fingerprint(recorded, _target_fingerprint(recorded, config, tokenizer, weights), ok, wrong)
    else:
        ok.append("no target fingerprint recorded (an export made without --target): sizes and layers only")
    if wrong:
        raise DraftlingError(f"{path}: does not fit the target: {'; '.join(wrong)}")
    return ok


def _target_fingerprint(recorded: dict, config, tokenizer, weights) -> dict:
    now = fingerprint(config, tokenizer)
    if "weights" in recorded and weights is not None:
        now["weights"] = weights()
    return now


def compare_fingerprint(recorded: dict, now: dict, ok: list, wrong: list) -> None:
    """Each field both sides have, into ``ok`` or ``wrong``; a field only one side has is said."""
    for key, value in recorded.items():
        if key not in now:
            ok.append(f"target {key}: recorded, not compared (the target side has none)")
            continue
        what = f"target {key} hash" if key in HASHED else f"target {key}"
        show = (lambda v: v) if key in HASHED else (lambda v: json.dumps(v, sort_keys=True))
        (ok if now[key] == value else wrong).append(f"{what}: recorded {show(value)}, target {show(now[key])}")
    if "weights" not in recorded:
        ok.append("no weight fingerprint recorded (export --weight-fingerprint): the weights are not compared")


def _recorded_fingerprint(path: Path) -> dict | None:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        return None
    return (json.loads(cfg_path.read_text()).get("draftling") or {}).get("target_fingerprint")
