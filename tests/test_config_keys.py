"""Each config key is declared once (src/draftling/config/fields.py ``key``): the README's key
table, the resume policy and the CLI's flag table agree with those declarations."""

import argparse
import dataclasses
from pathlib import Path

import pytest
import yaml

from draftling.config import AUTO, RESUME_FREE_KEYS, RunConfig, TrainConfig, key_table_markdown, load_config, to_dict
from draftling.config.fields import auto_keys, is_section, walk
from draftling.config.table import readme_section
from draftling.errors import ConfigError
from draftling.train.rundir import resume_free

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_key_table_is_current():
    assert readme_section(README.read_text(encoding="utf-8")) == key_table_markdown(), (
        "README.md's config key table is stale: run python3 scripts/gen_config_table.py"
    )


def test_every_key_has_a_meaning():
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


# Every key that decides for itself, spelled "auto" (config/fields.py).
AUTO_KEYS = (
    "data.regen.prefill_chunk_tokens",
    "train.pad_to_multiple",
    "train.grad_checkpoint",
    "train.optimizer_offload",
    "train.compile",
    "train.compile_teacher",
    "bench.engine_compile",
    "bench.query_pad",
    "bench.round_timing",
)


def _value(cfg, name: str):
    for part in name.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _declared_auto_keys(cls=RunConfig, prefix: str = "") -> list[str]:
    out = [prefix + name for name in auto_keys(cls)]
    for f in dataclasses.fields(cls):
        if is_section(f):
            out += _declared_auto_keys(f.default_factory, f"{prefix}{f.name}.")
    return out


def _old_config(path: Path) -> Path:
    """A config.yaml as runs wrote it before "auto" was spelled one way: null for each auto key."""
    data = to_dict(RunConfig())
    for name in AUTO_KEYS:
        *sections, last = name.split(".")
        node = data
        for section in sections:
            node = node[section]
        node[last] = None
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_auto_is_spelled_auto():
    assert sorted(_declared_auto_keys()) == sorted(AUTO_KEYS)
    cfg = load_config(None, [])
    assert all(_value(cfg, name) == AUTO for name in AUTO_KEYS)
    for name, f in walk(RunConfig):  # no key is left saying its null means auto
        said = f.metadata.get("help", "") + (f.metadata["bounds"][0] if f.metadata.get("bounds") else "")
        assert "null = auto" not in said and "null (auto)" not in said, name


def test_null_in_an_old_config_loads_as_auto(tmp_path):
    from draftling.train.rundir import resume_config_changes

    old = _old_config(tmp_path / "config.yaml")
    assert all(_value(load_config(old), name) == AUTO for name in AUTO_KEYS)
    assert all(_value(load_config(None, [f"{name}=null"]), name) == AUTO for name in AUTO_KEYS)
    # Resuming a run whose config.yaml says null: nothing changed.
    assert resume_config_changes(tmp_path, load_config(None, []), []) == {}
    cfg = load_config(None, ["train.compile=false", "bench.query_pad=4", "train.pad_to_multiple=auto"])
    assert cfg.train.compile is False and cfg.bench.query_pad == 4 and cfg.train.pad_to_multiple == AUTO


def _resolved(cfg, device: str) -> dict:
    """Each auto key's decision on ``device``, where the code makes it."""
    from draftling.bench.release_options import ReleaseOptions
    from draftling.data.regen import prefill_chunk_columns
    from draftling.train.settings import compile_teacher, memory_options, optimizer_offload, pad_multiple

    tc, engine = cfg.train, ReleaseOptions.from_config(cfg.bench).engine
    return {
        "memory": memory_options(tc, device),
        "pad": (pad_multiple(tc, "flex"), pad_multiple(tc, "sdpa")),
        "offload": optimizer_offload(tc, device, n_params=10**9, device_bytes=80 * 2**30),
        "teacher": compile_teacher(tc, device),
        "engine": engine.resolve(device, max_draft_tokens=8),
        "prefill": prefill_chunk_columns(cfg.data.regen, 4, 2048, device),
    }


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_resolves_as_null_did(tmp_path, device):
    auto, null = load_config(None, []), load_config(_old_config(tmp_path / "config.yaml"))
    got = _resolved(auto, device)
    assert got == _resolved(null, device)
    cuda = device == "cuda"
    assert got["memory"]["grad_checkpoint"] is cuda and got["memory"]["compile_layer"] is cuda
    assert got["pad"] == (128, 1) and got["offload"] is cuda and got["teacher"] is cuda
    assert got["engine"].compile is cuda and got["engine"].query_pad == (8 if cuda else 0)
    assert got["prefill"] == (None if cuda else 1024)  # 4096 tokens over 4 rows on the CPU


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.compile=maybe", "config.train.compile: expected true/false or auto, got 'maybe'"),
        ("bench.round_timing=Auto", "config.bench.round_timing: expected true/false or auto, got 'Auto'"),
        ("bench.query_pad=x", "config.bench.query_pad: expected an integer or auto, got 'x'"),
        ("bench.query_pad=-1", "bench.query_pad=-1: expected an integer >= 0 (0 = off) or auto"),
        ("train.pad_to_multiple=0", "train.pad_to_multiple=0: expected an integer >= 1 or auto"),
    ],
)
def test_a_bad_auto_value_is_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == message


def test_a_bad_auto_flag_is_one_line(capsys):
    from draftling.cli import main

    assert main(["bench", "--draft", "d", "--release", "--query-pad", "x"]) == 2
    assert capsys.readouterr().err == "draftling: error: config.bench.query_pad: expected an integer or auto, got 'x'\n"


def test_none_is_no_auto_value_outside_loading():
    with pytest.raises(ConfigError, match="^train.compile=None: expected a value or 'auto'$"):
        TrainConfig(compile=None)  # type: ignore[arg-type]
