"""Progress: a bar on a terminal, the caller's status lines without one, nothing when disabled."""

import io

import pytest

from draftling.progress import Progress


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
    assert capsys.readouterr().out.splitlines() == ["stage: 1/3", "stage: 3/3"]


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
