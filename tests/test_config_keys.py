"""Each config key is declared once (src/draftling/config/fields.py ``key``): the README's key
table, the resume policy and the CLI's flag table agree with those declarations."""

import argparse
from pathlib import Path

import pytest

from draftling.config import RESUME_FREE_KEYS, RunConfig, key_table_markdown, load_config
from draftling.config.fields import walk
from draftling.config.table import readme_section
from draftling.errors import ConfigError
from draftling.train.rundir import resume_free

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_key_table_is_current():
    assert readme_section(README.read_text(encoding="utf-8")) == key_table_markdown(), (
        "README.md's config key table is stale: run python3 scripts/gen_config_table.py"
    )


def test_every_key_has_a_meaning():
    from draftling.config.fields import is_section

    missing = [name for name, f in walk(RunConfig) if not f.metadata.get("help") and not is_section(f)]
    assert not missing, f"declare what these keys mean (key(..., help=...)): {missing}"


def test_resume_policy_from_the_declarations():
    assert "train.keep_checkpoints" in RESUME_FREE_KEYS and "train.keep_every_steps" in RESUME_FREE_KEYS
    assert {"data.", "bench.", "extract."} <= set(RESUME_FREE_KEYS)
    assert resume_free("data.regen.seed") and resume_free("max_memory.0") and resume_free("device_map")
    assert not resume_free("train.lr") and not resume_free("train.log_every_x") and not resume_free("dtype")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from draftling.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_flag_table_is_the_declared_flags():
    from draftling.cli.common import FLAG_KEYS, FLAG_NAMES

    declared = {f.metadata["flag"]: name for name, f in walk(RunConfig) if f.metadata.get("flag")}
    assert {flag.removeprefix("--").replace("-", "_"): name for flag, name in declared.items()} == FLAG_KEYS
    assert {FLAG_NAMES[dest]: key for dest, key in FLAG_KEYS.items()} == declared


def test_every_key_backed_flag_is_its_key_s():
    """A flag whose dest is a key's is that key's flag, in every command: its declared name, no
    default of its own (the config's value stands), and a help that names the key."""
    from draftling.cli.common import FLAG_KEYS, FLAG_NAMES

    seen = set()
    for command, parser in _subparsers().items():
        for action in parser._actions:
            if action.dest not in FLAG_KEYS or not action.option_strings:
                continue
            key, where = FLAG_KEYS[action.dest], f"{command} {action.option_strings[0]}"
            assert action.option_strings == [FLAG_NAMES[action.dest]], where
            assert action.default is None, where
            assert f"(config {key})" in action.help, where
            seen.add(action.dest)
    assert seen == set(FLAG_KEYS)  # every declared flag is some command's


def test_two_keys_with_one_flag_fail():
    from dataclasses import dataclass

    from draftling.cli.common import declared_flags
    from draftling.config import key

    @dataclass
    class Twice:
        a: int = key(1, flag="--n", help="a")
        b: int = key(2, flag="--n", help="b")

    with pytest.raises(RuntimeError, match="config keys a and b both declare the flag --n"):
        declared_flags(Twice)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=0", "train.lr=0.0: expected a number > 0"),
        ("data.split_key=x", "data.split_key='x': expected one of auto, id, task, source"),
        ("train.attention=x", "train.attention='x': expected one of auto, sdpa, flex"),
        ("wall_minutes=-1", "wall_minutes=-1.0: expected a number >= 0 (0 = no budget)"),
        ("draft.window=-1", "draft.window=-1: expected an integer >= 0 (0 = full attention)"),
    ],
)
def test_bounds_read_from_the_declarations(override, message):
    with pytest.raises(
        ConfigError,
        match="^" + message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.").replace("+", r"\+") + "$",
    ):
        load_config(None, [override])


def test_null_still_loads_where_auto_is_null():
    cfg = load_config(None, ["train.compile=null", "bench.query_pad=null", "train.attention=auto"])
    assert cfg.train.compile is None and cfg.bench.query_pad is None and cfg.train.attention == "auto"
