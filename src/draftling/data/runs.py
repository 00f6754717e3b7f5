"""Which `draftling data` run wrote a file, so later stages refuse a mix of two runs' files.

The run id is a hash of the replies and the settings that made them: a run resumed from its
journal gets the same id as an uninterrupted one, and files that differ in content never
share one. Every row of train.jsonl, val.jsonl and replies.jsonl carries it (``run``), as do
summary.json and the metadata of prompt_token_counts.safetensors (``data_run``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from draftling.errors import DataError

RUN_KEY = "run"


def run_id(records: list[dict], settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for r in records:
        h.update(
            json.dumps(
                {k: v for k, v in r.items() if not k.startswith("_")}, sort_keys=True, ensure_ascii=False
            ).encode()
        )
    return h.hexdigest()[:16]


def file_run(path: Path) -> str | None:
    """The run id a data file carries, or None (a file from before run ids, or hand-made)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                return (f.metadata() or {}).get("data_run")
        except Exception:  # unreadable files are reported by their own reader
            return None
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    return row.get(RUN_KEY) if isinstance(row, dict) else None
    except (OSError, ValueError):
        return None
    return None


def check_one_run(*paths: Path) -> None:
    """Refuse files (those that exist) written by different `draftling data` runs."""
    runs = {p: file_run(p) for p in map(Path, paths) if p.is_file()}
    if len(set(runs.values())) > 1:  # a file without an id beside one with an id is a mix too
        listed = ", ".join(f"{p.name} from {'run ' + r if r else 'no recorded run'}" for p, r in runs.items())
        raise DataError(
            f"{next(iter(runs)).parent}: files of different `draftling data` runs ({listed}); "
            "rerun `draftling data` into a new directory"
        )
