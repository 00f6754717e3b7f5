"""logs.py: status lines to stdout as plain text, warnings to stderr, info from rank 0 only under
torchrun, and an optional log file."""

import logging

import pytest

from draftling.logs import ALL_RANKS_ENV, RankZeroFilter, setup_logging

log = logging.getLogger("draftling.test_logs")


@pytest.fixture(autouse=True)
def default_logging(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", ALL_RANKS_ENV, "DRAFTLING_LOG_FILE"):
        monkeypatch.delenv(key, raising=False)
    setup_logging()
    yield
    setup_logging()


def test_info_is_the_plain_line_on_stdout_and_warnings_go_to_stderr(capsys):
    log.info("data: 3 prompts")
    log.debug("not at info level")
    log.warning("something odd")
    out, err = capsys.readouterr()
    assert out == "data: 3 prompts\n"
    assert err == "WARNING draftling.test_logs: something odd\n"


def test_other_ranks_keep_info_to_themselves_but_warn(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    log.info("step 1/10 loss 2.0")
    log.warning("rank-local trouble")
    out, err = capsys.readouterr()
    assert out == "" and err == "[rank 1] WARNING draftling.test_logs: rank-local trouble\n"
    monkeypatch.setenv(ALL_RANKS_ENV, "1")  # asked for every rank's lines
    log.info("step 2/10")
    assert capsys.readouterr().out == "step 2/10\n"


def test_rank_from_local_rank_and_explicit():
    record = logging.LogRecord("draftling", logging.INFO, __file__, 1, "x", None, None)
    warning = logging.LogRecord("draftling", logging.WARNING, __file__, 1, "x", None, None)
    assert RankZeroFilter(rank=0).filter(record)
    assert not RankZeroFilter(rank=2).filter(record) and RankZeroFilter(rank=2).filter(warning)
    assert RankZeroFilter(rank=2, all_ranks=True).filter(record)


def test_setup_again_replaces_and_a_log_file_takes_every_line(tmp_path, capsys):
    path = tmp_path / "run.log"
    setup_logging(logging.DEBUG, log_file=str(path))
    setup_logging(logging.DEBUG, log_file=str(path))  # no second set of handlers
    log.info("once")
    log.debug("details")
    assert capsys.readouterr().out == "once\ndetails\n"
    setup_logging()  # closes the file
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and lines[0].endswith("INFO draftling.test_logs: once")
    assert lines[1].endswith("DEBUG draftling.test_logs: details")


def test_the_cli_takes_a_log_file_flag(tmp_path, capsys):
    from draftling.cli import main

    path = tmp_path / "cli.log"
    assert main(["--log-file", str(path), "report", str(tmp_path / "no-run")]) == 2
    capsys.readouterr()
    log.info("after main")
    assert "after main" in path.read_text()


def test_progress_lines_go_through_the_logger(caplog, capsys, monkeypatch):
    import io

    from draftling.progress import Progress

    monkeypatch.setattr("sys.stderr", io.StringIO())  # no terminal: lines, not a bar
    with caplog.at_level(logging.INFO, logger="draftling"), Progress(2, "stage") as bar:
        bar.update(2, "stage: 2/2")
    assert [r.name for r in caplog.records] == ["draftling.progress"]
    assert capsys.readouterr().out.startswith("stage: 2/2 | elapsed ")
