"""Where draftling's log lines go. Every module logs through ``logging.getLogger(__name__)``,
under the ``draftling`` logger, which carries two handlers:

- info and debug lines to stdout as plain ``%(message)s`` (the text users see on the terminal,
  as the pipeline's status lines always were), from rank 0 only under torchrun (``RANK`` /
  ``LOCAL_RANK``) unless ``DRAFTLING_LOG_ALL_RANKS=1``;
- warnings and errors to stderr as ``WARNING draftling.x: ...``, from every rank (a rank other
  than 0 says which it is).

``install_default`` puts them in place when draftling is imported, so library calls print as
they did; ``setup_logging`` (called by the CLI's main and the quickstart) sets the level, the
rank filter and an optional log file (``--log-file PATH`` or ``DRAFTLING_LOG_FILE``), which
takes every line from this rank with its time and level. Records still propagate to the root
logger, so an application's own handlers (and pytest's caplog) see them too.
"""

from __future__ import annotations

import logging
import os
import sys

PACKAGE = "draftling"
PLAIN = "%(message)s"
WARN_FORMAT = "%(levelname)s %(name)s: %(message)s"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ALL_RANKS_ENV, LOG_FILE_ENV = "DRAFTLING_LOG_ALL_RANKS", "DRAFTLING_LOG_FILE"


def env_rank() -> int:
    """This process's rank under torchrun (``RANK``, else ``LOCAL_RANK``), 0 outside it."""
    for key in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(key, "").strip()
        if value.isdigit():
            return int(value)
    return 0


class RankZeroFilter(logging.Filter):
    """Passes info and debug records on rank 0 only, warnings and errors on every rank.
    ``rank=None`` reads the rank from the environment at each record; ``all_ranks`` passes all."""

    def __init__(self, rank: int | None = None, all_ranks: bool | None = None):
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        everyone = self.all_ranks if self.all_ranks is not None else os.environ.get(ALL_RANKS_ENV) == "1"
        return everyone or (self.rank if self.rank is not None else env_rank()) == 0


class _Below(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


class _RankFormatter(logging.Formatter):
    """Names the rank on lines from a rank other than 0."""

    def __init__(self, fmt: str, rank: int | None):
        super().__init__(fmt)
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rank = self.rank if self.rank is not None else env_rank()
        return f"[rank {rank}] {line}" if rank else line


class StdStreamHandler(logging.StreamHandler):
    """A handler on ``sys.stdout`` or ``sys.stderr`` as they are at each record (not at setup),
    so a redirected stream (pytest's capsys, contextlib.redirect_stdout) gets the lines.
    Each record is flushed, as ``print(..., flush=True)`` was."""

    def __init__(self, name: str):
        logging.Handler.__init__(self)
        self.name_of_stream = name

    @property
    def stream(self):
        return getattr(sys, self.name_of_stream)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.setStream; the stream is looked up instead
        pass


def _ours(handler: logging.Handler) -> bool:
    return getattr(handler, "_draftling", False)


def _handlers(rank: int | None, all_ranks: bool | None, log_file: str | None) -> list[logging.Handler]:
    out = StdStreamHandler("stdout")
    out.setLevel(logging.DEBUG)
    out.addFilter(_Below(logging.WARNING))
    out.addFilter(RankZeroFilter(rank, all_ranks))
    out.setFormatter(logging.Formatter(PLAIN))
    err = StdStreamHandler("stderr")
    err.setLevel(logging.WARNING)
    err.setFormatter(_RankFormatter(WARN_FORMAT, rank))
    handlers = [out, err]
    if log_file:
        f = logging.FileHandler(log_file, encoding="utf-8")
        f.setFormatter(_RankFormatter(FILE_FORMAT, rank))
        handlers.append(f)
    for h in handlers:
        h._draftling = True
    return handlers


def setup_logging(
    level: int | str = logging.INFO, rank: int | None = None, log_file: str | None = None, all_ranks: bool | None = None
) -> logging.Logger:
    """(Re)configure the ``draftling`` logger: its level, the rank filter (``rank=None``: from the
    environment at each record; ``all_ranks``: info lines from every rank, default from
    ``DRAFTLING_LOG_ALL_RANKS``) and a file handler when ``log_file`` (default
    ``DRAFTLING_LOG_FILE``) is given. Calling it again replaces what an earlier call set up."""
    logger = logging.getLogger(PACKAGE)
    for h in [h for h in logger.handlers if _ours(h)]:
        logger.removeHandler(h)
        h.close()
    logger.setLevel(level)
    for h in _handlers(rank, all_ranks, log_file or os.environ.get(LOG_FILE_ENV) or None):
        logger.addHandler(h)
    return logger


def install_default() -> None:
    """The terminal handlers at info level, unless draftling's logger has them already."""
    logger = logging.getLogger(PACKAGE)
    if not any(_ours(h) for h in logger.handlers):
        logger.setLevel(logging.INFO)
        for h in _handlers(None, None, None):
            logger.addHandler(h)
