"""Task-disjoint train/validation split: whole tasks go to one side, decided by a stable hash."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from draftling.config import SPLIT_KEYS as KEYS
from draftling.errors import DataError

# NAME-TASK-TRIAL: tau-bench's ids ("tau-airline-<task>-<trial>"), several trials of one task.
_TRIAL_ID = re.compile(r"^(.*\D-\d+)-\d+$")


def split_task_id(conv_id: str) -> str:
    """The task identity of a conversation id: the full id, unchanged.

    Ids carry suffixes such as "gsm8k-train-12" or "tau-airline-0-50"; they are not parsed, the
    id IS the task. Records that share a task under different ids are kept together by
    key="task" (see task_identity) or key="source"."""
    return conv_id


def conversation_id(conv) -> str:
    """The id a record is split by: a rollout turn's (prompts.rollout_turns) is its
    conversation's, so a turn counts on the side its conversation went to."""
    return conv.meta.get("rollout_of") or conv.id


def _own_task(conv) -> str | None:
    """The record's task: its ``task`` field, else NAME-TASK of an id NAME-TASK-TRIAL."""
    task = conv.meta.get("task")
    if task is not None and str(task) != "":
        return str(task)
    m = _TRIAL_ID.match(conversation_id(conv))
    return m.group(1) if m else None


def task_identity(conv) -> str:
    """key="task": the record's own ``task`` field; else an id NAME-TASK-TRIAL (two trailing
    numbers, tau-bench's) is grouped by NAME-TASK, so every trial of a task stays on one side;
    any other id is its own task ("gsm8k-train-12" stays whole)."""
    return _own_task(conv) or conversation_id(conv)


def resolve_split_key(convs: Sequence, key: str) -> tuple[str, str]:
    """(the key to split by, why). ``auto``: ``task`` when any record carries a task identity
    (trials of one task must not straddle the split; a record without one is its own task
    either way), else ``id``. Any other key is used as set."""
    if key != "auto":
        return key, "data.split_key as set"
    with_task = sum(_own_task(c) is not None for c in convs)
    if with_task:
        return "task", (
            f"auto: {with_task} of {len(convs)} records carry a task identity (a task field or "
            "NAME-TASK-TRIAL ids), so every trial of a task stays on one side"
        )
    return "id", "auto: no record carries a task identity (a task field or NAME-TASK-TRIAL ids)"


def task_of(conv, key: str = "id") -> str:
    """The group a conversation is split with (key resolved: not ``auto``): its id, its task
    identity, or its source."""
    if key == "task":
        return task_identity(conv)
    return split_task_id(conversation_id(conv)) if key == "id" else conv.source


def _unit_hash(seed: int, value: str) -> float:
    digest = hashlib.sha256(f"{seed}\0{value}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_by_task(convs: Sequence, val_fraction: float, seed: int = 0, key: str = "id") -> tuple[list, list]:
    """Split into (train, val) by a stable hash of each conversation's task key (``auto``:
    resolved over ``convs`` by resolve_split_key).

    The side depends only on (seed, key value), so it does not change with file order, and all
    conversations sharing a key value land on the same side. If val_fraction > 0 and at least two
    groups exist, neither side is left empty: the group with the smallest hash moves to val, or
    the one with the largest hash to train.
    """
    if key not in KEYS:
        raise DataError(f"split key must be one of {', '.join(KEYS)}, got {key!r}")
    if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    key = resolve_split_key(convs, key)[0]

    hashes = {g: _unit_hash(seed, g) for g in {task_of(c, key) for c in convs}}
    val_groups = {g for g, h in hashes.items() if h < val_fraction}
    if val_fraction > 0 and len(hashes) >= 2:
        if not val_groups:
            val_groups = {min(hashes, key=lambda g: (hashes[g], g))}
        elif len(val_groups) == len(hashes):
            val_groups.discard(max(hashes, key=lambda g: (hashes[g], g)))

    train = [c for c in convs if task_of(c, key) not in val_groups]
    val = [c for c in convs if task_of(c, key) in val_groups]
    return train, val
