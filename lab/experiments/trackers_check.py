"""Check draftling's W&B and MLflow adapters against the real libraries: open both through
``open_trackers``, write four metrics records through the trainer's MetricsLog, then read them
back from W&B's offline run file and MLflow's store. Prints one JSON line; exits 1 on a miss.

    WANDB_MODE=offline MLFLOW_ALLOW_FILE_STORE=true MLFLOW_TRACKING_URI=file://$PWD/mlruns \\
        python3 lab/experiments/trackers_check.py DIR

Needs wandb and mlflow (or mlflow-skinny) importable; the product never imports them itself."""

import json
import sys
from pathlib import Path

from draftling.trackers import open_trackers
from draftling.train.metrics import MetricsLog


def main(out: Path) -> int:
    import mlflow
    import wandb

    out.mkdir(parents=True, exist_ok=True)
    trackers = open_trackers(["wandb", "mlflow"], run_dir=str(out), config={"train": {"lr": 1e-3, "ttt_steps": 7}})
    log = MetricsLog(out / "metrics.jsonl", None, trackers)
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 2.0 / step, "acc": [0.1 * step, 0.05 * step]})
    log.write({"step": 3, "split": "val", "loss": 0.5})
    log.close()
    client = mlflow.tracking.MlflowClient()
    run_id = mlflow.search_runs(search_all_experiments=True).run_id[0]
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in ("train/loss", "val/loss")}
    # W&B's offline run file is binary; its history keys are stored as plain strings.
    blob = next((out / "wandb" / "latest-run").glob("*.wandb")).read_bytes()
    result = {
        "wandb": wandb.__version__,
        "mlflow": mlflow.__version__,
        "mlflow_history": history,
        "mlflow_params": client.get_run(run_id).data.params,
        "wandb_keys": sorted(k for k in ("train/loss", "train/acc_1", "val/loss") if k.encode() in blob),
    }
    ok = history["train/loss"] == [(1, 2.0), (2, 1.0), (3, 2.0 / 3)] and len(result["wandb_keys"]) == 3
    print(json.dumps({**result, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
