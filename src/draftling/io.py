"""Atomic file and directory writes: a crash never leaves a half-written output behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftling.errors import DraftlingError


def umask_mode(directory: bool = False) -> int:
    """The mode a plain open() or mkdir() would give under the current umask. mkstemp and
    mkdtemp create 0600 / 0700, which would hide outputs from a serving process of another user."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary file path beside `final`; rename it over `final` only on success."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.fchmod(fd, umask_mode())
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


def _temp_dir_beside(final: Path) -> Path:
    """A hidden ``.NAME.*.tmp`` directory next to ``final`` (so a rename is atomic), with the
    mode the umask gives."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    tmp.chmod(umask_mode(directory=True))
    return tmp


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside `final`; it replaces `final` only on success."""
    final = Path(final)
    tmp = _temp_dir_beside(final)
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_path(path: Path, ignore_errors: bool = False) -> None:
    """Remove a file or a directory tree, whichever ``path`` is; nothing if it is gone."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=ignore_errors)
    else:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            if not ignore_errors:
                raise


def check_writable(path: str | os.PathLike, flag: str = "--out") -> None:
    """Refuse, before any work, an output whose nearest existing folder takes no new entry
    (read-only, a pseudo-filesystem): a probe directory is made there and removed."""
    folder = Path(path).absolute().parent
    while not folder.exists():
        folder = folder.parent
    try:
        Path(tempfile.mkdtemp(prefix=".draftling-probe.", dir=folder)).rmdir()
    except OSError as e:
        raise DraftlingError(f"{flag} {path}: cannot write in {folder} ({e.strerror or e})") from None


def output_dir_in_use(path: Path, flag: str = "--out") -> bool:
    """Whether an output directory already holds something, after refusing a file there and
    a place that takes no new entry; what may be in it is the caller's to judge."""
    if path.exists() and not path.is_dir():
        raise DraftlingError(f"{flag} {path}: is a file, not a directory")
    check_writable(path, flag)
    return path.is_dir() and any(path.iterdir())


# Written into every output directory that owns its contents (an export): what kind of output
# it is and which files draftling put there, so a rerun replaces only those.
OUTPUT_MARKER = ".draftling-output.json"


def check_output_dir(path: str | os.PathLike, kind: str, overwrite: bool, flag: str = "--out") -> None:
    """Refuse, before any work, to write a ``kind`` directory at ``path`` when it is a file, a
    non-empty directory draftling did not write, another kind of draftling output, or an
    earlier ``kind`` output without ``overwrite``."""
    path = Path(path)
    if not output_dir_in_use(path, flag):
        return
    marker = path / OUTPUT_MARKER
    owner = _read_marker(marker)
    if owner is None:
        raise DraftlingError(
            f"{flag} {path}: not empty and not written by draftling; choose an empty or new "
            "directory (nothing was changed)"
        )
    if owner.get("kind") != kind:
        raise DraftlingError(f"{flag} {path}: holds a draftling {owner.get('kind')!r} output, not {kind!r}")
    if not overwrite:
        raise DraftlingError(f"{flag} {path}: holds an earlier {kind}; pass --overwrite to replace its files")


def _read_marker(marker: Path) -> dict | None:
    try:
        owner = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


@contextlib.contextmanager
def atomic_output_dir(final: str | os.PathLike, kind: str) -> Iterator[Path]:
    """For a directory ``check_output_dir`` has cleared: yield a temporary directory beside it.
    On success a new output is renamed into place whole; over an earlier output its files
    replace the earlier ones one by one (each an atomic rename), files draftling did not write
    stay, and the marker, written last, lists the new files."""
    final = Path(final)
    tmp = _temp_dir_beside(final)
    try:
        yield tmp
        files = sorted(p.name for p in tmp.iterdir())
        write_json(tmp / OUTPUT_MARKER, {"kind": kind, "files": files})
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()
        if not final.exists():
            os.replace(tmp, final)
            return
        old = _read_marker(final / OUTPUT_MARKER) or {}
        for name in files:
            os.replace(tmp / name, final / name)
        for name in set(old.get("files", [])) - set(files):
            (final / name).unlink(missing_ok=True)
        os.replace(tmp / OUTPUT_MARKER, final / OUTPUT_MARKER)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL log a process appends to (metrics.jsonl): a blank line, or the
    last one a kill cut short, is skipped."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def write_jsonl(path: str | os.PathLike, rows) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def hash_dataset_file(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes: ties a vocab or cached teacher outputs to the data they came from."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
