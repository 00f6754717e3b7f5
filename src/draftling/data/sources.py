"""Where prompts come from: one place turns a prompt spec into conversations.

Specs:
  starter:NAME   the starter corpus shipped inside the package (data/starter/, licenses beside it)
  set:NAME       a release-bench prompt set shipped inside the package (bench/prompt_sets/)
  shared:NAME    the development corpus (``shared/data/prompts`` above the checkout, or
                 $DRAFTLING_SHARED_PROMPTS); never needed by the default path
  hf:NAME[:CONFIG][@SPLIT]   a dataset through the ``datasets`` library (data/hub.py)
  a folder       a dataset written by ``datasets``' ``save_to_disk`` (data/hub.py)
  a file         jsonl in the project schema, ShareGPT or OpenAI-messages shape
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from draftling.data.hub import HF_PREFIX
from draftling.data.prompts import Conversation, load_conversations
from draftling.errors import ConfigError, DataError


def starter_dir() -> Path:
    """The starter corpus inside the package (draftling/data/starter)."""
    return Path(str(resources.files("draftling") / "data" / "starter"))


def starter_names() -> list[str]:
    return sorted(p.stem for p in starter_dir().glob("*.jsonl"))


def prompt_sets_dir() -> Path:
    """Where the release-bench prompt sets ship inside the package (draftling/bench/prompt_sets)."""
    return Path(str(resources.files("draftling") / "bench" / "prompt_sets"))


def find_shared_prompts() -> Path | None:
    """The project's shared prompt corpus: $DRAFTLING_SHARED_PROMPTS, or a ``shared/data/prompts``
    folder beside or above the current directory or this source tree."""
    env = os.environ.get("DRAFTLING_SHARED_PROMPTS")
    if env:
        return Path(env)
    starts = [Path.cwd().resolve(), Path(__file__).resolve().parent]
    for start in starts:
        for d in [start, *start.parents]:
            for cand in (d / "shared" / "data" / "prompts", d.parent / "shared" / "data" / "prompts"):
                if cand.is_dir():
                    return cand
    return None


def shipped_set_path(name: str) -> Path | None:
    """The file of the prompt set NAME shipped with draftling, or None."""
    path = prompt_sets_dir() / f"{name}.jsonl"
    return path if path.is_file() else None


def resolve_prompt_path(spec: str) -> Path:
    """The file behind a file-backed spec (starter:, set:, shared: or a path)."""
    if spec.startswith("starter:"):
        name = spec.split(":", 1)[1]
        path = starter_dir() / f"{name}.jsonl"
        if not path.is_file():
            raise ConfigError(
                f"{spec}: no starter prompt set {name!r}; shipped: "
                + ", ".join(f"starter:{n}" for n in starter_names())
            )
        return path
    if spec.startswith("set:"):
        name = spec.split(":", 1)[1]
        path = shipped_set_path(name)
        if path is None:
            raise ConfigError(f"{spec}: no prompt set {name!r} is shipped with draftling")
        return path
    if spec.startswith("shared:"):
        root = find_shared_prompts()
        if root is None:
            raise ConfigError(
                f"{spec}: cannot find the shared prompt corpus; set "
                "DRAFTLING_SHARED_PROMPTS to its folder, or use the shipped "
                "starter:chat, starter:code, starter:math or your own files"
            )
        return root / spec.split(":", 1)[1]
    return Path(spec)


def is_dataset_spec(spec: str) -> bool:
    """True for specs the ``datasets`` library loads: hf:... or a save_to_disk folder."""
    return spec.startswith(HF_PREFIX) or Path(spec).is_dir()


def check_prompt_spec(spec: str, key: str = "data.prompts") -> None:
    """Fail before any slow step (loading the target, regenerating) when a spec cannot load:
    a missing file or one that does not parse, an unknown starter set, ``hf:`` without the
    ``datasets`` extra or without a network."""
    if is_dataset_spec(spec):
        from draftling.data.hub import check_dataset_spec

        check_dataset_spec(spec, key)
        return
    path = resolve_prompt_path(spec)
    if not path.is_file():
        raise ConfigError(f"{key}: {spec}: no such prompt file ({path})")
    load_conversations(path)  # a bad byte, line or an empty file: reading it costs far less than a target


def check_prompt_files(cfg) -> None:
    """Check every spec a RunConfig names (data.prompts and data.exclude) and read the id files
    of data.exclude_ids: before a target loads."""
    for key, specs in (("data.prompts", cfg.data.prompts), ("data.exclude", cfg.data.exclude)):
        for spec in specs:
            check_prompt_spec(spec, key)
    for path in cfg.data.exclude_ids:
        read_id_file(path)


def read_id_file(path) -> set[str]:
    """Conversation ids, one per line ('#' starts a comment), or the "id" of each jsonl row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.exclude_ids: {path}: no such file")
    ids = set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.split("#", 1)[0].strip() if not line.lstrip().startswith("{") else line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                line = str(json.loads(line)["id"])
            except (ValueError, KeyError, TypeError):
                raise DataError(f'{path.name}:{lineno}: a JSON row without an "id"') from None
        ids.add(line)
    return ids


def load_prompt_spec(spec: str) -> list[Conversation]:
    """The conversations a spec names."""
    if is_dataset_spec(spec):
        from draftling.data.hub import load_dataset_conversations

        return load_dataset_conversations(spec)
    return load_conversations(resolve_prompt_path(spec))
