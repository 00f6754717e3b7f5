"""One source per config key: ``key(...)`` declares a field with its default, bounds, choices,
resume policy, CLI flag and help, all in the field's metadata. Validation (``validate``), the
resume policy (``resume_free_keys``), the CLI's flag table and flag help (cli/common.py) and the
README's key table (config/table.py) read it there.

"Auto" is spelled one way, the string "auto": a key whose unset value means "decide where it
is used" defaults to "auto". A string key lists it among its choices; a key of another type
says so in its type (``bool | Auto``, ``int | Auto``), and its help says what auto picks
(``auto = ...``). Loading reads null there as "auto" too (config/loader.py), as configs and run
directories' config.yaml spelled it before. null stays where it means none, all, or the
target's own.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Iterator
from typing import Any, Final, Literal

from draftling.errors import ConfigError

# Bounds checked when a config is built (so a bad value fails before any model loads):
# (what is expected, test). None passes where a field allows it.
Bounds = tuple[str, Callable[[Any], bool]]
POSITIVE = ("a number > 0", lambda v: v > 0)
AT_LEAST_ONE = ("an integer >= 1", lambda v: v >= 1)
NON_NEGATIVE = ("a number >= 0", lambda v: v >= 0)
FRACTION = ("a number in [0, 1]", lambda v: 0 <= v <= 1)
RESUME = ("free", "fixed")
_MISSING = dataclasses.MISSING
AUTO: Final = "auto"
Auto = Literal["auto"]  # in a key's type: the key also takes "auto" (``bool | Auto``)


def key(
    default: Any = _MISSING,
    *,
    factory: Callable[[], Any] | None = None,
    bounds: Bounds | None = None,
    choices: tuple | None = None,
    resume: str = "fixed",
    flag: str | None = None,
    help: str = "",
):
    """A config field. ``bounds``: (what is expected, test), checked when the config is built;
    ``choices``: the names a string field accepts; ``resume``: "free" where a ``--resume`` may
    change the key (for a section: every key in it), else "fixed"; ``flag``: the CLI flag that
    sets it (cli/common.py FLAG_KEYS); ``help``: what it means, for the README's key table and
    the flag's --help."""
    if resume not in RESUME:
        raise ValueError(f"resume={resume!r}: expected one of {', '.join(RESUME)}")
    meta = {"bounds": bounds, "choices": choices, "resume": resume, "flag": flag, "help": help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_bounds(section: str, obj, rules: dict) -> None:
    auto = auto_keys(type(obj))
    for name, (expected, ok) in rules.items():
        value = getattr(obj, name)
        if value is not None and not (name in auto and value == AUTO) and not ok(value):
            raise ConfigError(f"{section + '.' if section else ''}{name}={value!r}: expected {expected}")


def check_choices(section: str, obj, choices: dict) -> None:
    """None passes where a field allows it (its type says so; an unset choice). An auto key
    holds "auto" or a value: None there is refused (only loading reads null as "auto")."""
    for name in auto_keys(type(obj)):
        if getattr(obj, name) is None:
            raise ConfigError(f"{section + '.' if section else ''}{name}=None: expected a value or {AUTO!r}")
    for name, allowed in choices.items():
        value = getattr(obj, name)
        if value is not None and value not in allowed:
            raise ConfigError(f"{section}.{name}={value!r}: expected one of {', '.join(allowed)}")


@functools.cache
def auto_keys(cls) -> frozenset[str]:
    """The fields of ``cls`` whose type takes "auto" beside its own (``bool | Auto``)."""
    hints = typing.get_type_hints(cls)
    return frozenset(f.name for f in dataclasses.fields(cls) if Auto in typing.get_args(hints[f.name]))


def bounds_of(cls, names=None) -> dict:
    """{field: bounds} of ``cls``'s fields that declare bounds (of ``names`` only, if given)."""
    return {
        f.name: f.metadata["bounds"]
        for f in dataclasses.fields(cls)
        if f.metadata.get("bounds") and (names is None or f.name in names)
    }


def choices_of(cls) -> dict:
    """{field: allowed names} of ``cls``'s fields that declare choices."""
    return {f.name: f.metadata["choices"] for f in dataclasses.fields(cls) if f.metadata.get("choices")}


def validate(section: str, obj, names=None, exclude=()) -> None:
    """Check the fields' declared choices, then their bounds (of ``names``, less ``exclude``)."""
    check_choices(
        section,
        obj,
        {k: v for k, v in choices_of(type(obj)).items() if (names is None or k in names) and k not in exclude},
    )
    check_bounds(section, obj, {k: v for k, v in bounds_of(type(obj), names).items() if k not in exclude})


def walk(cls, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """(dotted key, field) for every field of ``cls``, a section's own field before its keys."""
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        if f.default_factory is not _MISSING and dataclasses.is_dataclass(f.default_factory):
            yield from walk(f.default_factory, f"{prefix}{f.name}.")


def is_section(f: dataclasses.Field) -> bool:
    return f.default_factory is not _MISSING and dataclasses.is_dataclass(f.default_factory)


def resume_free_keys(cls) -> tuple[str, ...]:
    """The keys a resume may change: each free key, and "SECTION." for each free section (all
    its keys), in declaration order."""
    out, sections = [], []
    for name, f in walk(cls):
        if any(name.startswith(s) for s in sections) or f.metadata.get("resume") != "free":
            continue
        if is_section(f):
            sections.append(name + ".")
            out.append(name + ".")
        else:
            out.append(name)
    return tuple(out)


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not _MISSING else f.default
