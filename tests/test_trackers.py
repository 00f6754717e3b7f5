"""trackers.py: MetricsLog forwards every record to the run's trackers; W&B and MLflow are
imported only when asked for, and a missing one is a one-line error naming the package."""

import os
import subprocess
import sys

import pytest

from draftling.config import load_config
from draftling.errors import ConfigError
from draftling.trackers import ENV, MlflowTracker, WandbTracker, open_trackers, scalars, tracker_names
from draftling.train.metrics import MetricsLog
from tests.conftest import CHECKOUT


class FakeTracker:
    def __init__(self):
        self.logged, self.closed = [], False

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((metrics, step))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def no_trackers_installed(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails, find_spec finds nothing


def test_metrics_log_forwards_every_record(tmp_path, capsys):
    fake = FakeTracker()
    metrics = MetricsLog(tmp_path / "metrics.jsonl", None, [fake])
    metrics.write({"step": 3, "split": "train", "loss": 1.5, "acc": [0.5, 0.25]}, "step 3/10 loss 1.500")
    metrics.write({"step": 3, "split": "config_change", "changes": {}})
    metrics.close()
    assert [step for _, step in fake.logged] == [3, 3] and fake.logged[0][0]["loss"] == 1.5
    assert fake.closed and capsys.readouterr().out == "step 3/10 loss 1.500\n"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_scalars_flatten_a_record():
    assert scalars({"step": 3, "split": "val", "loss": 1.5, "acc": [0.5, 0.25], "final": True, "why": "x"}) == {
        "val/loss": 1.5,
        "val/acc_0": 0.5,
        "val/acc_1": 0.25,
    }


@pytest.mark.parametrize("name, adapter", [("wandb", WandbTracker), ("mlflow", MlflowTracker)])
def test_a_missing_library_is_one_line_naming_the_package(no_trackers_installed, name, adapter):
    for attempt in (lambda: tracker_names([name]), lambda: open_trackers([name]), adapter):
        with pytest.raises(ConfigError) as e:
            attempt()
        assert "\n" not in str(e.value) and f"pip install {name}" in str(e.value)


def test_the_env_var_chooses_when_the_config_does_not(no_trackers_installed, monkeypatch):
    assert tracker_names([]) == [] and open_trackers(None) == []
    monkeypatch.setenv(ENV, "wandb")
    with pytest.raises(ConfigError, match="pip install wandb"):
        tracker_names([])
    monkeypatch.setenv(ENV, "neptune")
    with pytest.raises(ConfigError, match="unknown tracker 'neptune'"):
        tracker_names([])


def test_the_config_key_takes_known_names_only():
    assert load_config(None, ["train.trackers=[wandb, mlflow]"]).train.trackers == ["wandb", "mlflow"]
    assert load_config(None, []).train.trackers == []
    with pytest.raises(ConfigError, match="train.trackers"):
        load_config(None, ["train.trackers=[neptune]"])


def test_nothing_imports_the_trackers_libraries():
    code = (
        "import sys, draftling.cli, draftling.trackers, draftling.train.metrics, draftling.train.trainer; "
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(CHECKOUT / "src")},
    )
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
