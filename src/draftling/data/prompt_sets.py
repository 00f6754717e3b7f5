"""Prompt sets: fixed jsonl files of prompts, read and tokenized here for both benches that use
them, the release bench (bench/release.py) and the training run's smoke bench
(train/convergence.py).

A record is a chat prompt (project schema, ShareGPT or OpenAI messages), rendered with the chat
template and its generation prompt, or a pre-tokenized row with ``input_ids``, cut at the first
1 of a ``loss_mask`` (where the reply starts). ``workload`` groups records (missing: "default");
ids must be unique. The shipped sets (bench/prompt_sets/, README there) are named "v1",
"smoke-v1" or "set:NAME"; any other spec is a file (data/sources.py: a path, starter:, shared:).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from draftling.data.prompts import _parse_record, jsonl_values, prompt_messages
from draftling.data.sources import prompt_sets_dir, resolve_prompt_path, shipped_set_path
from draftling.data.template import render
from draftling.errors import DataError

DEFAULT_WORKLOAD = "default"
_BUILTIN = re.compile(r"^(?:[a-z]+-)?v\d+$")  # v1, smoke-v1, ...

# The sha256 of each shipped set as first published. Sets are never edited in place (figures on
# v1 must stay comparable); a changed selection is a new version with its own line here.
PUBLISHED_PROMPT_SETS = {
    "v1": "46ca02dccc810c4ba760f5dfe2cf7e137e383c57c19421dc8e6a2f6d788a3948",
    "smoke-v1": "ee03e05926aa36bc3e8ab7a542c5e9c0ec90be6b2ed9b59fb1367c246b002a7b",  # train.smoke_prompts
}


class UnknownPromptSet(DataError):
    """A spec that names no shipped set and no file: a caller may report it as its config key's fault."""


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    workload: str
    input_ids: list[int]


def builtin_prompt_sets() -> list[str]:
    return sorted(p.name[: -len(".jsonl")] for p in prompt_sets_dir().iterdir() if p.name.endswith(".jsonl"))


def resolve_prompt_set(spec: str | Path) -> tuple[str, Path]:
    """(name, path): a shipped set's name, or the path itself for a file."""
    s = str(spec)
    name = _shipped_name(s)
    if name is not None:
        path = shipped_set_path(name)
        if path is None:
            raise UnknownPromptSet(f"prompt set {s!r} is not shipped (have: {', '.join(builtin_prompt_sets())})")
        return name, path
    path = resolve_prompt_path(s).expanduser()
    if not path.is_file():
        raise UnknownPromptSet(f"prompt set {s}: no such prompt file ({path}), nor a shipped set name (v1, ...)")
    return str(path), path


def _shipped_name(s: str) -> str | None:
    """NAME of "set:NAME", or a bare "v1"/"smoke-v1" that is not also a file here."""
    if s.startswith("set:"):
        return s[len("set:") :]
    return s if _BUILTIN.match(s) and not Path(s).exists() else None


def read_prompt_set(spec: str | Path = "v1") -> tuple[dict, list[dict]]:
    """The set's provenance (name, builtin, sha256) and its raw records, each with a str
    ``id`` (missing: "file:line"), a ``workload`` and ``_where`` ("path:line", for messages).
    A file's name is its file name: results name a set by name and hash, not by where a run
    read it."""
    name, path = resolve_prompt_set(spec)
    raw = path.read_bytes()
    builtin = name != str(path)
    info = {"name": name if builtin else path.name, "builtin": builtin, "sha256": hashlib.sha256(raw).hexdigest()}
    if info["builtin"]:
        _check_published(name, path, info["sha256"])
    return info, _records(raw, path)


def _records(raw: bytes, path: Path) -> list[dict]:
    """A set's records, each with an id (unique), a workload and where it stands."""
    records = []
    for lineno, where, rec in jsonl_values(raw.split(b"\n"), path):
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        rid = rec.get("id")
        rec["id"] = f"{path.stem}:{lineno}" if rid is None or rid == "" else str(rid)  # as load_conversations
        rec["workload"] = str(rec.get("workload") or DEFAULT_WORKLOAD)
        rec["_where"] = where
        records.append(rec)
    if not records:
        raise DataError(f"{path}: empty prompt set")
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids):
        raise DataError(f"{path}: duplicate prompt ids {sorted({i for i in ids if ids.count(i) > 1})[:5]}")
    return records


def _check_published(name: str, path: Path, sha256: str) -> None:
    published = PUBLISHED_PROMPT_SETS.get(name)
    if published is None:
        raise DataError(
            f"prompt set {name} ({path}) has no published sha256 in "
            "prompt_sets.PUBLISHED_PROMPT_SETS: add it when the set is first released"
        )
    if sha256 != published:
        raise DataError(
            f"prompt set {name} ({path}) was edited in place: sha256 {sha256[:12]} != "
            f"published {published[:12]}; restore it and put the change in a new version"
        )


def tokenize_prompt_set(records: list[dict], tokenizer, notes: list[str] | None = None) -> list[BenchPrompt]:
    """Token ids per record of read_prompt_set. Appends to ``notes`` what the caller should
    report (a chat template that drops tools)."""
    out, lost = [], []  # lost: per prompt with tools, whether the template dropped them
    for rec in records:
        if "input_ids" in rec:
            ids, mask = [int(t) for t in rec["input_ids"]], rec.get("loss_mask")
            ids = ids[: mask.index(1)] if mask and 1 in mask else ids
        else:
            ids, dropped = _chat_ids(rec, tokenizer)
            if dropped is not None:
                lost.append(dropped)
        if not ids:
            raise DataError(f"{rec['_where']}: prompt {rec['id']} is empty after tokenization")
        out.append(BenchPrompt(rec["id"], rec["workload"], ids))
    if any(lost) and notes is not None:
        notes.append(
            f"the target's chat template ignores `tools`: {sum(lost)} of {len(lost)} "
            "prompts with tool schemas were rendered without them"
        )
    return out


def _chat_ids(rec: dict, tokenizer) -> tuple[list[int], bool | None]:
    """A message record's ids (chat template, generation prompt), and whether the template
    dropped its tools (None: it has none)."""
    where = rec["_where"]
    fname, lineno = where.rsplit(":", 1)
    conv = _parse_record({k: v for k, v in rec.items() if k != "_where"}, Path(fname).stem, int(lineno), where)
    text = render(tokenizer, prompt_messages(conv), tools=conv.tools, add_generation_prompt=True)
    dropped = text == render(tokenizer, prompt_messages(conv), add_generation_prompt=True) if conv.tools else None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), dropped
