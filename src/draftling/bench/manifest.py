"""One folder per bench run, and the manifest that says what made it.

A run's folder is ``<date>-<what>-<commit>-<machine>[-<tag>]`` (bench/results/README.md) and
holds its files and a ``manifest.json``: commit, command, config, machine and date. A bench
that writes one file the user named records ``manifest_fields`` inside it instead, so nothing
is written beside that file.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from draftling import __version__
from draftling.io import write_json

MANIFEST = "manifest.json"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def tag_slug(tag: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", tag).strip("-")


def draft_label(path) -> str:
    """A draft as results name it, never the path a run used: its training run's folder for a
    run's ``draft/`` (or a checkpoint's), else its own name."""
    p = Path(str(path))
    if p.parent.name == "checkpoints":
        return f"{p.parent.parent.name}/{p.name}"
    return p.parent.name if p.name == "draft" else p.name


@functools.cache
def code_commit() -> str:
    """The short git hash of the checkout this package is imported from, "-dirty" added when a
    tracked file differs from it, or "unknown" (an installed copy; the manifest's ``version`` then
    names the code). Read once per process, so every name a run derives from it agrees."""
    return commit_of(Path(__file__).resolve().parents[1])


def commit_of(package: Path) -> str:
    """``code_commit`` for the package folder ``package`` (``<checkout>/src/draftling``)."""

    def git(*args):
        return subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, timeout=10)

    try:
        found = git("rev-parse", "--show-toplevel", "--short", "HEAD")
        lines = found.stdout.split()
        # A copy installed inside some other repository (a venv in a checkout) is not its code.
        if found.returncode or len(lines) != 2 or (Path(lines[0]) / "src" / "draftling").resolve() != package:
            return "unknown"
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return lines[1] + ("-dirty" if changed.returncode or changed.stdout.strip() else "")


@functools.cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


# A results file's ``gpu`` (and the simple bench's ``device``) comes from one of these three.


def device_name(device) -> str:
    """The GPU's full name ("NVIDIA H200"), or "cpu (<processor>, <n> threads)": the simple bench's
    ``device`` and the lab benches' ``gpu``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def device_slug(device) -> str:
    """ "cpu", or the GPU's name as a slug ("nvidia-h200"): the release and concurrency files' ``gpu``."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return slug(device_name(device))


def first_gpu_name() -> str:
    """The full name of cuda:0, or "cpu" without a GPU: the ``gpu`` of results summarised from
    finished runs (lab/benches/ddp_scaling.py, lab/gpu/train_fixed_cost.py)."""
    return device_name("cuda:0") if torch.cuda.is_available() else "cpu"


def machine_slug(gpu: str) -> str:
    """The machine in a folder name: the GPU's slug, or for the CPU its family and cores
    (cpu-epyc-2core), as bench/results/README.md lists them."""
    if gpu != "cpu":
        return gpu
    model = cpu_model().lower()
    family = next((f for f in ("epyc", "xeon", "ryzen") if f in model), None)
    if family is None:
        arch = platform.machine().lower()
        family = {"x86_64": "x86", "amd64": "x86", "aarch64": "arm", "arm64": "arm"}.get(arch, slug(arch) or "cpu")
    return f"cpu-{family}-{os.cpu_count()}core"


def machine_line(device) -> str:
    """One line: the machine's slug, GPU name or CPU model and cores, torch and transformers."""
    import transformers

    device = torch.device(device)
    gpu = device_slug(device)
    what = device_name(device) if gpu != "cpu" else f"{cpu_model()}, {os.cpu_count()} cores"
    return f"{machine_slug(gpu)}: {what}; torch {torch.__version__}, transformers {transformers.__version__}"


def run_folder_name(date: str, what: str, commit: str, machine: str, tag: str | None = None) -> str:
    name = f"{date}-{slug(what)}-{commit}-{machine}"
    return f"{name}-{tag_slug(tag)}" if tag else name


def command_line(argv: list[str] | None = None) -> str:
    """This process's command, quoted as a shell needs it. Run through the package (``python -m
    draftling`` or the ``draftling`` script), it is named ``draftling``: a result names the tool,
    not the folder it ran from."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name in ("__main__.py", "draftling"):
        argv[0] = "draftling"
    return shlex.join(argv)


def manifest_fields(command: str | None, config: dict, device, date: str | None = None) -> dict:
    """commit (with the package version, which names the code where the commit is unknown),
    date, machine, command (default: this process's argv, quoted as a shell would need it) and
    the resolved config."""
    return {
        "commit": code_commit(),
        "version": __version__,
        "date": date or datetime.date.today().isoformat(),
        "machine": machine_line(device),
        "command": command if command is not None else command_line(),
        "config": config,
    }


def write_manifest(
    folder: str | Path,
    command: str | None,
    config: dict,
    device,
    date: str | None = None,
    what: str | None = None,
    **extra,
) -> Path:
    """``<folder>/manifest.json``: what the run measured, ``manifest_fields``, then ``extra``
    (e.g. ``files``)."""
    path = Path(folder) / MANIFEST
    head = {"what": what} if what else {}
    write_json(path, {**head, **manifest_fields(command, config, device, date), **extra})
    return path
