"""`draftling data`: prompts -> regenerated replies -> tokenized, task-split train/val sets.

Outputs (in the data directory):
  replies.jsonl   conversations with the target's replies and their provenance
  train.jsonl     tokenized rows {id, source, input_ids, loss_mask}
  val.jsonl       the same for the task-disjoint validation split
  summary.json    counts, tokens, how many replies hit the token cap
  prompt_token_counts.safetensors   token counts of every prompt in the files but
                  validation's, for the draft vocab (see data/prompt_counts.py)
  teacher_states_{train,val}.safetensors   with data.keep_teacher_states (see data/states.py)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from dataclasses import replace
from pathlib import Path

from draftling.config import RunConfig
from draftling.data.journal import ReplyJournal, journal_path
from draftling.data.prompt_counts import FILE_NAME as PROMPT_COUNTS_FILE
from draftling.data.prompt_counts import count_prompt_tokens, write_prompt_counts
from draftling.data.prompts import Conversation, has_tool_calls, is_rollout_turn, rollout_turns
from draftling.data.regen import render_prompt_ids
from draftling.data.replies import (
    SAMPLE_TAG,
    Regenerated,
    Reply,
    max_prompt_tokens,
    pinned_regen,
    regenerate_replies,
)
from draftling.data.runs import RUN_KEY, run_id
from draftling.data.sources import load_prompt_spec, read_id_file
from draftling.data.split import resolve_split_key, split_by_task, task_of
from draftling.data.states import states_path, write_states
from draftling.data.template import tokenize_conversation
from draftling.errors import DataError
from draftling.io import OUTPUT_MARKER, atomic_dir, output_dir_in_use, write_json, write_jsonl
from draftling.target import Target
from draftling.target.load import TargetTokenizer

log = logging.getLogger(__name__)


def _user_texts(conv: Conversation) -> set[str]:
    return {
        m["content"].strip() for m in conv.messages if m.get("role") == "user" and isinstance(m.get("content"), str)
    }


def load_prompt_files(cfg: RunConfig, pool: list[Conversation] | None = None) -> tuple[list[Conversation], int]:
    """The configured prompts, less those that ``data.exclude`` names; also how many were
    excluded. Exclusion comes before sampling, so a sample never spends its slots on them.
    ``pool``: if given, gets every prompt that passed the filters, sampled or not."""
    dc = cfg.data
    held_out = [c for spec in dc.exclude for c in load_prompt_spec(spec)]
    held_ids = {c.id for c in held_out} | {i for path in dc.exclude_ids for i in read_id_file(path)}
    held_texts = set().union(*map(_user_texts, held_out))
    convs: list[Conversation] = []
    excluded = 0
    for spec in dc.prompts:
        rows = load_prompt_spec(spec)
        if held_ids:
            kept = [c for c in rows if c.id not in held_ids and not (_user_texts(c) & held_texts)]
            excluded += len(rows) - len(kept)
            rows = kept
        if dc.drop_tool_calls:
            rows = [c for c in rows if not has_tool_calls(c)]
        if pool is not None:
            pool.extend(rows)
        cap = dc.prompt_cap(spec)
        if cap and len(rows) > cap:
            # A seeded sample, not the head of the file, so every category is represented.
            rows = random.Random(dc.seed).sample(rows, cap)
        convs.extend(rows)
    return convs, excluded


def tokenize_records(
    target: Target | TargetTokenizer, records: list[dict], min_tokens: int, max_tokens: int, states: list | None = None
) -> tuple[list[dict], list]:
    """Rows {id, source, input_ids, loss_mask}, and per row the states kept for it.

    ``states``: per record, None or (fed ids, aux, final) from regeneration. The row is then
    the ids the target was fed: the chat-template prompt and the reply tokens exactly as the
    target generated them (re-tokenizing the decoded text can differ), without the template's
    closing tokens, which were never fed. So its states cover it exactly. The prompt keeps the
    template's mask (earlier assistant turns); every reply token is a loss token."""
    rows, kept = [], []
    for j, r in enumerate(records):
        ids, mask = tokenize_conversation(
            target.tokenizer,
            r["messages"],
            tools=r.get("tools"),
            max_length=max_tokens,
            last_turn_only=is_rollout_turn(r["id"]),
        )
        st = states[j] if states is not None else None
        if st is not None:
            fed, aux, final = st
            p = r["provenance"]["prompt_tokens"]
            prompt_mask = mask[:p] if ids[:p] == fed[:p] else [0] * p
            n = min(len(fed), max_tokens)
            ids, mask = fed[:n], (prompt_mask + [1] * (len(fed) - p))[:n]
            st = (aux[:n], final[:n])
        if len(ids) < min_tokens or sum(mask) == 0:
            continue
        rows.append({"id": r["id"], "source": r["source"], "input_ids": ids, "loss_mask": mask})
        kept.append(st)
    return rows, kept


def pool_prompt_counts(tokenizer, pool: list[Conversation], val: list, split_key: str):
    """(token counts, conversations counted) over the whole pool but validation's tasks (same
    split key, ``auto`` resolved over the pool; ``val`` holds conversations or their rollout
    turns), so the draft vocab can rank tokens the sampled replies are too few to show."""
    split_key = resolve_split_key(pool, split_key)[0]
    val_tasks = {task_of(c, split_key) for c in val}
    kept = [c for c in pool if task_of(c, split_key) not in val_tasks]
    return count_prompt_tokens(tokenizer, kept, len(tokenizer)), len(kept)


def write_prompt_pool_counts(
    tokenizer,
    pool: list[Conversation],
    val_convs: list[Conversation],
    split_key: str,
    path: Path,
    run: str | None = None,
) -> None:
    counts, kept = pool_prompt_counts(tokenizer, pool, val_convs, split_key)
    write_prompt_counts(path, counts, kept, len(pool) - kept, run)
    log.info(
        f"data: counted {int(counts.sum())} prompt tokens in {kept} conversations for the draft "
        f"vocab ({len(pool) - kept} of validation's tasks left out)"
    )


def journal_settings(cfg: RunConfig, target, budgeted: bool) -> dict:
    """What the replies depend on: a journal written with other settings is not resumed. The
    target by its label, not its path: a model moved to another folder resumes its journal. Not
    data.regen.samples_per_prompt: sampled reply k has its own id and seed whatever the count,
    so a run that adds samples keeps the replies it already has."""
    model = getattr(target, "model", None)
    data = dataclasses.asdict(cfg.data)
    del data["regen"]["samples_per_prompt"]
    return {
        "target": target.spec.label,
        "data": data,
        "budgeted": budgeted,
        "dtype": str(model.dtype) if model is not None else None,
        "device": str(getattr(target, "device", "cpu")).split(":")[0],
    }


def check_data_dir(out_dir: Path) -> None:
    """A data directory is replaced whole, so refuse one that holds anything else: a file, or a
    non-empty directory that is not draftling's data (a marker, or an earlier version's
    summary.json beside train.jsonl)."""
    if not output_dir_in_use(out_dir):  # checked now, not after the minutes of regenerating
        return
    ours = (out_dir / OUTPUT_MARKER).is_file() or (
        (out_dir / "summary.json").is_file() and (out_dir / "train.jsonl").is_file()
    )
    if not ours:
        raise DataError(
            f"--out {out_dir}: not empty and not a draftling data directory; it would be "
            "replaced whole, so choose an empty or new directory (nothing was changed)"
        )


def prepare_data(
    cfg: RunConfig,
    target: Target | TargetTokenizer,
    out_dir: str | Path,
    regen_seconds: float | None = None,
    replies=None,
) -> dict:
    """With ``data.regen.server_url`` set the replies come from that server and ``target``
    may be just the tokenizer (``load_target_tokenizer``). ``replies``: RegenRun.replies, the
    batched engine's replies where data.regen.engine picks it (engine.replies.reply_engine_for).

    ``regen_seconds``: a time budget for local regeneration. Validation's replies are all
    written first; the training replies are then a random sample of the training prompts,
    as many as this machine's measured rate fits in what is left (see regenerate_within)."""
    out_dir = Path(out_dir)
    check_data_dir(out_dir)
    dc = cfg.data
    _check_context(dc, target)
    pool: list[Conversation] = []
    convs, excluded = load_prompt_files(cfg, pool)
    _log_excluded(dc, excluded)
    journal = ReplyJournal(journal_path(out_dir), journal_settings(cfg, target, regen_seconds is not None))
    local = pinned_regen(dc, target, journal)
    split_key, why = resolve_split_key(convs, dc.split_key)
    train_convs, val_convs = split_by_task(convs, dc.val_fraction, seed=dc.seed, key=split_key)
    turns = None
    if dc.rollouts:  # after the split: every turn of a conversation stays on its task's side
        train_convs, val_convs, turns = _rollouts(target, dc, train_convs, val_convs)
    log.info(
        f"data: {len(convs)} prompts from {len(dc.prompts)} files -> {len(train_convs)} train / "
        f"{len(val_convs)} val (split by {split_key}: {why})"
    )
    if local is not None and replies is not None:
        local = replace(local, replies=replies)
    regenerated = regenerate_replies(dc, target, journal, local, (train_convs, val_convs), regen_seconds)
    replies = regenerated.replies
    run = run_id([r.record for r in replies], journal.settings)
    # The directory is built aside and swapped in whole: a killed rerun leaves the earlier
    # data as it was, never a new train.jsonl beside an old val.jsonl.
    with atomic_dir(out_dir) as tmp:
        write_prompt_pool_counts(target.tokenizer, pool, val_convs, split_key, tmp / PROMPT_COUNTS_FILE, run)
        rows = write_splits(target, dc, tmp, replies, run)
        summary = {
            "run": run,
            **data_summary(cfg, target, convs, excluded, regenerated, rows),
            "split": {"key": split_key, "set": dc.split_key, "why": why},
            **({"rollout_turns": turns} if turns is not None else {}),
        }
        write_json(tmp / "summary.json", summary)
        write_json(tmp / OUTPUT_MARKER, {"kind": "data", "run": run})
    journal.remove()
    log.info(
        f"data: {summary['train_sequences']} train / {summary['val_sequences']} val sequences, "
        f"{summary['train_loss_tokens']} loss tokens; {summary['replies_hit_cap']} of "
        f"{len(replies)} replies hit the {dc.regen.max_new_tokens}-token cap"
    )
    return summary


def _log_excluded(dc, excluded: int) -> None:
    if dc.exclude or dc.exclude_ids:
        log.info(
            f"data: excluded {excluded} conversations that share an id or a user turn with "
            f"{', '.join(dc.exclude + dc.exclude_ids)}"
        )


def _check_context(dc, target) -> None:
    """Refuse data.max_tokens over the target's context (where its config says it)."""
    context = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if context and dc.max_tokens > context:
        raise DataError(
            f"data.max_tokens={dc.max_tokens} is over {target.spec.name}'s context of {context} "
            "positions (max_position_embeddings): its replies there would be garbage"
        )


def _rollouts(target, dc, train_convs: list[Conversation], val_convs: list[Conversation]):
    """Each side's prompts as rollout turns (rollout_prompts), and the tally of turns."""
    turns = {"prompt_limit": max_prompt_tokens(dc)}
    train_convs, val_convs = (rollout_prompts(target.tokenizer, side, dc, turns) for side in (train_convs, val_convs))
    log.info(
        f"data: rollouts: {len(train_convs)} train / {len(val_convs)} val assistant turns to regenerate "
        f"({turns['over_limit']} of {turns['turns']} over the {turns['prompt_limit']}-token prompt limit"
        f"{', ' + str(turns['sampled_out']) + ' left out by data.rollout_max_turns' if turns['sampled_out'] else ''})"
    )
    return train_convs, val_convs, turns


def rollout_prompts(tokenizer, convs: list[Conversation], dc, tally: dict) -> list[Conversation]:
    """One prompt per assistant turn of each conversation (prompts.rollout_turns) whose prefix
    fits the prompt limit; with data.rollout_max_turns = N, a sample of N of those per
    conversation, seeded by (data.seed, conversation id) so it does not depend on file order.
    Counts go to ``tally`` (turns, over_limit, sampled_out), summed over calls."""
    out = []
    for conv in convs:
        turns = rollout_turns(conv)
        fit = [t for t in turns if len(render_prompt_ids(tokenizer, t)) <= tally["prompt_limit"]]
        kept = fit
        if dc.rollout_max_turns and len(fit) > dc.rollout_max_turns:
            picked = set(random.Random(f"{dc.seed}\0{conv.id}").sample(range(len(fit)), dc.rollout_max_turns))
            kept = [t for i, t in enumerate(fit) if i in picked]
        for key, n in (
            ("turns", len(turns)),
            ("over_limit", len(turns) - len(fit)),
            ("sampled_out", len(fit) - len(kept)),
        ):
            tally[key] = tally.get(key, 0) + n
        out.extend(kept)
    return out


def write_splits(target, dc, out_dir: Path, replies: list[Reply], run: str | None = None) -> dict:
    """replies.jsonl, {train,val}.jsonl (every row tagged with the data ``run``) and, where
    regeneration kept them, the target's states."""
    kept = any(r.states is not None for r in replies)
    write_jsonl(out_dir / "replies.jsonl", [r.line(run) for r in replies])
    rows = {}
    for split in ("train", "val"):
        picked = [r for r in replies if r.split == split]
        rows[split], row_states = tokenize_records(
            target,
            [r.record for r in picked],
            dc.min_tokens,
            dc.max_tokens,
            [r.states for r in picked] if kept else None,
        )
        if run is not None:
            for row in rows[split]:
                row[RUN_KEY] = run
        write_jsonl(out_dir / f"{split}.jsonl", rows[split])
        if kept and rows[split]:
            size = write_states(
                states_path(out_dir, split),
                out_dir / f"{split}.jsonl",
                row_states,
                target.spec.name,
                target.aux_layer_ids,
            )
            log.info(
                f"data: kept the target's states for {split} ({size / 2**20:.0f} MiB): training "
                "will not run the target over these tokens again"
            )
    return rows


def data_summary(
    cfg: RunConfig, target, convs: list[Conversation], excluded: int, regenerated: Regenerated, rows: dict
) -> dict:
    """summary.json: counts, tokens, caps, and the regeneration settings and budget."""
    dc = cfg.data
    replies, server, budget = regenerated.replies, regenerated.server, regenerated.budget
    train_rows, val_rows = rows["train"], rows["val"]
    stopped = [r.record["provenance"]["stopped"] for r in replies]
    sampled = sum(SAMPLE_TAG in r.record["id"] for r in replies)
    summary = {
        "target": target.spec.label,
        **({"server": server.base_url, "server_model": server.model} if server else {}),
        "prompts": len(convs),
        **(
            {"excluded": excluded, "exclude": list(dc.exclude), "exclude_ids": list(dc.exclude_ids)}
            if dc.exclude or dc.exclude_ids
            else {}
        ),
        "regenerated": len(replies),
        "sampled_replies": sampled,
        # Under a budget, prompts that were never offered are neither regenerated nor skipped.
        "skipped_long_prompts": (
            regenerated.val_skipped + budget["skipped_long"]
            if budget is not None
            else regenerated.offered - (len(replies) - sampled)
        ),
        "train_sequences": len(train_rows),
        "val_sequences": len(val_rows),
        "train_tokens": sum(len(r["input_ids"]) for r in train_rows),
        "train_loss_tokens": sum(sum(r["loss_mask"]) for r in train_rows),
        "replies_stopped_eos": stopped.count("eos"),
        "replies_hit_cap": stopped.count("length"),
        "regen": json.loads(json.dumps(dc.regen.__dict__)),
        **({"regen_budget": budget} if budget is not None else {}),
        # The dtype each split's replies were written in (see data.regen.dtype).
        "regen_dtypes": {
            split: sorted({r.record["provenance"].get("dtype", "server") for r in replies if r.split == split})
            for split in ("train", "val")
        },
    }
    return summary
