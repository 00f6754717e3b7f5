"""Progress for the long stages: a tqdm bar on a terminal; without one (a log file, CI, a
device run) the bar would print nothing useful, so the stage's own status lines go to the log
(stdout by default, logs.py), each with the elapsed time and the time left at the measured rate.
``quiet_libraries`` keeps the libraries' own bars and chatter out of that log."""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger(__name__)


def quiet_libraries() -> None:
    # transformers' per-tensor GGUF progress bars and deprecation chatter drown the run's own log.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Read when transformers is imported, so a bad value fails before that second of imports.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # main() called in a process that has imported it already
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


class Progress:
    """``update(n, line)`` advances the bar on a terminal (tqdm draws elapsed and time left), or
    prints ``line`` (when given) with ``timing()`` appended without one. ``enabled=False`` keeps
    it silent either way. ``emit``: where lines go (default: this module's logger, at info); ``bar=False``: lines even on a
    terminal (a stage whose lines are its record); ``initial``: units already done (a resumed
    run), which the rate does not count."""

    def __init__(self, total: int, desc: str, enabled: bool = True, initial: int = 0, emit=None, bar: bool = True):
        self.enabled, self.total, self.done = enabled, total, initial
        self.emit = emit or log.info
        self.t0, self.base = time.perf_counter(), initial  # the rate counts units done since t0
        self.bar = None
        if enabled and bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc)

    def update(self, n: int = 1, line: str | None = None) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and line is not None:
            self.emit(f"{line} | {self.timing()}")

    def skip(self, n: int = 1) -> None:
        """``n`` units found done (a journal, a finished shard): advanced, but not in the rate."""
        self.base += n
        self.update(n)

    def set_total(self, total: int) -> None:
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def timing(self) -> str:
        """ "elapsed 3m10s, ~1h02m left", from the rate measured since the start."""
        elapsed = time.perf_counter() - self.t0
        worked, left = self.done - self.base, max(0, self.total - self.done)
        if worked <= 0 or elapsed <= 0:
            return f"elapsed {duration(elapsed)}"
        return f"elapsed {duration(elapsed)}, ~{duration(left * elapsed / worked)} left"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def duration(seconds: float) -> str:
    """42s, 3m10s, 1h02m."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
