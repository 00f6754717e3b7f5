"""A journal of regenerated replies, so `draftling data` resumes after a kill or a full disk.

Replies are appended as each batch finishes, beside the output as ``.NAME.journal/``:
  journal.json    the settings the replies depend on (a rerun with others starts over)
  replies.jsonl   one record per line, appended and fsynced batch by batch
  states/B.safetensors   the target's kept states of batch B (data.keep_teacher_states)

A rerun skips every batch whose replies are all in the journal and yields the journaled
records in their place, so the batches, their seeds and the finished files are the same as an
uninterrupted run's. A line cut short by a kill is dropped. The journal is removed once the
data directory is swapped in.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from draftling.faults import fault_point
from draftling.io import remove_path, umask_mode, write_json

log = logging.getLogger(__name__)

FORMAT = "draftling-reply-journal-1"


def journal_path(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.journal"


class ReplyJournal:
    def __init__(self, path: Path, settings: dict):
        self.path, self.records = Path(path), {}
        settings = json.loads(json.dumps({"format": FORMAT, **settings}))  # as it reads back
        self.settings, self._pinned = settings, {}
        if self.path.is_dir() and self._settings() != settings:
            log.info(f"data: {self.path} was written with other settings; starting over")
            remove_path(self.path)
            self._pinned = {}
        self._load()
        if self.records:
            log.info(f"data: resuming with {len(self.records)} replies from {self.path}")

    def _settings(self) -> dict | None:
        try:
            saved = json.loads((self.path / "journal.json").read_text())
        except (OSError, ValueError):
            return None
        self._pinned = saved.pop("pinned", {})
        return saved

    def pinned(self, key: str, decide):
        """A decision the replies depend on that a rerun must not make again (a timed probe):
        the journal's, or ``decide()``'s, kept with the journal from its first reply."""
        if key not in self._pinned:
            self._pinned[key] = decide()
        return self._pinned[key]

    def _load(self) -> None:
        lines = self.path / "replies.jsonl"
        if not lines.exists():
            return
        data = lines.read_bytes()
        good = data.rfind(b"\n") + 1  # a line without its newline was cut short by a kill
        if good < len(data):
            with open(lines, "r+b") as f:
                f.truncate(good)
        for line in data[:good].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            states = record.get("_states_file")
            if states is None or (self.path / "states" / states).is_file():
                self.records[record["id"]] = record

    def has_all(self, ids) -> bool:
        return all(i in self.records for i in ids)

    def get(self, conv_id: str) -> dict:
        """The record as regenerate() yielded it, kept states included."""
        record = dict(self.records[conv_id])
        states = record.pop("_states_file", None)
        if states is not None:
            from safetensors.torch import load_file

            t = load_file(str(self.path / "states" / states))
            record["_states"] = (t[f"{conv_id}/ids"].tolist(), t[f"{conv_id}/aux"], t[f"{conv_id}/final"])
        return record

    def add(self, records: list[dict]) -> None:
        """Journal one finished batch: its states file first, then its lines, fsynced."""
        if not records:
            return
        if not self.path.is_dir():  # made with the first reply: a run that fails before leaves none
            self.path.mkdir(parents=True, mode=umask_mode(directory=True))
            write_json(self.path / "journal.json", {**self.settings, "pinned": self._pinned})
        name = None
        if any("_states" in r for r in records):
            from safetensors.torch import save_file

            from draftling.io import atomic_path

            name = f"{len(self.records):08d}.safetensors"
            tensors = {}
            for r in records:
                ids, aux, final = r["_states"]
                tensors.update(
                    {
                        f"{r['id']}/ids": torch.tensor(ids, dtype=torch.long),
                        f"{r['id']}/aux": aux.contiguous(),
                        f"{r['id']}/final": final.contiguous(),
                    }
                )
            (self.path / "states").mkdir(exist_ok=True, mode=umask_mode(directory=True))
            with atomic_path(self.path / "states" / name) as tmp:
                save_file(tensors, str(tmp))
        lines = []
        for r in records:
            row = {k: v for k, v in r.items() if k != "_states"}
            if name is not None:
                row["_states_file"] = name
            lines.append(json.dumps(row, ensure_ascii=False) + "\n")
        fault_point("data.journal")  # a batch's states are written, its lines not yet
        with open(self.path / "replies.jsonl", "a") as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
        for r, line in zip(records, lines):
            self.records[r["id"]] = json.loads(line)

    def remove(self) -> None:
        remove_path(self.path, ignore_errors=True)
