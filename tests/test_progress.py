"""Progress: a bar on a terminal, the caller's status lines without one, nothing when disabled."""

import io
import re

import pytest

from draftling.progress import Progress, duration


class _Stderr(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_without_a_terminal_prints_the_given_lines(monkeypatch, capsys):
    monkeypatch.setattr("sys.stderr", _Stderr(tty=False))
    with Progress(3, "stage") as bar:
        bar.update(1, "stage: 1/3")
        bar.update(1)  # no line: nothing printed
        bar.update(1, "stage: 3/3")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["stage: 1/3", "stage: 3/3"]


def test_disabled_prints_nothing(monkeypatch, capsys):
    monkeypatch.setattr("sys.stderr", _Stderr(tty=False))
    with Progress(2, "stage", enabled=False) as bar:
        bar.update(2, "stage: 2/2")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("enabled", [True, False])
def test_on_a_terminal_draws_a_bar_and_no_lines(monkeypatch, capsys, enabled):
    err = _Stderr(tty=True)
    monkeypatch.setattr("sys.stderr", err)
    with Progress(4, "stage", enabled=enabled) as bar:
        bar.update(4, "stage: 4/4")
    assert capsys.readouterr().out == ""
    drawn = err.getvalue()
    assert ("stage" in drawn and "4/4" in drawn) if enabled else drawn == ""


def test_without_a_terminal_lines_say_elapsed_and_time_left(monkeypatch, capsys):
    """The rate is measured: 2 of 6 units in 20 s leaves 4 units, ~40 s."""
    monkeypatch.setattr("sys.stderr", _Stderr(tty=False))
    clock = iter([100.0, 120.0, 180.0])
    monkeypatch.setattr("draftling.progress.time.perf_counter", lambda: next(clock))
    with Progress(6, "stage") as bar:
        bar.update(2, "stage: 2/6")
        bar.update(4, "stage: 6/6")
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["stage: 2/6 | elapsed 20s, ~40s left", "stage: 6/6 | elapsed 1m20s, ~0s left"]


def test_skipped_units_do_not_count_in_the_rate(monkeypatch, capsys):
    """A resumed stage: 90 units found done take no time; 1 unit in 60 s leaves 9, ~9 min."""
    monkeypatch.setattr("sys.stderr", _Stderr(tty=False))
    clock = iter([0.0, 60.0])
    monkeypatch.setattr("draftling.progress.time.perf_counter", lambda: next(clock))
    lines = []
    bar = Progress(100, "stage", emit=lines.append)
    bar.skip(90)
    bar.update(1, "stage: 91/100")
    assert lines == ["stage: 91/100 | elapsed 1m00s, ~9m00s left"]


def test_resumed_start_and_a_changed_total(monkeypatch):
    clock = iter([0.0, 10.0])
    monkeypatch.setattr("draftling.progress.time.perf_counter", lambda: next(clock))
    bar = Progress(100, "stage", enabled=False, initial=50)
    bar.update(10)
    bar.set_total(80)
    assert re.fullmatch(r"elapsed 10s, ~20s left", bar.timing())


def test_lines_on_a_terminal_when_asked(monkeypatch):
    err = _Stderr(tty=True)
    monkeypatch.setattr("sys.stderr", err)
    lines = []
    with Progress(2, "stage", emit=lines.append, bar=False) as bar:
        bar.update(2, "stage: 2/2")
    assert err.getvalue() == "" and lines[0].startswith("stage: 2/2 | elapsed ")


@pytest.mark.parametrize(
    "seconds, text", [(0, "0s"), (59.4, "59s"), (190, "3m10s"), (3720, "1h02m"), (90000, "25h00m")]
)
def test_duration(seconds, text):
    assert duration(seconds) == text
