"""The README's table of config keys, rendered from the fields' metadata (config/fields.py);
scripts/gen_config_table.py writes it between the README's markers and a test fails when the
README's copy is stale."""

from __future__ import annotations

import json

from draftling.config.fields import default_of, is_section, walk
from draftling.config.run import RunConfig

START, END = "<!-- config-keys:start -->", "<!-- config-keys:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _value(value) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return "`" + json.dumps(value).replace("|", "\\|") + "`"


def key_table_markdown(cls=RunConfig) -> str:
    """One row per key: its dotted name, default, what it accepts, its resume policy and flag,
    and its help."""
    rows = ["| key | default | accepts | on `--resume` | flag | meaning |", "|---|---|---|---|---|---|"]
    free_sections: list[str] = []
    for name, f in walk(cls):
        if is_section(f):
            if f.metadata.get("resume") == "free":
                free_sections.append(name + ".")
            continue
        meta = f.metadata
        accepts = []
        if meta.get("choices"):
            accepts.append("one of " + ", ".join(f"`{c}`" for c in meta["choices"]))
        if meta.get("bounds"):
            accepts.append(meta["bounds"][0])
        free = meta.get("resume") == "free" or name.startswith(tuple(free_sections))
        flag = f"`{meta['flag']}`" if meta.get("flag") else ""
        rows.append(
            f"| `{name}` | {_value(default_of(f))} | {_cell('; '.join(accepts))} | "
            f"{'may change' if free else 'fixed'} | {flag} | {_cell(meta.get('help', ''))} |"
        )
    return "\n".join(rows) + "\n"


def replace_section(text: str, table: str) -> str:
    """``text`` with what lies between the START and END markers replaced by ``table``."""
    start, end = text.index(START) + len(START), text.index(END)
    return text[:start] + "\n" + table + text[end:]


def readme_section(text: str) -> str:
    """What lies between the markers, as ``replace_section`` writes it."""
    return text[text.index(START) + len(START) : text.index(END)].removeprefix("\n")
