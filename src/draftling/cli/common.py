"""What the commands share: the flags that stand for config keys, the run config built from
them, the common options, and the one-line error a command's failure becomes.

Flags reach the run config one way: FLAG_KEYS names the config key a flag stands for, and
``run_config`` hands the flags a command passes on to ``load_config`` as KEY=VALUE overrides
after the command line's own, so a flag wins over its key and is checked exactly like it.
Flags without a key (paths, modes) stay the command's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftling.errors import DraftlingError

EPILOG_OVERRIDES = (
    "Config overrides: trailing KEY=VALUE pairs override the YAML config, e.g. "
    "train.lr=3e-4 data.regen.max_new_tokens=128 vocab.size=8192."
)

# The config key each such flag sets, by its argparse dest (one dest means one key in every
# command). Each command names the ones it passes on to run_config.
FLAG_KEYS = {
    "target": "target",
    "device": "device",
    "dtype": "dtype",
    "device_map": "device_map",
    "chat_template": "chat_template",
    "prompts": "data.prompts",
    "server": "data.regen.server_url",
    "server_model": "data.regen.server_model",
    "size": "vocab.size",
    "prompt_weight": "vocab.prompt_weight",
    "configs": "bench.configs",
    "num_prompts": "bench.num_prompts",
    "max_new_tokens": "bench.max_new_tokens",
    "temperature": "bench.temperature",
    "top_k": "bench.top_k",
    "top_p": "bench.top_p",
    "prompt_set": "bench.prompt_set",
    "baselines": "bench.baselines",
    "baseline_prompts_per_workload": "bench.baseline_prompts_per_workload",
    "results_dir": "bench.results_dir",
    "tag": "bench.tag",
    "engine_compile": "bench.engine_compile",
    "query_pad": "bench.query_pad",
    "attention": "bench.attention",
    "concurrency": "bench.concurrency",
    "shard_size": "extract.shard_size",
    "extract_batch_size": "extract.batch_size",
    "logits_dtype": "extract.logits_dtype",
    "minutes": "wall_minutes",
    "init_from": "draft.init_from",
    "rebuild_vocab": "draft.rebuild_vocab",
    "exclude_ids": "data.exclude_ids",
    "stop_on_convergence": "train.stop_on_convergence",
}
# A flag's value where it is not the key's value as it stands.
FLAG_VALUES = {
    "configs": lambda text: [c for c in text.split(",") if c],  # comma-separated
    "baselines": lambda text: [b for b in text.split(",") if b],
    "engine_compile": lambda text: {"on": True, "off": False}.get(text),  # the key's null is auto
    "query_pad": lambda text: None if text == "auto" else text,
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
EXTRACT_FLAGS = ("shard_size", "extract_batch_size", "logits_dtype")


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


def add_common(p: argparse.ArgumentParser, config: bool = True) -> None:
    p.add_argument(
        "--target",
        help="HF hub id, local model directory, or .gguf file (default: the embedded SmolLM2-135M-Instruct GGUF)",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: from config)")
    if config:
        p.add_argument("--config", help="YAML config file or built-in name (quickstart_cpu, default)", default=None)
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


def add_device_map_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device-map",
        metavar="auto|balanced|FILE",
        help="spread the target over devices with accelerate (config device_map): auto or balanced "
        "fill the GPUs, then host RAM, then disk (cap each with max_memory={0: 40GiB, cpu: 200GiB}); "
        'FILE is a JSON object of module names to devices (0, "cuda:1", "cpu", "disk"). The draft '
        "trains on --device, which must hold the input embedding",
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
