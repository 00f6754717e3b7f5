"""Run by the python that has speculators 0.9.0 (lab/gpu/scale_peer.py starts it); imports no draftling.

    python scale_spec_launch.py dataset ROWS.jsonl OUT_DIR   # the Arrow dataset `prepare-data` writes
    python scale_spec_launch.py train METRICS.jsonl ARGS...  # `speculators train ARGS...`

``dataset``: rows {"input_ids", "loss_mask"} as the columns speculators' preprocessing saves
(input_ids, loss_mask, seq_len; torch format), for data already tokenized by draftling.
``train``: speculators' own CLI (``python -m speculators train``), with one logging handler added
that writes each metric record its trainer logs (the per-step profile: tokens_per_s, memory_mb)
to METRICS.jsonl; speculators itself is not changed.
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
    # A fingerprint of our own: datasets 5.1 hashes a new table with dill, which under Python
    # 3.12 and pyarrow 26 fails on pyarrow's MonthDayNano class.
    ds = Dataset(table, fingerprint=f"draftling-rows-{len(rows)}")
    ds.set_format(type="torch")
    ds.save_to_disk(out_dir)


def train(metrics_path, args):
    handler = MetricLines(metrics_path)
    logging.getLogger().addHandler(handler)
    from speculators.cli import app

    sys.argv = ["speculators", "train", *args]
    try:
        app()
    finally:  # the process's true peak, as draftling's figure is read
        import torch

        if torch.cuda.is_available():
            handler.emit(logging.makeLogRecord({"msg": {"peak_bytes": torch.cuda.max_memory_allocated()}}))


if __name__ == "__main__":
    if sys.argv[1] == "dataset":
        dataset(sys.argv[2], sys.argv[3])
    else:
        train(sys.argv[2], sys.argv[3:])
