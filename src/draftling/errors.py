"""One exception type for bad user input, so the CLI can print it as a single line."""


class DraftlingError(Exception):
    """A user-facing error. The message names the file, line or field at fault."""


class DataError(DraftlingError):
    """Bad input data: a prompt file, a prepared dataset, a vocab mapping."""


class ConfigError(DraftlingError):
    """A bad config field or CLI override."""


class TargetError(DraftlingError):
    """A target model that cannot be used as asked (no chat template, bad layer id, ...)."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one short line: its type and its message with the line breaks folded."""
    text = " ".join(str(e).split())[:limit]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
