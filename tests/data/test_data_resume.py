"""`draftling data` resumes from its reply journal: a rerun after a failure skips the batches
that were done and writes exactly the files an uninterrupted run writes."""

import errno
import json

import pytest
import torch

from draftling.cli import main
from draftling.data.journal import ReplyJournal, journal_path
from draftling.data.runs import check_one_run
from draftling.errors import DataError
from tests.helpers import read_files as _files
from tests.helpers import write_prompts


def _data(target, prompts, out, *extra):
    return main(
        [
            "data",
            "--target",
            str(target),
            "--device",
            "cpu",
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "data.regen.max_new_tokens=6",
            "data.regen.batch_size=4",
            "data.val_fraction=0.25",
            "data.min_tokens=4",
            *extra,
        ]
    )


def _disk_full_at_batch(monkeypatch, batch: int = 3):
    """The disk fills while the ``batch``-th batch is journaled. Returns the real ``add``."""
    real, calls = ReplyJournal.add, []

    def full_at(self, records):
        calls.append(len(records))
        if len(calls) == batch:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real(self, records)

    monkeypatch.setattr(ReplyJournal, "add", full_at)
    return real


@pytest.mark.parametrize(
    "extra",
    [[], ["data.keep_teacher_states=true"], ["data.regen.temperature=0.8", "data.keep_teacher_states=true"]],
    ids=["greedy", "kept-states", "sampled"],
)
def test_a_rerun_after_a_full_disk_equals_an_uninterrupted_run(tmp_path, tiny_target_dir, monkeypatch, capsys, extra):
    prompts = write_prompts(tmp_path / "p.jsonl", n=16)
    assert _data(tiny_target_dir, prompts, tmp_path / "whole", *extra) == 0
    real = _disk_full_at_batch(monkeypatch)
    out = tmp_path / "resumed"
    assert _data(tiny_target_dir, prompts, out, *extra) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and err.count("\n") == 1
    assert not out.exists() and journal_path(out).is_dir()
    monkeypatch.setattr(ReplyJournal, "add", real)
    assert _data(tiny_target_dir, prompts, out, *extra) == 0
    assert "resuming with 8 replies" in capsys.readouterr().out
    assert _files(out) == _files(tmp_path / "whole")
    assert not journal_path(out).exists()


def test_a_target_moved_to_another_folder_resumes_its_journal(tmp_path, tiny_target_dir, monkeypatch, capsys):
    import shutil

    prompts = write_prompts(tmp_path / "p.jsonl", n=16)
    real = _disk_full_at_batch(monkeypatch)
    out = tmp_path / "d"
    assert _data(tiny_target_dir, prompts, out) == 2
    monkeypatch.setattr(ReplyJournal, "add", real)
    moved = shutil.copytree(tiny_target_dir, tmp_path / "elsewhere" / tiny_target_dir.name)
    capsys.readouterr()
    assert _data(moved, prompts, out) == 0
    assert "resuming with 8 replies" in capsys.readouterr().out


def test_more_samples_per_prompt_resume_the_replies_already_written(tmp_path, tiny_target_dir, monkeypatch, capsys):
    """A run killed after its greedy pass and one sampled batch, rerun with one more sample per
    prompt, resumes those replies and writes what an uninterrupted run of the new count writes."""
    prompts = write_prompts(tmp_path / "p.jsonl", n=16)
    sampled = ["data.regen.sample_temperature=1.0", "data.regen.samples_per_prompt"]
    assert _data(tiny_target_dir, prompts, tmp_path / "whole", sampled[0], f"{sampled[1]}=3") == 0
    real = _disk_full_at_batch(monkeypatch, batch=6)  # 4 batches of 4 greedy, 1 sampled
    out = tmp_path / "d"
    assert _data(tiny_target_dir, prompts, out, sampled[0], f"{sampled[1]}=2") == 2
    monkeypatch.setattr(ReplyJournal, "add", real)
    capsys.readouterr()
    assert _data(tiny_target_dir, prompts, out, sampled[0], f"{sampled[1]}=3") == 0
    assert "resuming with 20 replies" in capsys.readouterr().out
    assert _files(out) == _files(tmp_path / "whole")


def test_a_line_cut_short_is_dropped_and_other_settings_start_over(tmp_path, tiny_target_dir, capsys):
    path = tmp_path / ".data.journal"
    j = ReplyJournal(path, {"a": 1})
    j.add([{"id": "x", "v": 1}, {"id": "y", "v": 2}])
    with open(path / "replies.jsonl", "a") as f:
        f.write('{"id": "z", "v"')  # a kill mid-line
    j = ReplyJournal(path, {"a": 1})
    assert sorted(j.records) == ["x", "y"] and j.get("y") == {"id": "y", "v": 2}
    j.add([{"id": "z", "v": 3}])
    assert sorted(ReplyJournal(path, {"a": 1}).records) == ["x", "y", "z"]
    assert ReplyJournal(path, {"a": 2}).records == {}
    assert "other settings; starting over" in capsys.readouterr().out


def test_later_stages_refuse_files_of_two_data_runs(tmp_path, tiny_target_dir, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _data(tiny_target_dir, write_prompts(tmp_path / "p.jsonl", n=12), a) == 0
    assert _data(tiny_target_dir, write_prompts(tmp_path / "q.jsonl", n=16), b) == 0
    summary = json.loads((a / "summary.json").read_text())
    rows = [json.loads(line) for line in (a / "train.jsonl").read_text().splitlines()]
    assert {r["run"] for r in rows} == {summary["run"]}
    check_one_run(a / "train.jsonl", a / "val.jsonl", a / "prompt_token_counts.safetensors")
    (a / "val.jsonl").write_bytes((b / "val.jsonl").read_bytes())  # a mix, as a killed rerun once left
    with pytest.raises(DataError, match="val.jsonl from run"):
        check_one_run(a / "train.jsonl", a / "val.jsonl")
    common = ["--target", str(tiny_target_dir), "--device", "cpu"]
    for argv in (
        ["vocab", "--data", str(a), "--target", str(tiny_target_dir)],
        ["extract", *common, "--data", str(a), "--out", str(tmp_path / "cache")],
        ["train", *common, "--data", str(a), "--run-dir", str(tmp_path / "run")],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "different `draftling data` runs" in err and err.count("\n") == 1, argv
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_a_timed_dtype_probe_is_decided_once_per_journal(tmp_path, tiny_target_dir, monkeypatch, capsys):
    """bfloat16_if_fast is a timed probe; a rerun on a busy machine must not mix dtypes."""
    from draftling import hardware

    prompts = write_prompts(tmp_path / "p.jsonl", n=16)
    monkeypatch.setattr(hardware, "bf16_matmul_is_faster", lambda device_type="cpu": True)
    real, calls = ReplyJournal.add, []

    def full_after_one(self, records):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real(self, records)

    monkeypatch.setattr(ReplyJournal, "add", full_after_one)
    out = tmp_path / "d"
    assert _data(tiny_target_dir, prompts, out, "data.regen.dtype=bfloat16_if_fast") == 2
    monkeypatch.setattr(ReplyJournal, "add", real)
    monkeypatch.setattr(hardware, "bf16_matmul_is_faster", lambda device_type="cpu": False)  # now "slow"
    assert _data(tiny_target_dir, prompts, out, "data.regen.dtype=bfloat16_if_fast") == 0
    replies = [json.loads(line) for line in (out / "replies.jsonl").read_text().splitlines()]
    assert {r["provenance"]["dtype"] for r in replies if r["split"] == "train"} == {"bfloat16"}


def test_a_rerun_takes_the_journals_cpu_weight_layout_not_its_own_timing(tmp_path, monkeypatch, tiny_target):
    """The two CPU weight layouts round differently (F.linear's bits differ), and the layout is a
    timed pick a busy machine may answer otherwise: a data rerun lays the target out as the
    journal's first run did."""
    from draftling import hardware
    from draftling.data.replies import pin_journal_cpu_layout

    monkeypatch.setattr(hardware, "_PINNED_LAYOUT", {})
    target = tiny_target
    linears = [
        m
        for m in target.model.modules()
        if isinstance(m, torch.nn.Linear) and m is not target.model.get_output_embeddings()
    ]
    measured = hardware.column_major_linear_is_faster(torch.float32)
    first = ReplyJournal(tmp_path / ".data.journal", {"a": 1})
    pin_journal_cpu_layout(target, first, {torch.float32})
    first.add([{"id": "x", "v": 1}])  # the pick is written with the first reply
    assert all(m.weight.is_contiguous() != measured for m in linears)
    hardware._PINNED_LAYOUT.clear()
    monkeypatch.setattr(hardware, "_time_column_major", lambda dtype: not measured)  # a rerun that times otherwise
    pin_journal_cpu_layout(target, ReplyJournal(tmp_path / ".data.journal", {"a": 1}), {torch.float32})
    assert hardware.column_major_linear_is_faster(torch.float32) == measured
    assert all(m.weight.is_contiguous() != measured for m in linears)
    hardware._PINNED_LAYOUT.clear()
    pin_journal_cpu_layout(target, ReplyJournal(tmp_path / ".other.journal", {"a": 1}), {torch.float32})
    assert all(m.weight.is_contiguous() == measured for m in linears)  # a new journal: this process's pick
