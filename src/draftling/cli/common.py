"""What the commands share: the flags that stand for config keys, the run config built from
them, the common options, and the one-line error a command's failure becomes.

Flags reach the run config one way: a key declares its flag (``key(flag=...)``,
config/fields.py), FLAG_KEYS maps each such flag's dest to its key, ``add_key_flag`` adds the
flag with the key's own help, and ``run_config`` hands the flags a command passes on to
``load_config`` as KEY=VALUE overrides after the command line's own, so a flag wins over its
key and is checked exactly like it. Flags without a key (paths, modes) stay the command's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftling.config.fields import walk
from draftling.config.run import RunConfig
from draftling.errors import DraftlingError

EPILOG_OVERRIDES = (
    "Config overrides: trailing KEY=VALUE pairs override the YAML config, e.g. "
    "train.lr=3e-4 data.regen.max_new_tokens=128 vocab.size=8192."
)


def flag_dest(flag: str) -> str:
    """A flag's argparse dest: ``--device-map`` -> ``device_map``."""
    return flag.lstrip("-").replace("-", "_")


def declared_flags(cls=RunConfig) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """({dest: config key}, {dest: flag}, {config key: help}) from the ``flag=`` declarations
    of ``cls``'s keys (config/fields.py); two keys declaring one flag fail here, at import."""
    keys: dict[str, str] = {}
    flags: dict[str, str] = {}
    helps: dict[str, str] = {}
    for name, f in walk(cls):
        flag = f.metadata.get("flag")
        if not flag:
            continue
        dest = flag_dest(flag)
        if dest in keys:
            raise RuntimeError(f"config keys {keys[dest]} and {name} both declare the flag {flag}")
        keys[dest], flags[dest], helps[name] = name, flag, f.metadata.get("help", "")
    return keys, flags, helps


# The config key each key-backed flag sets, by its argparse dest, read from the keys'
# declarations: one dest means one key in every command (a command's own flag that shares a
# key flag's name takes a dest of its own). Each command names the ones it passes on to run_config.
FLAG_KEYS, FLAG_NAMES, KEY_HELP = declared_flags()
# A flag's value where it is not the key's value as it stands.
FLAG_VALUES = {
    "configs": lambda text: [c for c in text.split(",") if c],  # comma-separated
    "baselines": lambda text: [b for b in text.split(",") if b],
    # Integers where they parse; anything else reaches the config's check as it was written.
    "concurrency": lambda text: [int(v) if v.strip().isdigit() else v for v in text.split(",") if v.strip()],
}

TARGET_FLAGS = ("target", "device", "dtype", "device_map")  # --device-map: only where a command has it
DATA_FLAGS = ("chat_template", "prompts", "server", "server_model", "exclude_ids")
BENCH_FLAGS = ("configs", "num_prompts", "max_new_tokens", "temperature", "top_k", "top_p")
RELEASE_FLAGS = (
    "configs",
    "max_new_tokens",
    "prompt_set",
    "baselines",
    "baseline_prompts_per_workload",
    "results_dir",
    "tag",
    "engine_compile",
    "query_pad",
    "attention",
    "concurrency",
)
EXTRACT_FLAGS = ("shard_size", "batch_size", "logits_dtype")


def flag_overrides(args, flags) -> list[str]:
    """``KEY=VALUE`` for each of ``flags`` given on the command line (an empty string counts as
    not given). The value is written as JSON, which YAML reads back as the same string, number
    or list: a path or URL is never re-read as YAML."""
    out = []
    for flag in flags:
        value = getattr(args, flag, None)
        if value is None or value == "":
            continue
        value = FLAG_VALUES.get(flag, lambda v: v)(value)
        out.append(f"{FLAG_KEYS[flag]}={json.dumps(value, ensure_ascii=False)}")
    return out


def run_config(args, flags=TARGET_FLAGS, base: tuple[str, ...] = ()):
    """The run config: --config, then ``base`` (the command's fixed choices), then the trailing
    KEY=VALUE overrides, then ``flags``."""
    from draftling.config import load_config

    overrides = [*base, *(getattr(args, "overrides", None) or [])]
    if "prompts" in flags and getattr(args, "prompts", None):
        # --prompts replaces the file list: the profile's per-file caps of files left out go.
        caps = load_config(getattr(args, "config", None), overrides).data.max_prompts_by_file
        kept = {spec: cap for spec, cap in caps.items() if spec in args.prompts}
        overrides.append(f"data.max_prompts_by_file={json.dumps(kept)}")
    return load_config(getattr(args, "config", None), overrides + flag_overrides(args, flags))


def add_key_flag(parser, dest: str, *, context: str = "", note: str = "", **extras) -> argparse.Action:
    """Add the flag that stands for config key FLAG_KEYS[dest] to ``parser`` (or a group): its
    name from the key's declaration, its help the key's own meaning and name ("... (config
    bench.num_prompts)"), ``context`` before it and ``note`` after it where the command adds
    something. ``extras``: argparse's type, choices, metavar, action. Its default stays None,
    so the config's value stands unless the flag is given."""
    key = FLAG_KEYS[dest]
    text = " ".join(t for t in (context, KEY_HELP[key], note) if t) + f" (config {key})"
    # argparse %-formats a help string: a literal % is written %%.
    return parser.add_argument(FLAG_NAMES[dest], dest=dest, default=None, help=text.replace("%", "%%"), **extras)


def add_common(p: argparse.ArgumentParser, config: bool = True) -> None:
    for dest in ("target", "device", "dtype"):
        add_key_flag(p, dest)
    if config:
        p.add_argument("--config", help="YAML config file or built-in name (quickstart_cpu, default)", default=None)
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


def add_device_map_flag(p: argparse.ArgumentParser) -> None:
    add_key_flag(
        p,
        "device_map",
        metavar="auto|balanced|FILE",
        note="Cap each device's share with max_memory, e.g. max_memory={0: 40GiB, cpu: 200GiB}.",
    )


def check_data_files(data: Path) -> None:
    """Before any model loads: the data directory's files come from one `draftling data` run."""
    from draftling.data.prompt_counts import FILE_NAME
    from draftling.data.runs import check_one_run

    check_one_run(data / "train.jsonl", data / "val.jsonl", data / FILE_NAME)


def run_command(command, args) -> int:
    """``command(args)``'s exit code; a DraftlingError or OSError becomes one line
    (`draftling: error: ...`) and exit code 2."""
    try:
        code = command(args)
    except DraftlingError as e:
        print(f"draftling: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only output: atomic writes left the last good state
        where = e.filename or "writing the output"
        print(f"draftling: error: {where}: {e.strerror or e}", file=sys.stderr)
        return 2
    return code or 0
