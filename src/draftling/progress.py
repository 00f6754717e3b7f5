"""Progress for the long stages: a tqdm bar on a terminal; without one (a log file, CI, a
device run) the bar would print nothing useful, so the stage's own status lines go to stdout."""

from __future__ import annotations

import sys


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
