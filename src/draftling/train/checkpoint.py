"""Atomic checkpoints that resume exactly: weights (safetensors) plus the optimizer,
scheduler, step, data position and every RNG state (a weights_only-loadable dict)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from draftling.draft.store import WEIGHTS_FILE, save_draft
from draftling.faults import fault_point
from draftling.io import atomic_dir, hash_dataset_file, remove_path, write_json

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(frozen=True)
class KeepPolicy:
    """Which checkpoints pruning spares: the newest ``newest`` (0 = all), and the candidates for
    selection: those at an epoch's end (``epoch_ends``) and at multiples of ``every_steps``."""

    newest: int = 2
    epoch_ends: bool = False
    every_steps: int = 0

    def spares(self, ckpt: Path) -> bool:
        meta = json.loads((ckpt / "meta.json").read_text()) if (ckpt / "meta.json").is_file() else {}
        step = int(meta.get("step", -1))
        return (self.epoch_ends and meta.get("batch_index") == 0 and step > 0) or (
            self.every_steps > 0 and step > 0 and step % self.every_steps == 0
        )


def save_checkpoint(
    run_dir: Path,
    draft,
    optimizer_state: dict,
    scheduler,
    step: int,
    position: tuple[int, int],
    keep: KeepPolicy | int,
    extra: dict | None = None,
) -> Path:
    """``draft``: a plain draft with full weights; ``optimizer_state``: the full optimizer
    state in the single-process layout (see distributed.full_optimizer_state); ``position``:
    the data position (epoch, batch index) of the next batch, as EpochBatches.position gives it.
    ``keep``: what pruning spares (an int: the newest N)."""
    keep = keep if isinstance(keep, KeepPolicy) else KeepPolicy(keep)
    epoch, batch_index = position
    final = Path(run_dir) / "checkpoints" / f"step_{step:07d}"
    with atomic_dir(final) as tmp:
        save_draft(draft, tmp)
        torch.save(
            {
                "optimizer": optimizer_state,
                "scheduler": scheduler.state_dict(),
                "step": step,
                "epoch": epoch,
                "batch_index": batch_index,
                "rng": rng_state(),
            },
            tmp / STATE_FILE,
        )
        write_json(tmp / "meta.json", {"step": step, "epoch": epoch, "batch_index": batch_index, **(extra or {})})
        # Written last, over every other file: resume checks it before trusting the checkpoint.
        write_json(
            tmp / MANIFEST_FILE,
            {p.name: {"bytes": p.stat().st_size, "sha256": hash_dataset_file(p)} for p in sorted(tmp.iterdir())},
        )
        fault_point("checkpoint.written")
    for old in list_checkpoints(run_dir)[: -keep.newest] if keep.newest > 0 else []:
        if keep.spares(old):
            continue
        # Renamed out of the list first: a kill while deleting leaves a temporary, never a
        # checkpoint with missing files.
        doomed = old.with_name(f".{old.name}.pruned.tmp")
        os.replace(old, doomed)
        fault_point("checkpoint.prune")
        shutil.rmtree(doomed, ignore_errors=True)
    return final


def remove_stale_temporaries(run_dir: Path) -> list[str]:
    """Remove what killed writes left in a run directory: the hidden ``.NAME.*.tmp`` and
    ``.NAME.old`` entries of atomic writes and prunes. Returns their names."""
    removed = []
    for folder in (Path(run_dir), Path(run_dir) / "checkpoints"):
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.name.startswith(".") and (p.name.endswith(".tmp") or p.name.endswith(".old")):
                remove_path(p, ignore_errors=True)
                removed.append(p.name)
    return removed


def checkpoint_step(ckpt: Path) -> int:
    """The training step a checkpoint directory (``step_0000042``) was written at."""
    m = _STEP_DIR.match(Path(ckpt).name)
    if m is None:
        raise ValueError(f"{ckpt}: not a checkpoint directory (step_NNNNNNN)")
    return int(m.group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and all((p / f).is_file() for f in (STATE_FILE, WEIGHTS_FILE))
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path, warn=None) -> Path | None:
    """The newest checkpoint whose files match its manifest; a damaged one is skipped with a
    warning (``warn``, default this module's logger at info) that names it and what is wrong."""
    warn = warn or log.info
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        warn(f"skipping damaged checkpoint {ckpt}: {problem}")
    return None


def checkpoint_problem(ckpt: Path) -> str | None:
    """What is wrong with a checkpoint against its manifest, or None (one without a manifest,
    from before manifests, is taken as it is)."""
    path = ckpt / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"{MANIFEST_FILE} is unreadable ({e})"
    for name, want in manifest.items():
        f = ckpt / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {want['bytes']}"
        if hash_dataset_file(f) != want["sha256"]:
            return f"{name} does not match its sha256"
    return None


def load_train_state(ckpt: Path) -> dict:
    return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
