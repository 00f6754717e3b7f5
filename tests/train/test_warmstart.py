"""Warm-start (`train --init-from`): from each accepted format, keeping or rebuilding the vocab
map, refusing a head built for another target, never writing the source."""

import hashlib
from pathlib import Path

import numpy
import pytest
import torch
from safetensors.torch import load_file, save_file

from draftling.data.tokenized import load_tokenized
from draftling.draft.store import load_draft
from draftling.draft.vocab import build_vocab_file, load_vocab
from draftling.errors import ConfigError
from draftling.export.formats import export_sglang, load_any_draft
from draftling.export.speculators import export_speculators
from draftling.io import write_jsonl
from draftling.train.trainer import train
from draftling.train.warmstart import InitDraft, coverage, warm_start
from tests.conftest import random_batch, setup_data
from tests.helpers import cfg_for


def base_run(tmp_path, target):
    """A 4-step run: the head every test starts from."""
    setup_data(tmp_path)
    train(
        cfg_for(4),
        target,
        tmp_path / "base",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
    )
    return tmp_path / "base" / "draft"


def files_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def new_data(tmp_path, seed=7):
    """Other data (another seed) and its own 48-token map: the most frequent tokens differ."""
    d = tmp_path / "new"
    d.mkdir()
    rows = random_batch(n=16, t=20, seed=seed)
    write_jsonl(d / "train.jsonl", rows[:12])
    write_jsonl(d / "val.jsonl", rows[12:])
    build_vocab_file(d / "train.jsonl", 300, 48, d / "vocab.safetensors")
    return d


def adapt(tmp_path, target, init, data, name, steps=2):
    return train(
        cfg_for(steps),
        target,
        tmp_path / name,
        data / "train.jsonl",
        data / "val.jsonl",
        data / "vocab.safetensors",
        init=init,
    )


def maps_to_npy(export: Path, t2d_dtype=numpy.bool_) -> None:
    """Move an export's d2t/t2d out of model.safetensors into d2t.npy / t2d.npy beside it."""
    tensors = load_file(export / "model.safetensors")
    numpy.save(export / "d2t.npy", tensors.pop("d2t").numpy())
    numpy.save(export / "t2d.npy", tensors.pop("t2d").numpy().astype(t2d_dtype))
    save_file(tensors, export / "model.safetensors")


@pytest.mark.parametrize("fmt", ["draftling", "sglang", "sglang-npy", "speculators"])
def test_warm_start_from_each_format_keeps_the_heads_weights_and_map(tmp_path, tiny_target, fmt, capsys):
    src = base_run(tmp_path, tiny_target)
    head = load_draft(src)
    if fmt != "draftling":
        out = tmp_path / fmt
        if fmt.startswith("sglang"):
            export_sglang(head, out, trained_on_default_layers=True, dtype="keep", target_config=tiny_target.config)
            if fmt == "sglang-npy":  # the maps as some published heads ship them
                maps_to_npy(out, numpy.uint8)
        else:
            export_speculators(
                head,
                out,
                dtype="keep",
                target_config=tiny_target.config,
                verifier_name_or_path="org/tiny-llama",
                verifier_architectures=["LlamaForCausalLM"],
            )
        src = out
    before = files_digest(src)
    loaded = load_any_draft(src, "cpu", torch.float32)
    data = new_data(tmp_path)
    examples = load_tokenized(data / "train.jsonl")
    warm = warm_start(InitDraft(loaded, str(src)), tiny_target, load_vocab(data / "vocab.safetensors"), examples)
    for name, tensor in head.trainable_state_dict().items():  # training starts from the head as it was
        torch.testing.assert_close(warm.draft.state_dict()[name], tensor, msg=name)
    adapt(tmp_path, tiny_target, InitDraft(loaded, str(src)), data, "adapted", steps=1)
    assert files_digest(src) == before  # the source is only read
    got = load_draft(tmp_path / "adapted" / "draft")
    assert torch.equal(got.d2t, head.d2t) and torch.equal(got.t2d, head.t2d)  # its own map, not the data's
    kept = coverage(head.t2d, examples)
    assert 0 < kept < 1 and f"covering {kept:.3f} of the data's loss tokens" in capsys.readouterr().out


def test_rebuild_vocab_moves_known_rows_and_reinitialises_entering_tokens(tmp_path, tiny_target, capsys):
    src = base_run(tmp_path, tiny_target)
    head = load_draft(src)
    data = new_data(tmp_path)
    vocab = load_vocab(data / "vocab.safetensors")
    init = InitDraft(head, str(src), rebuild_vocab=True)
    got = warm_start(init, tiny_target, vocab, load_tokenized(data / "train.jsonl")).draft
    assert torch.equal(got.t2d, vocab.t2d) and got.lm_head.weight.shape[0] == 48
    old = {int(t): i for i, t in enumerate(head.draft_to_target(torch.arange(head.d2t.numel())))}
    target_head = tiny_target.model.get_output_embeddings().weight
    entered = 0
    for j, t in enumerate(vocab.draft_ids_in_target.tolist()):
        want = head.lm_head.weight[old[t]] if t in old else target_head[t]
        entered += t not in old
        torch.testing.assert_close(got.lm_head.weight[j], want.float())
    assert 0 < entered < 48
    adapt(tmp_path, tiny_target, init, data, "rebuilt", steps=1)
    assert f"{entered} tokens entered" in capsys.readouterr().out
    assert torch.equal(load_draft(tmp_path / "rebuilt" / "draft").t2d, vocab.t2d)
    for name in ("fc.weight", "midlayer.mlp.down_proj.weight", "norm.weight"):
        torch.testing.assert_close(got.state_dict()[name], head.state_dict()[name])


def test_a_head_for_another_target_is_refused_with_the_numbers(tmp_path, tiny_target):
    src = base_run(tmp_path, tiny_target)
    head = load_draft(src)
    head.config.eagle_aux_hidden_state_layer_ids = [0, 1, 2]
    data = new_data(tmp_path)
    with pytest.raises(ConfigError, match=r"aux layers \[0, 1, 2\], the target run uses \[\d+, \d+, \d+\]"):
        adapt(tmp_path, tiny_target, InitDraft(head, "elsewhere"), data, "refused")
    assert not (tmp_path / "refused" / "draft").exists()


def test_adaptation_trains_on_from_the_head(tmp_path, tiny_target):
    src = base_run(tmp_path, tiny_target)
    data = new_data(tmp_path)
    result = adapt(tmp_path, tiny_target, InitDraft(load_draft(src), str(src)), data, "trained", steps=3)
    got = load_file(str(tmp_path / "trained" / "draft" / "draft.safetensors"))
    assert result["steps"] == 3 and not torch.equal(got["fc.weight"], load_draft(src).fc.weight)


def test_selection_candidates_survive_pruning(tmp_path, tiny_target):
    """train.ckpt_every_epoch and train.keep_every_steps keep candidates beside the newest N."""
    from draftling.train.checkpoint import list_checkpoints

    setup_data(tmp_path)  # 12 train rows, batch 4: 3 steps per epoch
    cfg = cfg_for(
        9,
        **{
            "train.ckpt_every": 2,
            "train.keep_checkpoints": 1,
            "train.ckpt_every_epoch": "true",
            "train.keep_every_steps": 4,
        },
    )
    train(
        cfg,
        tiny_target,
        tmp_path / "r",
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
    )
    steps = [int(p.name.split("_")[1]) for p in list_checkpoints(tmp_path / "r")]
    assert steps == [3, 4, 6, 8, 9]  # epoch ends 3, 6, 9; multiples of 4; the newest (9)


@pytest.mark.parametrize(
    "bad, says",
    [
        (lambda d2t, t2d: (d2t[:-1], t2d), "d2t.npy: d2t has shape (63,), expected (64,) from config.json"),
        (lambda d2t, t2d: (d2t.astype(numpy.float32), t2d), "d2t.npy: d2t has dtype float32, expected integer offsets"),
        (lambda d2t, t2d: (d2t, t2d.astype(numpy.float64)), "t2d.npy: t2d has dtype float64, expected bool"),
        (
            lambda d2t, t2d: (d2t + 1000, t2d),
            "(vocab maps from d2t.npy, t2d.npy): d2t maps draft ids outside the target",
        ),
        (lambda d2t, t2d: (numpy.array([{"x": 1}] * 64, dtype=object), t2d), "d2t.npy: not a readable .npy array"),
    ],
)
def test_init_from_refuses_bad_npy_maps_in_one_line(tmp_path, tiny_target, bad, says, capsys):
    from draftling.cli import main

    head = load_draft(base_run(tmp_path, tiny_target))
    out = tmp_path / "npy"
    export_sglang(head, out, trained_on_default_layers=True, dtype="keep", target_config=tiny_target.config)
    maps_to_npy(out)
    d2t, t2d = bad(numpy.load(out / "d2t.npy"), numpy.load(out / "t2d.npy"))
    numpy.save(out / "d2t.npy", d2t, allow_pickle=True)
    numpy.save(out / "t2d.npy", t2d)
    code = main(["train", "--data", str(tmp_path), "--run-dir", str(tmp_path / "run"), "--init-from", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err and not (tmp_path / "run").exists()
