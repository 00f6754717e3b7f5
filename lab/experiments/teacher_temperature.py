"""Train with the teacher's draft-vocab distribution at temperature T (T < 1 sharpens it
toward its argmax, which is all greedy acceptance checks), without changing draftling: the
TTT unroll is wrapped so that training steps see logits / T. Validation is unchanged (its
accuracies and chain walk use the argmax, which T does not move).

    python lab/experiments/teacher_temperature.py T draftling-train-args...
    e.g. ... 0.5 --config quickstart_cpu --data runs/qs9/data --run-dir runs/t05 train.max_minutes=0
"""

import dataclasses
import sys

import torch

import draftling.train.ttt as ttt
from draftling.cli import main


def with_temperature(temperature: float):
    unroll = ttt.ttt_unroll

    def wrapped(draft, embed, teacher, *args, **kwargs):
        if torch.is_grad_enabled():
            teacher = dataclasses.replace(teacher, draft_logits=teacher.draft_logits / temperature)
        return unroll(draft, embed, teacher, *args, **kwargs)

    return wrapped


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    ttt.ttt_unroll = with_temperature(float(sys.argv[1]))
    sys.exit(main(["train", *sys.argv[2:]]))
