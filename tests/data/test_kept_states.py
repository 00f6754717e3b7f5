"""States kept at regeneration (data.keep_teacher_states) against the teacher recomputing them:
the same teacher outputs, the same training run, and a stale file is refused."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftling.cli import main
from draftling.data.states import StoredStates, states_path
from draftling.data.tokenized import load_tokenized
from draftling.draft.vocab import load_vocab
from draftling.target import load_target
from draftling.train.dataset import collate
from draftling.train.teacher import KeptStatesTeacher, teacher_forward
from tests.helpers import write_prompts

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def kept_data(tmp_path_factory, tiny_target_dir):
    tmp = tmp_path_factory.mktemp("kept")
    prompts = tmp / "prompts.jsonl"
    rows = [
        {
            "id": f"p{i}",
            "source": "test",
            "category": "chat",
            # Different lengths: the batch is left-padded, the states must skip the padding.
            "messages": [{"role": "user", "content": "Tell me about the sea. " * (1 + i % 4)}],
        }
        for i in range(12)
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = tmp / "data"
    assert (
        main(
            [
                "data",
                "--target",
                str(tiny_target_dir),
                "--device",
                "cpu",
                "--out",
                str(data),
                "--prompts",
                str(prompts),
                f"data.regen.max_new_tokens={NEW_TOKENS}",
                "data.regen.batch_size=5",
                "data.val_fraction=0.25",
                "data.min_tokens=4",
                "data.keep_teacher_states=true",
            ]
        )
        == 0
    )
    assert main(["vocab", "--data", str(data), "--size", "256", "--target", str(tiny_target_dir)]) == 0
    return data


def test_kept_states_equal_the_teacher_forward(kept_data, tiny_target_dir):
    target = load_target(str(tiny_target_dir), device="cpu")
    vocab = load_vocab(kept_data / "vocab.safetensors")
    replies = {json.loads(l)["id"]: json.loads(l) for l in (kept_data / "replies.jsonl").read_text().splitlines()}
    for split in ("train", "val"):
        examples = load_tokenized(kept_data / f"{split}.jsonl")
        states = StoredStates(states_path(kept_data, split))
        assert states.matches(kept_data / f"{split}.jsonl", target.aux_layer_ids) is None
        assert states.num_rows == len(examples)
        for ex in examples:
            prov = replies[ex.id]["provenance"]
            # Cut to what the target was fed: the prompt and every generated token but the last.
            fed = prov["reply_tokens"] - (prov["stopped"] == "length")
            assert len(ex.input_ids) == prov["prompt_tokens"] + fed
            assert ex.loss_mask[prov["prompt_tokens"] :] == [1] * fed  # the reply, as generated
            assert sum(ex.loss_mask[: prov["prompt_tokens"]]) == 0  # one user turn: no loss there
        keys = list(range(len(examples)))
        kept = KeptStatesTeacher(target, states, vocab.t2d).get(keys, [len(e.input_ids) for e in examples], "cpu")
        batch = collate(examples, target.tokenizer.pad_token_id)
        fresh = teacher_forward(target, batch["input_ids"], batch["attention_mask"], vocab.t2d)
        real = batch["attention_mask"].bool()
        torch.testing.assert_close(kept.aux[real], fresh.aux[real], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kept.draft_logits[real], fresh.draft_logits[real], atol=1e-4, rtol=1e-4)
        assert torch.equal(kept.target_argmax[real], fresh.target_argmax[real])


def test_training_from_kept_states_matches_recomputing(kept_data, tiny_target_dir, tmp_path, capsys):
    common = [
        "--target",
        str(tiny_target_dir),
        "--device",
        "cpu",
        "train.max_steps=4",
        "train.batch_size=3",
        "train.ttt_steps=2",
        "train.log_every=1",
        "train.max_val_batches=1",
    ]
    assert main(["train", *common, "--data", str(kept_data), "--run-dir", str(tmp_path / "kept")]) == 0
    assert "states kept at regeneration" in capsys.readouterr().out
    # The same data without the states files: the target recomputes them.
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("train.jsonl", "val.jsonl", "vocab.safetensors"):
        (plain / name).write_bytes((kept_data / name).read_bytes())
    assert main(["train", *common, "--data", str(plain), "--run-dir", str(tmp_path / "recomputed")]) == 0
    assert "states kept" not in capsys.readouterr().out
    a = load_file(str(tmp_path / "kept" / "draft" / "draft.safetensors"))
    b = load_file(str(tmp_path / "recomputed" / "draft" / "draft.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3)
    va = json.loads((tmp_path / "kept" / "train_result.json").read_text())["val"]
    vb = json.loads((tmp_path / "recomputed" / "train_result.json").read_text())["val"]
    assert va["acc"] == pytest.approx(vb["acc"], abs=1e-6) and va["loss"] == pytest.approx(vb["loss"], rel=1e-3)


def test_states_of_other_data_are_not_used(kept_data, tiny_target_dir, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "val.jsonl", "vocab.safetensors", states_path(kept_data, "train").name):
        (data / name).write_bytes((kept_data / name).read_bytes())
    # Drop the last row: the jsonl no longer matches the states, whose rows would be shifted.
    lines = (data / "train.jsonl").read_text().splitlines(keepends=True)
    (data / "train.jsonl").write_text("".join(lines[:-1]))
    assert main(["vocab", "--data", str(data), "--size", "256", "--target", str(tiny_target_dir)]) == 0
    assert (
        main(
            [
                "train",
                "--target",
                str(tiny_target_dir),
                "--device",
                "cpu",
                "--data",
                str(data),
                "--run-dir",
                str(tmp_path / "run"),
                "train.max_steps=1",
                "train.batch_size=2",
                "train.ttt_steps=2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "not using teacher_states_train.safetensors (train.jsonl changed" in out


def test_rows_stopped_by_eos_keep_every_reply_token(tiny_target_dir, tmp_path, monkeypatch):
    """A reply cut at the eos was fed whole (only the eos never was); one that hit the cap was
    fed all but its last token. Both rows' states equal a fresh forward over the fed ids."""
    from draftling.config import RegenConfig
    from draftling.data.prompts import load_conversations
    from draftling.data.regen import regenerate
    from draftling.target.aux import aux_hidden_states

    target = load_target(str(tiny_target_dir), device="cpu")
    convs = load_conversations(write_prompts(tmp_path / "p.jsonl", n=2))
    cfg = RegenConfig(max_new_tokens=8, batch_size=2)
    first = list(regenerate(target, convs, cfg, progress=False, keep_states=True))
    assert all(r["provenance"]["stopped"] == "length" for r in first)
    # Make the 4th token of one reply an end of turn: that row now stops early, the other may not.
    ids0 = first[0]["_states"][0]
    stop = ids0[first[0]["provenance"]["prompt_tokens"] + 3]
    monkeypatch.setattr(type(target), "stop_token_ids", lambda self: [stop])
    records = list(regenerate(target, convs, cfg, progress=False, keep_states=True))
    stopped = [r["provenance"]["stopped"] for r in records]
    assert "eos" in stopped
    for r in records:
        ids, aux, final = r["_states"]
        prov = r["provenance"]
        fed = prov["reply_tokens"] - (prov["stopped"] == "length")
        assert len(ids) == prov["prompt_tokens"] + fed == aux.shape[0] == final.shape[0]
        out, fresh = aux_hidden_states(target.model.get_decoder(), target.aux_layer_ids, input_ids=torch.tensor([ids]))
        torch.testing.assert_close(aux, torch.cat(fresh, -1)[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final, out.last_hidden_state[0], atol=1e-4, rtol=1e-4)


def test_prefill_in_pieces_gives_the_same_replies_and_states(tiny_target_dir, tmp_path):
    """data.regen.prefill_chunk_tokens splits the prompt prefill along its columns: the
    replies and the kept states must equal those of one whole-prompt forward."""
    from draftling.config import RegenConfig
    from draftling.data.prompts import load_conversations
    from draftling.data.regen import prefill_chunk_columns, regenerate

    target = load_target(str(tiny_target_dir), device="cpu")
    rows = [
        {
            "id": f"p{i}",
            "source": "test",
            "category": "chat",
            "messages": [{"role": "user", "content": "Tell me about the sea. " * (1 + 3 * i)}],
        }
        for i in range(4)
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs = load_conversations(tmp_path / "p.jsonl")
    whole = RegenConfig(max_new_tokens=6, batch_size=4, prefill_chunk_tokens=0)
    pieces = RegenConfig(max_new_tokens=6, batch_size=4, prefill_chunk_tokens=64)
    a = list(regenerate(target, convs, whole, progress=False, keep_states=True))
    b = list(regenerate(target, convs, pieces, progress=False, keep_states=True))
    width = max(r["provenance"]["prompt_tokens"] for r in a)
    columns = prefill_chunk_columns(pieces, len(convs), width, "cpu")
    assert columns is not None and -(-width // columns) >= 3, "the test must split the prefill"
    assert prefill_chunk_columns(whole, len(convs), width, "cpu") is None
    assert prefill_chunk_columns(RegenConfig(), len(convs), width, "cuda") is None
    for ra, rb in zip(a, b):
        assert ra["id"] == rb["id"] and ra["messages"] == rb["messages"]
        ids_a, aux_a, final_a = ra["_states"]
        ids_b, aux_b, final_b = rb["_states"]
        assert ids_a == ids_b
        torch.testing.assert_close(aux_b, aux_a, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final_b, final_a, atol=1e-4, rtol=1e-4)
