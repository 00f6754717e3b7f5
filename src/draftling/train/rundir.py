"""Run-directory ownership and the resume policy: a directory holding an earlier run is refused
unless resumed or overwritten, and a resume may change only the config keys ``RESUME_FREE_KEYS``
lists (read from each key's declared resume policy, draftling.config), or those named with
``--allow-change``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from draftling.config import RESUME_FREE_KEYS, RunConfig
from draftling.errors import ConfigError
from draftling.io import remove_path
from draftling.train.checkpoint import remove_stale_temporaries
from draftling.train.distributed import DistContext, barrier

log = logging.getLogger(__name__)

__all__ = ["RESUME_FREE_KEYS", "RunDirClaim", "check_run_dir", "claim_run_dir", "resume_free", "resume_config_changes"]


def resume_free(key: str) -> bool:
    """Whether a resume may change the flattened config key ``key``: a key RESUME_FREE_KEYS
    names (or an entry of a mapping it names, e.g. max_memory.0), or any key of a section it
    names ("data.")."""
    return any(key == free or key.startswith(free if free.endswith(".") else free + ".") for free in RESUME_FREE_KEYS)


def resume_config_changes(run_dir: Path, cfg: RunConfig, allow_change) -> dict:
    """{key: (old, new)} for the keys ``allow_change`` lets a resume change; a ConfigError
    listing any other key whose value differs from the run's saved config.yaml."""
    from draftling.config import load_config, to_dict

    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return {}
    old, new = _flatten(to_dict(load_config(saved))), _flatten(to_dict(cfg))
    differ = {
        k: (old.get(k), new.get(k))
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and not resume_free(k)
    }
    refused = [k for k in differ if k not in set(allow_change)]
    if refused:
        listed = "; ".join(f"{k}: {differ[k][0]!r} -> {differ[k][1]!r}" for k in refused)
        raise ConfigError(
            f"--resume {run_dir}: the config differs from the run's ({listed}); resume with the "
            f"run's values, or apply the change with --allow-change {refused[0]}"
        )
    return differ


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "max_prompts_by_file":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> list[Path]:
    """A run directory that holds an earlier run is refused unless the run resumes it or
    starts over (``overwrite``); a later ``--resume`` must never pick up a stale checkpoint of
    another run. Returns what an overwrite removes."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: is a file, not a directory")
    earlier = [run_dir / n for n in ("checkpoints", "draft", "metrics.jsonl") if (run_dir / n).exists()]
    if earlier and not resume and not overwrite:
        raise ConfigError(
            f"--run-dir {run_dir}: holds an earlier run ({', '.join(p.name for p in earlier)}); "
            "pass --resume to continue it or --overwrite to start over"
        )
    return [] if resume else earlier


def claim_run_dir(run_dir: Path, resume: bool, overwrite: bool, ctx: DistContext) -> None:
    """check_run_dir, then make the directory: with ``overwrite`` the earlier run's
    checkpoints, draft and metrics go."""
    earlier = check_run_dir(run_dir, resume, overwrite)
    if earlier:
        barrier(ctx)  # every rank has looked before rank 0 removes
        if ctx.is_main:
            for path in earlier + [run_dir / "tensorboard", run_dir / "train_result.json"]:
                remove_path(path)
        barrier(ctx)
    run_dir.mkdir(parents=True, exist_ok=True)
    if ctx.is_main:
        stale = remove_stale_temporaries(run_dir)
        if stale:
            log.info(
                f"removed {len(stale)} temporaries that interrupted writes left in {run_dir}: "
                f"{', '.join(sorted(stale)[:4])}{' ...' if len(stale) > 4 else ''}"
            )
    barrier(ctx)


@dataclasses.dataclass(frozen=True)
class RunDirClaim:
    """How ``train`` takes its run directory: ``resume`` the run there (``allow_change``: config
    keys the resume may change, see resume_config_changes), or ``overwrite`` an earlier run;
    by default the directory must hold none (check_run_dir)."""

    resume: bool = False
    overwrite: bool = False
    allow_change: Sequence[str] = ()
