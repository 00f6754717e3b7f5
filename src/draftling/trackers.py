"""Experiment trackers: where a training run's metric records go besides metrics.jsonl and
TensorBoard (train/metrics.py's MetricsLog forwards every record to each).

A tracker is anything with ``log(metrics: dict, step: int)`` and ``close()``. Which ones a run
uses: the config key ``train.trackers`` (a list of names, e.g. ``train.trackers=[wandb]``) or,
when that is empty, the env var ``DRAFTLING_TRACKERS`` (comma-separated). The adapters here
import their library only when a run asks for them; a missing library is a one-line error
that names the package to install.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Protocol

from draftling.errors import ConfigError

ENV = "DRAFTLING_TRACKERS"


class Tracker(Protocol):
    def log(self, metrics: dict, step: int) -> None: ...

    def close(self) -> None: ...


def _missing(name: str) -> ConfigError:
    return ConfigError(f"train.trackers: {name} needs the {name} package, which is not installed (pip install {name})")


def _import(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise _missing(name) from None


def scalars(metrics: dict) -> dict[str, float]:
    """The numbers of a metrics record, lists flattened (``acc`` -> ``acc_0``, ``acc_1``, ...),
    keyed ``split/key`` as in TensorBoard; strings and nested records are left out."""
    prefix, out = metrics.get("split", "train"), {}
    for key, value in metrics.items():
        if isinstance(value, bool) or key in ("step", "split"):
            continue
        if isinstance(value, (int, float)):
            out[f"{prefix}/{key}"] = value
        elif isinstance(value, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            out.update({f"{prefix}/{key}_{j}": v for j, v in enumerate(value)})
    return out


class WandbTracker:
    """A W&B run (project from ``WANDB_PROJECT``, default "draftling"; the rest from W&B's env)."""

    def __init__(self, run_dir: str | None = None, config: dict | None = None):
        wandb = _import("wandb")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "draftling"), dir=run_dir, config=config)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run (tracking URI and experiment from MLflow's env: ``MLFLOW_TRACKING_URI``...)."""

    def __init__(self, run_dir: str | None = None, config: dict | None = None):
        self.mlflow = _import("mlflow")
        self.mlflow.start_run()
        if config:
            self.mlflow.log_params({k: str(v)[:500] for k, v in _flat(config).items()})

    def log(self, metrics: dict, step: int) -> None:
        self.mlflow.log_metrics(scalars(metrics), step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


TRACKERS: dict[str, Callable[..., Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def tracker_names(configured: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """The configured names, or ``DRAFTLING_TRACKERS``'s when none are; each checked to be known
    and its library installed (found, not imported), so a run fails before it starts."""
    names = list(configured or []) or [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"train.trackers: unknown tracker {name!r}; expected any of {', '.join(TRACKERS)}")
        if importlib.util.find_spec(name) is None:
            raise _missing(name)
    return names


def open_trackers(
    names: list[str] | tuple[str, ...] | None = None, run_dir: str | None = None, config: dict | None = None
) -> list[Tracker]:
    """The trackers ``names`` (or the env var's) asks for, started; a missing library fails here,
    before any is left open."""
    names = tracker_names(names)
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(TRACKERS[name](run_dir=run_dir, config=config))
    except BaseException:
        for t in opened:
            t.close()
        raise
    return opened
