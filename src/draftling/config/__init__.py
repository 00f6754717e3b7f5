"""Typed run config: nested dataclasses, loaded from YAML, overridden with ``a.b=value``.

A run saves the config it actually used as ``config.yaml`` in its directory, so every
number a run reports can be traced to the settings that produced it.

Each key is declared once, with ``key(...)`` (config/fields.py): its default, bounds, choices,
resume policy, CLI flag and meaning. Validation, ``RESUME_FREE_KEYS`` and the README's key
table (``key_table_markdown``, written by scripts/gen_config_table.py) are read from there.
Sections: config/data.py (data, data.regen, vocab, draft), config/train.py, config/run.py
(bench, extract and the run config); loading in config/loader.py; devices in config/devices.py.
"""

from __future__ import annotations

from draftling.config.data import SPLIT_KEYS, DataConfig, DraftConfig, RegenConfig, VocabConfig
from draftling.config.devices import DEVICE_MAP_MODES, device_map_value, device_name, max_memory_bytes, parse_size
from draftling.config.fields import (
    AT_LEAST_ONE,
    AUTO,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    Auto,
    check_bounds,
    check_choices,
    key,
    resume_free_keys,
)
from draftling.config.loader import (
    apply_overrides,
    builtin_config,
    from_dict,
    load_config,
    save_config,
    to_dict,
    yaml_load,
)
from draftling.config.run import (
    BENCH_CHOICES,
    CONCURRENCY_LEVELS,
    ENGINE_ATTENTION,
    EXTRACT_CHOICES,
    RELEASE_BASELINES,
    RELEASE_CONFIGS,
    RELEASE_SAMPLED_TEMPERATURES,
    BenchConfig,
    ExtractConfig,
    RunConfig,
)
from draftling.config.table import key_table_markdown
from draftling.config.train import TRAIN_CHOICES, TrainConfig

# Keys a resume may change freely (a "SECTION." entry: every key in it): they steer logging,
# checkpoints kept, time, validation and where the target is placed, not the weights a step
# computes. Read from each key's ``resume`` (config/fields.py).
RESUME_FREE_KEYS = resume_free_keys(RunConfig)

__all__ = [
    "AT_LEAST_ONE",
    "AUTO",
    "BENCH_CHOICES",
    "DEVICE_MAP_MODES",
    "ENGINE_ATTENTION",
    "EXTRACT_CHOICES",
    "FRACTION",
    "NON_NEGATIVE",
    "POSITIVE",
    "RELEASE_BASELINES",
    "RELEASE_SAMPLED_TEMPERATURES",
    "RELEASE_CONFIGS",
    "CONCURRENCY_LEVELS",
    "RESUME_FREE_KEYS",
    "SPLIT_KEYS",
    "Auto",
    "TRAIN_CHOICES",
    "BenchConfig",
    "DataConfig",
    "DraftConfig",
    "ExtractConfig",
    "RegenConfig",
    "RunConfig",
    "TrainConfig",
    "VocabConfig",
    "apply_overrides",
    "builtin_config",
    "check_bounds",
    "check_choices",
    "device_map_value",
    "device_name",
    "from_dict",
    "key",
    "key_table_markdown",
    "load_config",
    "max_memory_bytes",
    "parse_size",
    "resume_free_keys",
    "save_config",
    "to_dict",
    "yaml_load",
]
