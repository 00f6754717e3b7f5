"""Loading and saving: YAML (with YAML 1.2's booleans) < ``a.b=value`` overrides, coerced to the
dataclasses' types (an auto key's null read as "auto", ``_coerce_auto``)."""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from draftling.config.fields import AUTO, Auto
from draftling.config.run import RunConfig
from draftling.errors import ConfigError

_BOOL_WORDS = {"on": True, "yes": True, "off": False, "no": False}
_EXPECTED = {bool: "true/false", int: "an integer", float: "a number"}  # an auto key's other type


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        if Auto in args:
            return _coerce_auto(value, args, where)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        key_tp, value_tp = args or (Any, Any)
        return {_coerce(k, key_tp, where): _coerce(v, value_tp, f"{where}[{k!r}]") for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if tp is bool:
        value = _BOOL_WORDS.get(value.lower(), value) if isinstance(value, str) else value
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = tp(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if tp is int and float(value) != int(value):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return tp(value)
    if tp is str and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def _coerce_auto(value: Any, args: tuple, where: str) -> Any:
    """An auto key's value (``bool | Auto``, config/fields.py): "auto", or null, which configs
    and run directories' config.yaml wrote for auto before, read as "auto"; else its type's."""
    if value is None or value == AUTO:
        return AUTO
    (tp,) = [a for a in args if a is not Auto]
    try:
        return _coerce(value, tp, where)
    except ConfigError:
        raise ConfigError(f"{where}: expected {_EXPECTED.get(tp, tp)} or auto, got {value!r}") from None


def from_dict(cls, data: dict, where: str = "config"):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(names)}")
    return cls(**{k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()})


def to_dict(cfg) -> dict:
    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans: only true/false. PyYAML's 1.1 rules also read on/off and
    yes/no as booleans, so `data.regen.engine=off` arrived as False; a bool field still takes
    them (``_BOOL_WORDS``)."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides; values are parsed as YAML (numbers, lists, bools)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=3e-4")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = yaml_load(raw)
    return data


def builtin_config(name: str) -> Path:
    path = resources.files("draftling") / "configs" / f"{name}.yaml"
    return Path(str(path))


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults < YAML file (a path or a built-in name like ``quickstart_cpu``) < overrides."""
    data: dict = {}
    if path:
        p = Path(path)
        if not p.is_file() and builtin_config(str(path)).is_file():
            p = builtin_config(str(path))
        if not p.is_file():
            raise ConfigError(f"config {path}: file not found")
        try:
            data = yaml_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}".replace("\n", " ")) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
    # Round-trip through the defaults so overrides of nested keys merge, not replace.
    merged = _deep_merge(to_dict(RunConfig()), data)
    merged = apply_overrides(merged, overrides or [])
    return from_dict(RunConfig, merged, where=str(path or "config"))


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def save_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    from draftling.io import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
