"""Outputs never destroy what draftling did not write, and respect the umask."""

import os

import pytest

from draftling.draft.store import save_draft
from draftling.errors import DraftlingError
from draftling.export.cli import export_draft
from draftling.io import OUTPUT_MARKER, atomic_dir, write_json
from tests.helpers import random_export_draft as make_draft
from tests.helpers import tiny_export_llama


@pytest.fixture
def draft_dir(tmp_path):
    path = tmp_path / "draft"
    path.mkdir()
    save_draft(make_draft(tiny_export_llama()), path)
    return path


def test_export_refuses_a_directory_it_did_not_write_and_changes_nothing(tmp_path, draft_dir):
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    with pytest.raises(DraftlingError, match="not written by draftling"):
        export_draft(draft_dir, out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "x"]  # no temporaries beside it


def test_export_refuses_a_file_as_its_directory(tmp_path, draft_dir):
    out = tmp_path / "file"
    out.write_text("mine")
    with pytest.raises(DraftlingError, match="is a file"):
        export_draft(draft_dir, out)
    assert out.read_text() == "mine" and not (tmp_path / ".file.old").exists()


def test_replacing_an_export_takes_overwrite_and_keeps_other_files(tmp_path, draft_dir):
    out = tmp_path / "e"
    out.mkdir()  # an empty directory is fine
    export_draft(draft_dir, out)
    own = sorted(p.name for p in out.iterdir())
    assert OUTPUT_MARKER in own and "config.json" in own and "model.safetensors" in own
    (out / "NOTES.md").write_text("the user's")
    with pytest.raises(DraftlingError, match="--overwrite"):
        export_draft(draft_dir, out)
    before = (out / "model.safetensors").stat().st_mtime_ns
    export_draft(draft_dir, out, overwrite=True)
    assert (out / "NOTES.md").read_text() == "the user's"
    assert sorted(p.name for p in out.iterdir()) == sorted(own + ["NOTES.md"])
    assert (out / "model.safetensors").stat().st_mtime_ns >= before


def test_export_cli_refuses_before_loading_anything(tmp_path, draft_dir, capsys):
    from draftling.cli import main

    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    assert main(["export", "--draft", str(draft_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not written by draftling" in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("mask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_outputs_follow_the_umask(tmp_path, mask, file_mode, dir_mode):
    old = os.umask(mask)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        with atomic_dir(tmp_path / "d") as tmp:
            write_json(tmp / "b.json", {})
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == file_mode
    assert (tmp_path / "d").stat().st_mode & 0o777 == dir_mode
    assert (tmp_path / "d" / "b.json").stat().st_mode & 0o777 == file_mode


def _data(tiny_target_dir, prompts, out):
    from draftling.cli import main

    return main(
        [
            "data",
            "--target",
            str(tiny_target_dir),
            "--device",
            "cpu",
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "data.regen.max_new_tokens=6",
            "data.val_fraction=0.25",
            "data.min_tokens=4",
        ]
    )


def test_a_failed_data_rerun_leaves_the_earlier_data_whole(tmp_path, tiny_target_dir, monkeypatch, capsys):
    from draftling.data import prepare
    from tests.helpers import write_prompts

    prompts, out = write_prompts(tmp_path / "p.jsonl"), tmp_path / "data"
    assert _data(tiny_target_dir, prompts, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"train.jsonl", "val.jsonl", "summary.json", OUTPUT_MARKER} <= set(before)
    real = prepare.write_jsonl

    def dies_at_val(path, rows):  # a kill or a full disk between the two splits
        if path.name == "val.jsonl":
            raise OSError(28, "No space left on device")
        return real(path, rows)

    monkeypatch.setattr(prepare, "write_jsonl", dies_at_val)
    assert _data(tiny_target_dir, write_prompts(tmp_path / "p2.jsonl", n=16), out) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # Only the reply journal is left beside it, so a rerun does not regenerate again.
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [".data.journal"]
    monkeypatch.setattr(prepare, "write_jsonl", real)
    assert _data(tiny_target_dir, write_prompts(tmp_path / "p2.jsonl", n=16), out) == 0
    assert "resuming with 16 replies" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_data_refuses_a_directory_that_is_not_its_own(tmp_path, tiny_target_dir, capsys):
    from tests.helpers import write_prompts

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    assert _data(tiny_target_dir, write_prompts(tmp_path / "p.jsonl"), out) == 2
    assert "not a draftling data directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_quickstart_and_extract_refuse_a_directory_they_did_not_write(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    from draftling.cli import main

    assert main(["quickstart", "--out", str(mine)]) == 2
    assert "not written by draftling" in capsys.readouterr().err
    assert main(["extract", "--data", str(tmp_path), "--out", str(mine)]) == 2
    assert "not a cache written by `draftling extract`" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_release_results_of_the_same_day_machine_and_tag_are_not_replaced(tmp_path):
    from draftling.bench.release_options import check_results_free
    from draftling.errors import ConfigError

    stem = tmp_path / "2026-12-02-cpu-x"
    check_results_free(stem, overwrite=False)
    stem.with_name(stem.name + ".json").write_text("{}")
    with pytest.raises(ConfigError, match="results of this date, machine and tag exist; pass --tag"):
        check_results_free(stem, overwrite=False)
    check_results_free(stem, overwrite=True)
    with pytest.raises(ConfigError, match="is a file"):
        check_results_free(stem.with_name(stem.name + ".json") / "x", overwrite=False)
