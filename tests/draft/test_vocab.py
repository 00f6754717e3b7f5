import pytest
import torch

from draftling.draft.vocab import (
    DraftVocab,
    build_vocab,
    build_vocab_file,
    check_vocab,
    load_vocab,
    save_vocab,
    token_counts,
)
from draftling.errors import DataError
from draftling.io import write_jsonl


def test_most_frequent_masked_tokens_and_offset_table():
    seqs = [([5, 7, 7, 9, 9, 9, 3], [0, 1, 1, 1, 1, 1, 1]), ([5, 5, 5, 5], [0, 0, 0, 1])]
    counts = token_counts(seqs, 12)
    assert counts[5] == 1 and counts[9] == 3 and counts[7] == 2 and counts[3] == 1
    v = build_vocab(counts, 3, "h")
    ids = (torch.arange(3) + v.d2t).tolist()
    assert ids == [5, 7, 9] or sorted(ids) == [3, 7, 9] or sorted(ids) == [5, 7, 9]
    assert set(ids) >= {7, 9}  # the two most frequent always make it
    assert ids == sorted(ids)  # ascending, so offsets are non-negative
    assert v.t2d.sum() == 3 and all(v.t2d[i] for i in ids)
    check_vocab(v, "test")


def test_pads_with_unused_ids_when_data_has_few_tokens():
    counts = torch.zeros(50, dtype=torch.long)
    counts[[10, 20]] = 4
    v = build_vocab(counts, 8, "h")
    ids = v.draft_ids_in_target.tolist()
    assert len(set(ids)) == 8 and {10, 20} <= set(ids)
    assert v.num_distinct == 2 and v.coverage == 1.0


def test_vocab_larger_than_target_is_refused():
    with pytest.raises(DataError, match="larger than the target vocab"):
        build_vocab(torch.ones(100, dtype=torch.long), 101, "h")


def test_roundtrip_and_stale_data_hash(tmp_path):
    v = build_vocab(torch.arange(40), 10, "abc123")
    save_vocab(v, tmp_path / "v.safetensors")
    back = load_vocab(tmp_path / "v.safetensors", expect_data_hash="abc123", target_vocab_size=40)
    assert torch.equal(back.d2t, v.d2t) and torch.equal(back.t2d, v.t2d)
    with pytest.raises(DataError, match="different data"):
        load_vocab(tmp_path / "v.safetensors", expect_data_hash="zzz")
    with pytest.raises(DataError, match="target vocab has 41"):
        load_vocab(tmp_path / "v.safetensors", target_vocab_size=41)


def test_zeroed_d2t_is_caught():
    v = build_vocab(torch.arange(40), 10, "h")
    broken = DraftVocab(torch.zeros_like(v.d2t), v.t2d, "h", 10, 1.0)
    with pytest.raises(DataError, match="all zeros"):
        check_vocab(broken, "broken.safetensors")


def test_build_from_file_hashes_the_data(tmp_path):
    rows = [{"id": "a", "source": "s", "input_ids": [1, 2, 2, 3], "loss_mask": [0, 1, 1, 1]}]
    write_jsonl(tmp_path / "train.jsonl", rows)
    v = build_vocab_file(tmp_path / "train.jsonl", 10, 4, tmp_path / "vocab.safetensors")
    assert {2, 3} <= set(v.draft_ids_in_target.tolist())
    rows[0]["input_ids"] = [1, 2, 2, 4]
    write_jsonl(tmp_path / "train.jsonl", rows)
    from draftling.draft.vocab import hash_dataset_file

    with pytest.raises(DataError, match="different data"):
        load_vocab(tmp_path / "vocab.safetensors", expect_data_hash=hash_dataset_file(tmp_path / "train.jsonl"))


def test_prompt_weight_ranks_prompt_text_beside_the_replies(tmp_path):
    from draftling.draft.vocab import prompt_weighted_rank

    counts = torch.zeros(20, dtype=torch.long)
    counts[[3, 4]] = torch.tensor([5, 1])
    prompt = torch.zeros(20, dtype=torch.long)
    prompt[7] = 100
    replies_only = build_vocab(counts, 2, "h")
    assert replies_only.draft_ids_in_target.tolist() == [3, 4]
    weighted = build_vocab(counts, 2, "h", rank=prompt_weighted_rank(counts, prompt, 1.0))
    assert weighted.draft_ids_in_target.tolist() == [3, 7]  # 7 outranks the once-seen 4
    assert weighted.coverage == pytest.approx(5 / 6)  # coverage stays a share of the loss tokens
    # A small weight only breaks ties and pads: the reply tokens come first.
    light = build_vocab(counts, 3, "h", rank=prompt_weighted_rank(counts, prompt, 1e-3))
    assert light.draft_ids_in_target.tolist() == [3, 4, 7]


def test_prompt_weight_without_counts_names_the_missing_file(tmp_path):
    rows = [{"id": "a", "source": "s", "input_ids": [1, 2, 2, 3], "loss_mask": [0, 1, 1, 1]}]
    write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match=r"prompt_token_counts.safetensors: prompt token counts not found"):
        build_vocab_file(tmp_path / "train.jsonl", 10, 4, tmp_path / "vocab.safetensors", prompt_weight=1.0)
    assert not (tmp_path / "vocab.safetensors").exists()


def test_negative_prompt_weight_is_a_config_error():
    from draftling.config import load_config
    from draftling.errors import ConfigError

    with pytest.raises(ConfigError, match=r"vocab.prompt_weight=-1.0: expected a number >= 0"):
        load_config(None, ["vocab.prompt_weight=-1"])
