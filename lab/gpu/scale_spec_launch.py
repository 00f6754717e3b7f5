"""Run by the python that has speculators 0.9.0 (lab/gpu/scale_peer.py starts it); imports no draftling.

    python scale_spec_launch.py dataset ROWS.jsonl OUT_DIR   # the Arrow dataset `prepare-data` writes
    python scale_spec_launch.py train METRICS.jsonl ARGS...  # `speculators train ARGS...`

``dataset``: rows {"input_ids", "loss_mask"} as the columns speculators' preprocessing saves
(input_ids, loss_mask, seq_len; torch format), for data already tokenized by draftling.
``train``: speculators' own CLI (``python -m speculators train``), with one logging handler added
that writes each metric record its trainer logs (the per-step profile: tokens_per_s, memory_mb)
to METRICS.jsonl, its epochs bounded by --max-steps (stop_at_max_steps) and, with no GPU (the
dry run), its device put on the CPU (cpu_only); speculators' files are not changed.
"""

import json
import logging
import sys


class MetricLines(logging.Handler):
    def __init__(self, path):
        super().__init__(logging.INFO)
        self.file = open(path, "a")  # noqa: SIM115 - open for the process's life

    def emit(self, record):
        if isinstance(record.msg, dict):
            self.file.write(json.dumps(record.msg, default=str) + "\n")
            self.file.flush()


def dataset(rows_path, out_dir):
    from datasets import Dataset
    from datasets.table import InMemoryTable

    rows = [json.loads(line) for line in open(rows_path)]
    table = InMemoryTable.from_pydict(
        {
            "input_ids": [r["input_ids"] for r in rows],
            "loss_mask": [r["loss_mask"] for r in rows],
            "seq_len": [len(r["input_ids"]) for r in rows],
        }
    )
    # A fingerprint of our own: datasets hashes a new table with dill, which pickles pyarrow's
    # module by value (failing on its MonthDayNano class) where pyarrow lies outside the prefix
    # in a folder not named site-packages (scale.sh installs into /tmp/spec/site-packages).
    ds = Dataset(table, fingerprint=f"draftling-rows-{len(rows)}")
    ds.set_format(type="torch")
    ds.save_to_disk(out_dir)


def cpu_only():
    """The CPU dry run: speculators' trainer is written for one accelerator (it moves the model to
    device index 0, syncs it, autocasts on it); with no GPU those go to the CPU instead."""
    import speculators.train.trainer as trainer
    import torch

    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.current_accelerator = lambda check_available=False: None
    torch.accelerator.synchronize = lambda device=None: None


def stop_at_max_steps():
    """speculators 0.9.0 ends an epoch at --max-steps but not the run: each later epoch of
    --epochs trains one more step, checkpoints and validates. Its epochs are cut to those the
    steps fill (its loader's batches an epoch, as its train_epoch counts them)."""
    from speculators.train.trainer import Trainer

    run_training = Trainer.run_training

    def bounded(self):
        steps, per_epoch = self.config.max_steps, max(1, len(self.train_loader))
        if steps:
            self.config = self.config._replace(num_epochs=min(self.config.num_epochs, -(-steps // per_epoch)))
        return run_training(self)

    Trainer.run_training = bounded


def train(metrics_path, args):
    handler = MetricLines(metrics_path)
    logging.getLogger().addHandler(handler)
    import torch
    from speculators.cli import app

    stop_at_max_steps()
    if not torch.cuda.is_available():
        cpu_only()

    sys.argv = ["speculators", "train", *args]
    try:
        app()
    finally:  # the process's true peak, as draftling's figure is read
        if torch.cuda.is_available():
            handler.emit(logging.makeLogRecord({"msg": {"peak_bytes": torch.cuda.max_memory_allocated()}}))


if __name__ == "__main__":
    if sys.argv[1] == "dataset":
        dataset(sys.argv[2], sys.argv[3])
    else:
        train(sys.argv[2], sys.argv[3:])
