#!/usr/bin/env python3
"""Write a versioned release-bench prompt set from the shared prompt corpus.

    python scripts/make_prompt_set.py                 # writes src/draftling/bench/prompt_sets/v1.jsonl
    python scripts/make_prompt_set.py --check         # regenerates in memory, diffs against the file

The rule is fixed and deterministic: for each workload (in WORKLOADS order) filter the candidate
records with the rule below, order them by sha256("draftling-bench-<version>:<workload>:<id>")
and keep the first N (8) ids not already taken by an earlier workload. Records are copied as
they are (original ``id`` and ``source`` kept) with ``"workload": NAME`` added.

A published set is never edited in place: a new rule or new data means a new version (v2.jsonl),
so numbers measured on v1 stay comparable. This script refuses to overwrite an existing file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SHARED = REPO.parent / "shared" / "data" / "prompts"
DEFAULT_OUT_DIR = REPO / "src" / "draftling" / "bench" / "prompt_sets"

# Prompts that ask for a list, a table or step-by-step structure (repeating output shape).
_LIST_START = re.compile(
    r"^\s*(list|enumerate|(make|create|generate|produce|brainstorm|write|give|compile|provide|"
    r"construct|prepare)\s+(me\s+)?(a|an)?\s*((numbered|bulleted|detailed|short)\s+)?(list|table))\b",
    re.I,
)
_LIST_ANY = re.compile(
    r"\b(step[- ]by[- ]step|(in|as)\s+a\s+((numbered|bulleted|markdown)\s+)?table|"
    r"as\s+a\s+((numbered|bulleted)\s+)?list|in\s+a\s+(numbered|bulleted)\s+list)\b",
    re.I,
)
_WRITING = re.compile(r"^\s*(write|describe|explain|compose)\b", re.I)
# ShareGPT first turns of a conversation ("<id>" or "<id>_0"); later "_N" pieces start mid-dialogue.
_SHAREGPT_FIRST = re.compile(r"^sharegpt-[^_]+(_0)?$")

MAX_CHARS = 6000  # ~1500 tokens: prompt + 256 new tokens fit a 2048-token context


def _last_user(rec: dict) -> str:
    users = [m["content"] for m in rec["messages"] if m["role"] == "user"]
    return users[-1] if users else ""


def _chars(rec: dict) -> int:
    n = sum(len(m["content"]) for m in rec["messages"])
    if rec.get("tools"):
        n += len(json.dumps(rec["tools"]))
    return n


def _single_user(rec: dict) -> bool:
    return len(rec["messages"]) == 1 and rec["messages"][0]["role"] == "user"


def is_repetitive(rec: dict) -> bool:
    text = _last_user(rec)
    return bool(_LIST_START.search(text) or _LIST_ANY.search(text))


# workload -> (source file, filter). Order matters: earlier workloads take ids first.
WORKLOADS = {
    "prose": (
        "instruct.jsonl",
        lambda r: (
            r.get("category") == "instruct"
            and _single_user(r)
            and _WRITING.match(_last_user(r))
            and not is_repetitive(r)
            and 20 <= _chars(r) <= 1000
        ),
    ),
    "code": ("code_mbpp.jsonl", lambda r: _single_user(r) and _chars(r) <= MAX_CHARS),
    "repetitive": (
        ("instruct.jsonl", "sharegpt.jsonl"),
        lambda r: (
            _single_user(r)
            and is_repetitive(r)
            and (r["source"] != "sharegpt" or _SHAREGPT_FIRST.match(r["id"]))
            and 20 <= _chars(r) <= 1000
        ),
    ),
    "chat": (
        "sharegpt.jsonl",
        lambda r: (
            _single_user(r) and _SHAREGPT_FIRST.match(r["id"]) and not is_repetitive(r) and 20 <= _chars(r) <= 2000
        ),
    ),
    "math": ("math_gsm8k_train.jsonl", lambda r: _single_user(r) and _chars(r) <= MAX_CHARS),
    "summarize": ("summarize.jsonl", lambda r: _chars(r) <= MAX_CHARS),
    "tool": ("tool_use.jsonl", lambda r: bool(r.get("tools")) and _chars(r) <= MAX_CHARS),
}


def _load(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build(shared: Path, version: str, per_workload: int) -> list[dict]:
    cache: dict[str, list[dict]] = {}
    taken: set[str] = set()
    out = []
    for workload, (files, keep) in WORKLOADS.items():
        files = (files,) if isinstance(files, str) else files
        cands = []
        for name in files:
            if name not in cache:
                cache[name] = _load(shared / name)
            cands += [r for r in cache[name] if r["id"] not in taken and keep(r)]

        def order(r, workload=workload):
            return hashlib.sha256(f"draftling-bench-{version}:{workload}:{r['id']}".encode()).hexdigest()

        chosen = sorted(cands, key=order)[:per_workload]
        if len(chosen) < per_workload:
            raise SystemExit(f"{workload}: only {len(chosen)} candidates, need {per_workload}")
        for r in chosen:
            taken.add(r["id"])
            out.append({**r, "workload": workload})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED, help="shared prompts directory")
    ap.add_argument("--version", default="v1", help="set name; also the ordering seed")
    ap.add_argument("--per-workload", type=int, default=8)
    ap.add_argument("--out", type=Path, help="output file (default prompt_sets/<version>.jsonl)")
    ap.add_argument("--check", action="store_true", help="do not write: regenerate and compare with the existing file")
    args = ap.parse_args(argv)
    out = args.out or DEFAULT_OUT_DIR / f"{args.version}.jsonl"
    rows = build(args.shared, args.version, args.per_workload)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if args.check:
        same = out.is_file() and out.read_text(encoding="utf-8") == text
        print(f"{out}: {'matches' if same else 'DIFFERS from'} the rule's output")
        return 0 if same else 1
    if out.exists():
        print(f"{out} exists; prompt sets are never edited in place (make a new version)", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    counts = {w: sum(r["workload"] == w for r in rows) for w in WORKLOADS}
    print(f"wrote {len(rows)} prompts to {out}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
