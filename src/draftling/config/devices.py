"""Sizes and device placement (device_map, max_memory): checked here, used by target/devmap.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

from draftling.errors import ConfigError


def parse_size(text: str) -> int:
    """'80GiB', '24GB', '24G', '512MiB', '141' (GiB) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r}: expected e.g. 80GiB, 24GB or 141 (GiB)")
    value, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    if not unit:
        return int(value * 2**30)
    power = "KMGT".index(unit) + 1
    return int(value * (1024 if binary or not m.group(0).strip().upper().endswith("B") else 1000) ** power)


DEVICE_MAP_MODES = ("auto", "balanced")


def device_name(value, where: str) -> int | str:
    """A device as accelerate names it: a GPU index (0, "1", "cuda:1"; "cuda" is 0), cpu, disk or mps."""
    text = str(value).strip()
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if text.isdigit() and not isinstance(value, bool):
        return int(text)
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return int(text[5:] or 0)
    if text in ("cpu", "disk", "mps"):
        return text
    raise ConfigError(f"{where}: device {value!r}: expected a GPU index (0, cuda:1), cpu or disk")


def device_map_value(value: str | None) -> str | dict | None:
    """``device_map`` resolved: None, "auto", "balanced", or {module name: device} read from
    the JSON file it names (devices as ``device_name`` gives them)."""
    if value is None or value in DEVICE_MAP_MODES:
        return value
    path = Path(value)
    if not path.is_file():
        raise ConfigError(
            f"device_map={value!r}: expected auto, balanced or a JSON file mapping module "
            "names to devices (no such file)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"device_map {path}: not valid JSON: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(
            f"device_map {path}: expected a JSON object of module names to devices, e.g. "
            '{"model.layers.0": 0, "model.layers.1": "cpu"}'
        )
    return {name: device_name(device, f"device_map {path}: {name!r}") for name, device in data.items()}


def max_memory_bytes(value: dict | None) -> dict | None:
    """``max_memory`` resolved: {device: bytes}, sizes as ``parse_size`` reads them."""
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise ConfigError(
            f"max_memory={value!r}: expected a mapping of devices to sizes, e.g. {{0: 40GiB, cpu: 200GiB}}"
        )
    out = {}
    for device, size in value.items():
        where = f"max_memory[{device!r}]"
        try:
            out[device_name(device, where)] = parse_size(str(size))
        except ValueError:
            raise ConfigError(f"{where}={size!r}: expected a size, e.g. 40GiB") from None
    return out
