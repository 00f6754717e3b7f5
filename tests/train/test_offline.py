"""Offline mode: extract the teacher to shards once, train from them with the same losses as
online, resume a killed extraction, refuse stale caches, estimate the disk size."""

import json
import re

import pytest
from safetensors.torch import load_file

from draftling.cli import main
from draftling.config import load_config
from draftling.draft.vocab import build_vocab_file, hash_dataset_file, load_vocab
from draftling.errors import DataError
from draftling.io import write_jsonl
from draftling.train import offline
from draftling.train.offline import extract
from draftling.train.offline_teacher import OfflineTeacher
from draftling.train.trainer import train
from tests.conftest import random_batch, setup_data

SHARD = 5  # 12 train rows -> shards of 5, 5, 2; 4 val rows -> 1 shard


def cfg_for(steps, **extra):
    over = [
        f"train.max_steps={steps}",
        "train.batch_size=4",
        "train.ttt_steps=3",
        "train.log_every=1",
        "train.ckpt_every=2",
        "train.warmup_steps=2",
        "train.lr=1e-3",
    ]
    return load_config(None, over + [f"{k}={v}" for k, v in extra.items()])


def teacher_for(data, cache, split="train"):
    vocab = load_vocab(data / "vocab.safetensors")
    return OfflineTeacher(
        cache, split, vocab_hash=vocab.data_hash, data_hash=hash_dataset_file(data / f"{split}.jsonl")
    )


def losses(run_dir):
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["split"], r["step"], r["loss"]) for r in recs]


def split_files(cache, split):
    return sorted(p.name for p in (cache / split).iterdir())


def test_offline_training_matches_online(tmp_path, tiny_target, monkeypatch):
    setup_data(tmp_path)
    cache = tmp_path / "cache"
    extract(tiny_target, tmp_path, cache, shard_size=SHARD, batch_size=3)
    cfg = cfg_for(6, **{"train.val_every": 3})
    train(
        cfg,
        tiny_target,
        tmp_path / "online",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
    )

    def no_teacher(*a, **k):
        raise AssertionError("the offline run must not run the teacher")

    monkeypatch.setattr("draftling.train.batches.teacher_forward", no_teacher)
    train(
        cfg,
        tiny_target,
        tmp_path / "offline",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
        teacher_source=teacher_for(tmp_path, cache),
    )
    on, off = losses(tmp_path / "online"), losses(tmp_path / "offline")
    assert [r[:2] for r in on] == [r[:2] for r in off]
    assert sum(r[0] == "train" for r in on) == 6 and sum(r[0] == "val" for r in on) == 3
    for (split, step, a), (_, _, b) in zip(on, off):
        assert b == pytest.approx(a, rel=1e-4), (split, step)


def test_teacher_batch_equals_online_rows(tmp_path, tiny_target):
    """Row for row, the cached outputs are the online ones (fp32 target: stored losslessly)."""
    from draftling.data.tokenized import load_tokenized
    from draftling.train.dataset import collate
    from draftling.train.teacher import teacher_forward

    setup_data(tmp_path)
    cache = tmp_path / "cache"
    extract(tiny_target, tmp_path, cache, shard_size=SHARD, batch_size=4)
    rows = load_tokenized(tmp_path / "train.jsonl")
    keys = [11, 0, 6, 4]  # across all three shards
    ex = [rows[k] for k in keys]
    lengths = [len(e.input_ids) for e in ex]
    b = collate(ex, 0)
    online = teacher_forward(
        tiny_target, b["input_ids"], b["attention_mask"], load_vocab(tmp_path / "vocab.safetensors").t2d
    )
    got = teacher_for(tmp_path, cache).get(keys, lengths, "cpu")
    assert got.aux.shape == online.aux.shape and got.draft_logits.shape == online.draft_logits.shape
    for i, n in enumerate(lengths):
        assert (got.aux[i, :n] - online.aux[i, :n]).abs().max() < 1e-4
        assert (got.draft_logits[i, :n] - online.draft_logits[i, :n]).abs().max() < 1e-4
        assert (got.target_argmax[i, :n] == online.target_argmax[i, :n]).all()
        assert (got.in_draft[i, :n] == online.in_draft[i, :n]).all()
        assert not got.aux[i, n:].any() and not got.in_draft[i, n:].any()  # zero right-padding
    with pytest.raises(DataError, match="tokens in the cache"):
        teacher_for(tmp_path, cache).get([0], [lengths[1] + 1], "cpu")


def test_compiled_extraction_writes_the_same_shards(tmp_path, tiny_target, monkeypatch):
    """extract(compile_teacher=...) runs the teacher's layers compiled (the CLI turns it on for CUDA)
    and writes the same outputs as the eager teacher."""
    from draftling.train import teacher as teacher_mod

    setup_data(tmp_path)
    seen = []
    real = teacher_mod.compiled_decoder_layers

    def spy(decoder, backend):
        seen.append(backend)
        return real(decoder, backend)

    monkeypatch.setattr(teacher_mod, "compiled_decoder_layers", spy)
    extract(tiny_target, tmp_path, tmp_path / "eager", shard_size=SHARD, batch_size=4)
    assert not seen
    extract(tiny_target, tmp_path, tmp_path / "compiled", shard_size=SHARD, batch_size=4, compile_teacher="aot_eager")
    assert seen and set(seen) == {"aot_eager"}
    for name in split_files(tmp_path / "eager", "train"):
        a = load_file(str(tmp_path / "eager" / "train" / name))
        b = load_file(str(tmp_path / "compiled" / "train" / name))
        assert a.keys() == b.keys()
        for k in a:
            assert (a[k].float() - b[k].float()).abs().max() < 1e-4, (name, k)


def test_extraction_resumes_after_a_kill(tmp_path, tiny_target):
    setup_data(tmp_path)
    cache = tmp_path / "cache"
    first = extract(tiny_target, tmp_path, cache, shard_size=SHARD, batch_size=3)
    assert first["written"] == {"train": [0, 1, 2], "val": [0]}
    names = ["shard_00000.safetensors", "shard_00001.safetensors", "shard_00002.safetensors"]
    assert split_files(cache, "train") == names
    before = {n: (cache / "train" / n).stat().st_mtime_ns for n in names}
    last = load_file(str(cache / "train" / names[2]))

    # Simulate a kill while the last shard was being written: the shard and its completion
    # mark are gone, and a half-written temp file is left behind.
    (cache / "train" / names[2]).unlink()
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["splits"]["train"]["complete"] = [0, 1]
    (cache / "manifest.json").write_text(json.dumps(manifest))
    (cache / "train" / ".shard_00002.safetensors.x1y2.tmp").write_bytes(b"\0" * 100)
    with pytest.raises(DataError, match="incomplete"):
        teacher_for(tmp_path, cache)

    again = extract(tiny_target, tmp_path, cache, shard_size=SHARD, batch_size=3)
    assert again["written"] == {"train": [2], "val": []}
    assert again["skipped"] == {"train": [0, 1], "val": [0]}
    assert split_files(cache, "train") == names  # temp leftover removed, never read as a shard
    for n in names[:2]:
        assert (cache / "train" / n).stat().st_mtime_ns == before[n]
    redone = load_file(str(cache / "train" / names[2]))
    assert redone.keys() == last.keys()
    for k in last:
        assert (redone[k].float() - last[k].float()).abs().max() < 1e-4, k
    assert json.loads((cache / "manifest.json").read_text())["splits"]["train"]["complete"] == [0, 1, 2]


def test_a_resumed_extraction_keeps_the_first_runs_cpu_weight_layout(tmp_path, tiny_target, monkeypatch):
    """The layout is a timed pick, and the two round differently: the manifest keeps the first
    run's, and a resume that would time otherwise lays the teacher out as the first did."""
    import torch

    from draftling import hardware

    monkeypatch.setattr(hardware, "_PINNED_LAYOUT", {})
    setup_data(tmp_path)
    cache = tmp_path / "cache"
    extract(tiny_target, tmp_path, cache, shard_size=SHARD, batch_size=3)
    first = json.loads((cache / "manifest.json").read_text())["cpu_column_major"]
    assert first == {"float32": hardware._time_column_major(torch.float32)}
    hardware._PINNED_LAYOUT.clear()
    monkeypatch.setattr(hardware, "_time_column_major", lambda dtype: not first["float32"])
    (cache / "train" / "shard_00002.safetensors").unlink()
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["splits"]["train"]["complete"] = [0, 1]
    (cache / "manifest.json").write_text(json.dumps(manifest))
    extract(tiny_target, tmp_path, cache, shard_size=SHARD, batch_size=3)
    assert json.loads((cache / "manifest.json").read_text())["cpu_column_major"] == first
    q = tiny_target.model.model.layers[0].self_attn.q_proj.weight
    assert q.is_contiguous() != first["float32"]
    teacher_for(tmp_path, cache)  # complete again


def test_a_crash_mid_shard_leaves_no_shard(tmp_path, tiny_target, monkeypatch):
    setup_data(tmp_path)
    cache = tmp_path / "cache"
    real = offline.teacher_forward
    calls = {"n": 0}

    def dies_on_third_batch(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # shard 0 has 2 batches of 3; shard 1 dies in its first batch
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(offline, "teacher_forward", dies_on_third_batch)
    with pytest.raises(KeyboardInterrupt):
        extract(tiny_target, tmp_path, cache, shard_size=SHARD, batch_size=3)
    assert split_files(cache, "train") == ["shard_00000.safetensors"]  # no partial shard, no temp
    assert json.loads((cache / "manifest.json").read_text())["splits"]["train"]["complete"] == [0]
    monkeypatch.setattr(offline, "teacher_forward", real)
    calls["n"] = 0
    again = extract(tiny_target, tmp_path, cache, shard_size=SHARD, batch_size=3)
    assert again["written"] == {"train": [1, 2], "val": [0]} and again["skipped"]["train"] == [0]


def test_stale_cache_is_refused(tmp_path, tiny_target):
    setup_data(tmp_path)
    cache = tmp_path / "cache"
    extract(tiny_target, tmp_path, cache, shard_size=SHARD)
    # The data changes and the vocab is rebuilt on it: the trainer's vocab check passes, the
    # cache must not.
    write_jsonl(tmp_path / "train.jsonl", random_batch(n=12, t=20, seed=5))
    build_vocab_file(tmp_path / "train.jsonl", 300, 64, tmp_path / "vocab.safetensors")
    with pytest.raises(DataError, match=r"manifest\.json: stale offline cache"):
        teacher_for(tmp_path, cache)
    with pytest.raises(DataError, match=r"manifest\.json"):
        extract(tiny_target, tmp_path, cache, shard_size=SHARD)  # no silent mixing either
    with pytest.raises(DataError, match=r"manifest\.json: stale"):
        OfflineTeacher(cache, "train", data_hash=hash_dataset_file(tmp_path / "train.jsonl"))


def test_disk_estimate_is_printed_and_close(tmp_path, tiny_target, capsys):
    setup_data(tmp_path)
    cache = tmp_path / "cache"
    result = extract(tiny_target, tmp_path, cache, shard_size=SHARD)
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if "estimated disk" in l)
    assert "GiB" in line and "bytes/token" in line and "64 KB/token" in line
    estimate = int(re.search(r"\((\d+) bytes\)", line).group(1))
    actual = sum(p.stat().st_size for p in cache.glob("*/shard_*.safetensors"))
    assert actual == result["bytes"] and estimate == result["estimate_bytes"]
    assert abs(estimate - actual) / actual < 0.2


def test_cli_extract_and_train_offline(tmp_path, tiny_target, monkeypatch, capsys):
    setup_data(tmp_path)
    monkeypatch.setattr("draftling.target.load_target_from_config", lambda cfg, *a, **k: tiny_target)
    with pytest.raises(SystemExit):
        main(["extract", "--help"])
    help_text = capsys.readouterr().out
    assert "usage: draftling extract" in help_text and "--shard-size" in help_text and "resume" in help_text
    cache, run = tmp_path / "cache", tmp_path / "run"
    assert (
        main(["extract", "--data", str(tmp_path), "--out", str(cache), "--shard-size", "4", "--batch-size", "2"]) == 0
    )
    assert split_files(cache, "train") == [f"shard_0000{i}.safetensors" for i in range(3)]
    assert (
        main(
            [
                "train",
                "--data",
                str(tmp_path),
                "--run-dir",
                str(run),
                "--offline",
                str(cache),
                "train.max_steps=2",
                "train.batch_size=4",
                "train.ttt_steps=2",
                "train.log_every=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "offline teacher" in out and (run / "draft" / "draft.safetensors").is_file()
    assert (
        main(
            ["train", "--data", str(tmp_path), "--run-dir", str(tmp_path / "run2"), "--offline", str(tmp_path / "nope")]
        )
        == 2
    )
    assert "no offline teacher cache" in capsys.readouterr().err
