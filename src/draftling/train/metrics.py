"""The metrics log: ``metrics.jsonl`` (plus TensorBoard when installed, and the experiment trackers
a run asks for, trackers.py) and the progress lines, and
the window of training steps each log line sums (``StepWindow``), read from the device once per line."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from draftling.io import atomic_path, read_metrics
from draftling.train.distributed import DistContext, all_reduce_sum
from draftling.train.step_counts import StepCounts

log = logging.getLogger(__name__)


class MetricsLog:
    """JSONL metrics plus a plain progress line in the log (stdout; works without a TTY),
    TensorBoard when it is installed, and each of ``trackers`` (trackers.Tracker: ``log(record,
    step)``, ``close()``), which get every record as written. Every record is flushed as it is written."""

    def __init__(self, path: Path, resume_step: int | None, trackers: list | tuple = ()):
        self.path, self.trackers = path, list(trackers)
        if resume_step is not None and path.exists():
            # Drop records the interrupted run wrote after the checkpoint we resume from.
            # The final validation comes after the last checkpoint: a resume writes it again.
            kept = [json.dumps(r) for r in read_metrics(path) if r.get("step", 0) <= resume_step and not r.get("final")]
            with atomic_path(path) as tmp:
                tmp.write_text("".join(l + "\n" for l in kept))
        elif path.exists():
            path.unlink()
        self.file = open(path, "a")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(path.parent / "tensorboard"))
        except ImportError:
            pass

    def write(self, record: dict, line: str | None = None) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            prefix = record.get("split", "train")
            for key in ("loss", "sim_tau", "chain_tau", "lr", "tok_s", "mean_tau"):
                if key in record:
                    self.tb.add_scalar(f"{prefix}/{key}", record[key], record["step"])
            for j, a in enumerate(record.get("acc", [])):
                self.tb.add_scalar(f"{prefix}/acc_step{j}", a, record["step"])
        for tracker in self.trackers:
            tracker.log(record, record.get("step", 0))
        if line:
            log.info(line)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        for tracker in self.trackers:
            tracker.close()


def format_line(prefix: str, m: dict) -> str:
    acc = " ".join(f"{a:.2f}" for a in m["acc"])
    cond = " ".join(f"{a:.2f}" for a in m["cond_acc"])
    vocab = f" | vocab {m['vocab_coverage']:.2f}" if "vocab_coverage" in m else ""
    chain = f" | chain_tau {m['chain_tau']:.2f}" if "chain_tau" in m else ""
    return f"{prefix} loss {m['loss']:.3f} | acc {acc} | cond {cond} | sim_tau {m['sim_tau']:.2f}{chain}{vocab}"


def read_counts(counts: StepCounts, extras: list, ctx: DistContext) -> tuple[StepCounts, list[float]]:
    """``counts`` and ``extras`` (device scalars or host numbers) summed over ranks and read to
    the host: one collective and one read, once per log line (every rank calls it there)."""
    steps, device = counts.steps, counts.sums.device
    tail = [
        torch.as_tensor(x, dtype=torch.float64, device=device).reshape(1)
        for x in (counts.walk_rounds, counts.walk_accepted, *extras)
    ]
    values = all_reduce_sum(torch.cat([counts.sums.flatten(), *tail]), ctx).tolist()
    n = len(StepCounts.FIELDS) * steps
    out = StepCounts(
        steps,
        torch.tensor(values[:n], dtype=torch.float64).view(-1, steps),
        walk_rounds=int(round(values[n])),
        walk_accepted=int(round(values[n + 1])),
    )
    return out, values[n + 2 :]


class StepWindow:
    """The counts, loss and tokens since the last log line. Counts and loss stay on the device
    until ``log`` reads them (summed over ranks): the steps between never wait for the device."""

    def __init__(self, ttt_steps: int, device):
        self.ttt_steps, self.device = ttt_steps, device
        self.reset()

    def reset(self) -> None:
        self.counts = StepCounts(self.ttt_steps, device=self.device)
        self.loss, self.tokens = torch.zeros((), dtype=torch.float64, device=self.device), 0
        self.t0 = time.perf_counter()

    def add(self, counts: StepCounts, loss: torch.Tensor, tokens: int) -> None:
        self.counts.add(counts)
        self.loss = self.loss + loss.detach().double()
        self.tokens += tokens

    def log(self, run) -> None:
        """The log line and record of the window so far, for ``run`` (a trainer.TrainRun) at its step."""
        every, step, world = run.cfg.train.log_every, run.step, run.ctx.world_size
        counts, (loss, tokens) = read_counts(self.counts, [self.loss, self.tokens], run.ctx)
        m = counts.metrics()
        n_logged = every if step % every == 0 else step % every
        now = time.perf_counter()  # after the read: the window's steps have finished on the device
        tokens = int(tokens)
        m.update(
            step=step,
            epoch=run.batches.position(step - 1)[0],
            loss=loss / world / n_logged,
            lr=run.scheduler.get_last_lr()[0],
            tok_s=tokens / (now - self.t0),
            window_tokens=tokens,
            segment=run.segment_step,
            wall_s=now - run.segment_start,
            split="train",
        )
        if run.metrics_log:
            timing = f" | {run.progress.timing()}" if run.progress is not None else ""
            run.metrics_log.write(
                m,
                format_line(f"step {step}/{run.total_steps}", m)
                + f" | lr {m['lr']:.2e} | {m['tok_s']:.0f} tok/s{timing}",
            )
        self.reset()
