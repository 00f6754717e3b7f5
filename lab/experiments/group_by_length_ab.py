"""Training speed with and without length-grouped batches, on the data of a quickstart run.

    python lab/experiments/group_by_length_ab.py QUICKSTART_RUN/data false true

Trains the quickstart profile for 30 steps per setting (train.group_by_length=<setting>)
and prints the wall time of each; the per-step tok/s lines come from the trainer.
"""

import sys
import time
from pathlib import Path

from draftling.config import load_config
from draftling.target import load_target
from draftling.train.trainer import train


def main(data: Path, settings: list[str]) -> None:
    for setting in settings:
        cfg = load_config(
            "quickstart_cpu",
            [f"train.group_by_length={setting}", "train.max_steps=30", "train.log_every=10", "train.max_val_batches=1"],
        )
        target = load_target(cfg.target, dtype=cfg.dtype, device="cpu", aux_layer_ids=cfg.aux_layer_ids)
        t0 = time.perf_counter()
        train(
            cfg,
            target,
            Path(f"/tmp/group_by_length_{setting}"),
            data / "train.jsonl",
            data / "val.jsonl",
            data / "vocab.safetensors",
        )
        print("GROUP", setting, "30 steps s", round(time.perf_counter() - t0, 1), flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2:])
