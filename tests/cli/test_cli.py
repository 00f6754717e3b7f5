"""The `draftling` command end to end on a tiny random target that has SmolLM2's real
tokenizer and chat template, plus the one-line errors for bad input."""

import json

import pytest
import torch

from draftling.cli import main
from tests.conftest import run_draftling
from tests.helpers import write_prompts


def test_every_subcommand_has_help():
    from draftling.cli import MODULES

    for cmd in MODULES:
        r = run_draftling(cmd, "--help")
        assert r.returncode == 0 and "usage: draftling " + cmd in r.stdout
        assert len(r.stdout) > 300  # explains, not just lists flags


def test_pipeline_through_the_cli(tmp_path, tiny_target_dir, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    data, run, export = tmp_path / "data", tmp_path / "run", tmp_path / "export"
    common = ["--target", str(tiny_target_dir), "--device", "cpu"]
    assert (
        main(
            [
                "data",
                *common,
                "--out",
                str(data),
                "--prompts",
                str(prompts),
                "data.regen.max_new_tokens=12",
                "data.val_fraction=0.25",
                "data.min_tokens=4",
            ]
        )
        == 0
    )
    replies = [json.loads(l) for l in (data / "replies.jsonl").read_text().splitlines()]
    assert len(replies) == 12 and all(r["provenance"]["stopped"] in ("eos", "length") for r in replies)
    assert all(r["provenance"]["max_new_tokens"] == 12 for r in replies)
    train_ids = {json.loads(l)["id"] for l in (data / "train.jsonl").read_text().splitlines()}
    val_ids = {json.loads(l)["id"] for l in (data / "val.jsonl").read_text().splitlines()}
    assert train_ids and val_ids and not train_ids & val_ids

    # The prompt token counts for the draft vocab cover every prompt but validation's.
    from draftling.data.prompt_counts import FILE_NAME, count_prompt_tokens, read_prompt_counts
    from draftling.data.prompts import load_conversations
    from draftling.draft.vocab import load_vocab
    from draftling.target.load import load_target_tokenizer

    tok = load_target_tokenizer(str(tiny_target_dir)).tokenizer
    split = {r["id"]: r["split"] for r in replies}
    train_convs = [c for c in load_conversations(prompts) if split[c.id] == "train"]
    counts = read_prompt_counts(data / FILE_NAME, len(tok))
    assert torch.equal(counts, count_prompt_tokens(tok, train_convs, len(tok)))
    assert counts.sum() < count_prompt_tokens(tok, load_conversations(prompts), len(tok)).sum()
    prompt_tokens = counts.nonzero().flatten()
    assert (
        main(
            [
                "vocab",
                "--data",
                str(data),
                "--size",
                "256",
                "--target",
                str(tiny_target_dir),
                "--prompt-weight",
                "1",
                "--out",
                str(tmp_path / "weighted.safetensors"),
            ]
        )
        == 0
    )
    assert load_vocab(tmp_path / "weighted.safetensors").t2d[prompt_tokens].all()

    assert main(["vocab", "--data", str(data), "--size", "256", "--target", str(tiny_target_dir)]) == 0
    assert not load_vocab(data / "vocab.safetensors").t2d[prompt_tokens].all()  # replies alone miss some
    assert (
        main(
            [
                "train",
                *common,
                "--data",
                str(data),
                "--run-dir",
                str(run),
                "train.max_steps=3",
                "train.batch_size=2",
                "train.ttt_steps=2",
                "train.log_every=1",
            ]
        )
        == 0
    )
    assert (run / "draft" / "draft.safetensors").is_file() and (run / "config.yaml").is_file()
    assert (
        main(
            [
                "bench",
                *common,
                "--draft",
                str(run / "draft"),
                "--prompts",
                str(data / "val.jsonl"),
                "--num-prompts",
                "2",
                "--max-new-tokens",
                "8",
                "--out",
                str(tmp_path / "bench.json"),
            ]
        )
        == 0
    )
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["configs"][0]["identical_to_greedy"] == 1.0 and bench["configs"][0]["tau"] >= 1.0
    assert bench["sampling"] is None
    # Sampled: the engine's processed distribution gets the flags, identity is not claimed,
    # and the same seed gives the same run.
    from draftling.engine import accept as generate

    seen = []
    real = generate.process_logits

    def spy(logits, temperature, top_k=0, top_p=1.0):
        seen.append((temperature, top_k, top_p))
        return real(logits, temperature, top_k, top_p)

    sampled = []
    for k in range(2):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(generate, "process_logits", spy)
            assert (
                main(
                    [
                        "bench",
                        *common,
                        "--draft",
                        str(run / "draft"),
                        "--prompts",
                        str(data / "val.jsonl"),
                        "--num-prompts",
                        "2",
                        "--max-new-tokens",
                        "8",
                        "--temperature",
                        "0.8",
                        "--top-k",
                        "50",
                        "--top-p",
                        "0.9",
                        "--out",
                        str(tmp_path / f"s{k}.json"),
                    ]
                )
                == 0
            )
        sampled.append(json.loads((tmp_path / f"s{k}.json").read_text()))
    assert seen and set(seen) == {(0.8, 50, 0.9)}
    assert sampled[0]["sampling"] == {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 0}
    assert sampled[0]["configs"][0]["identical_to_greedy"] is None
    assert any(c.startswith("sampled:") for c in sampled[0]["caveats"])
    assert [r["chain-3-1-4"]["tau"] for r in sampled[0]["per_prompt"]] == [
        r["chain-3-1-4"]["tau"] for r in sampled[1]["per_prompt"]
    ]
    earlier = capsys.readouterr().out
    assert main(["bench", *common, "--draft", str(run / "draft"), "--release", "--temperature", "0.8"]) == 2
    assert "--temperature do not apply" in capsys.readouterr().err
    assert main(["export", "--draft", str(run / "draft"), "--out", str(export)]) == 0
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    out = earlier + capsys.readouterr().out
    assert "sim_tau" in out and "chain-3-1-4" in out
    # Without a TTY the bench logs one progress line per prompt.
    assert "bench: 1/2 prompts" in out and "bench: 2/2 prompts" in out


def run_cli(*args):
    return run_draftling(*args)


@pytest.mark.parametrize(
    "content,expect",
    [
        ('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n{"id": "b", "messages": [\n', "bad.jsonl:2"),
        ('{"id": "a", "messages": [{"role": "robot", "content": "hi"}]}\n', "unknown role"),
        ('{"id": "a", "messages": [{"role": "system", "content": "hi"}]}\n', "no user turn"),
    ],
)
def test_bad_prompt_file_is_one_line_error_and_writes_nothing(tmp_path, tiny_target_dir, content, expect):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    out = tmp_path / "out"
    r = run_cli("data", "--target", str(tiny_target_dir), "--device", "cpu", "--out", str(out), "--prompts", str(bad))
    assert r.returncode == 2
    err = [l for l in r.stderr.splitlines() if l.startswith("draftling: error:")]
    assert len(err) == 1 and "bad.jsonl" in err[0] and expect in err[0]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("command", ["data", "quickstart"])
def test_missing_prompt_file_is_reported_before_anything_is_written(tmp_path, tiny_target_dir, command):
    out = tmp_path / "out"
    r = run_cli(
        command,
        "--target",
        str(tiny_target_dir),
        "--device",
        "cpu",
        "--out",
        str(out),
        f"data.prompts=[{tmp_path / 'missing.jsonl'}]",
    )
    assert r.returncode == 2
    err = [l for l in r.stderr.splitlines() if l.startswith("draftling: error:")]
    assert len(err) == 1 and "missing.jsonl" in err[0] and "no such prompt file" in err[0], r.stderr
    assert not out.exists()
    assert "loading target" not in r.stdout + r.stderr  # checked before the target loads (info lines: stdout)


def test_target_without_chat_template(tmp_path, tiny_target_dir):
    import shutil

    plain = tmp_path / "no-template"
    shutil.copytree(tiny_target_dir, plain)
    for f in plain.glob("chat_template*"):
        f.unlink()
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = run_cli(
        "data",
        "--target",
        str(plain),
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "o"),
        "--prompts",
        str(write_prompts(tmp_path / "p.jsonl", 2)),
    )
    assert r.returncode == 2 and "has no chat template" in r.stderr
    assert not (tmp_path / "o" / "train.jsonl").exists()


def test_bad_layer_id_and_oversized_vocab(tmp_path, tiny_target_dir):
    r = run_cli(
        "data",
        "--target",
        str(tiny_target_dir),
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "o"),
        "--prompts",
        str(write_prompts(tmp_path / "p.jsonl", 2)),
        "aux_layer_ids=[2,3,9]",
    )
    assert r.returncode == 2 and "layer id 9 out of range" in r.stderr
    data = tmp_path / "d"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]}) + "\n")
    r = run_cli("vocab", "--data", str(data), "--size", "10000000", "--target", str(tiny_target_dir))
    assert r.returncode == 2 and "larger than the target vocab" in r.stderr
    assert not (data / "vocab.safetensors").exists()


def test_unknown_config_field(tmp_path):
    r = run_cli("train", "--data", str(tmp_path), "--run-dir", str(tmp_path / "r"), "train.lrr=1")
    assert r.returncode == 2 and "unknown field" in r.stderr and "lrr" in r.stderr


def test_on_and_off_are_strings_and_only_true_false_are_booleans(tmp_path):
    """YAML 1.2 booleans, in overrides and files: `data.regen.engine=off` is the string it says
    (PyYAML's 1.1 rules made it False, and the config refused it); a bool field still takes
    on/off and yes/no."""
    from draftling.config import load_config
    from draftling.errors import ConfigError

    cfg = load_config(None, ["data.regen.engine=off", "train.compile=true"])
    assert cfg.data.regen.engine == "off" and cfg.train.compile is True
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  regen:\n    engine: on\ntrain:\n  compile: False\n")
    cfg = load_config(str(path))
    assert cfg.data.regen.engine == "on" and cfg.train.compile is False
    assert load_config(None, ["train.compile=yes"]).train.compile is True
    assert load_config(None, ["train.compile=Off"]).train.compile is False
    with pytest.raises(ConfigError, match="expected true/false or auto, got 'maybe'"):
        load_config(None, ["train.compile=maybe"])


def test_bad_sampling_settings_are_refused_from_yaml_and_flags(tmp_path):
    from draftling.config import load_config
    from draftling.errors import ConfigError

    with pytest.raises(ConfigError, match="top_p 0.0 in"):
        load_config(None, ["bench.top_p=0"])
    r = run_cli(
        "bench", "--draft", str(tmp_path), "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--temperature", "-1"
    )
    assert r.returncode == 2 and "temperature -1.0 must be >= 0" in r.stderr


def test_bench_prompts_follow_the_mix_of_sources():
    from draftling.bench.simple import sample_by_source

    rows = [("a1", "a", [1]), ("a2", "a", [1]), ("a3", "a", [1]), ("b1", "b", [1]), ("c1", "c", [1])]
    assert [r[0] for r in sample_by_source(rows, 5)] == ["a1", "b1", "c1", "a2", "a3"]
    assert [r[0] for r in sample_by_source(rows, 10)] == ["a1", "b1", "c1", "a2", "a3"]
    # 6 of a, 2 of b, 1 of c: 4 prompts are 6*4/9 = 2.67 -> 3 of a, 0.89 -> 1 of b, 0.44 -> 0 of c.
    rows = [(f"a{i}", "a", [1]) for i in range(6)] + [("b0", "b", [1]), ("b1", "b", [1]), ("c0", "c", [1])]
    assert [r[0] for r in sample_by_source(rows, 4)] == ["a0", "b0", "a1", "a2"]
    # The validation split's sources of the e2d856f quickstart (2026-12-01, cpu-xeon-2core), 8 prompts.
    counts = {"gsm8k": 14, "mbpp": 12, "alpaca": 11, "sharegpt": 9, "selfinstruct": 4, "oasst": 3}
    rows = [(f"{s}{i}", s, [1]) for s, k in counts.items() for i in range(k)]
    picked = [r[1] for r in sample_by_source(rows, 8)]
    assert {s: picked.count(s) for s in counts} == {
        "gsm8k": 2,
        "mbpp": 2,
        "alpaca": 2,
        "sharegpt": 1,
        "selfinstruct": 1,
        "oasst": 0,
    }
