"""Progress for the long stages: a tqdm bar on a terminal; without one (a log file, CI, a
device run) the bar would print nothing useful, so the stage's own status lines go to stdout.
``quiet_libraries`` keeps the libraries' own bars and chatter out of that log."""

from __future__ import annotations

import os
import sys


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
    """``update(n, line)`` advances the bar on a terminal, or prints ``line`` (when given)
    without one. ``enabled=False`` keeps it silent either way."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc)

    def update(self, n: int = 1, line: str | None = None) -> None:
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and line is not None:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
