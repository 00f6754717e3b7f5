"""Agent rollouts (data.rollouts): every assistant turn of a multi-turn conversation with tool
turns becomes its own prompt (the original prefix) with the target's reply as its only loss."""

import json

import pytest

from draftling.cli import main
from draftling.data.prompts import Conversation, rollout_turns


def airline_like(i: int) -> dict:
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_reservation", "arguments": json.dumps({"id": f"R{i}"})}}
        ],
    }
    return {
        "id": f"task{i}",
        "source": "airline",
        "category": "agent",
        "messages": [
            {"role": "system", "content": "You are an airline agent."},
            {"role": "user", "content": f"Please change my booking {i}."},
            call,
            {"role": "tool", "content": json.dumps({"reservation": f"R{i}", "flights": 2})},
            {"role": "assistant", "content": "I found your reservation with two flights."},
            {"role": "user", "content": "Move both to Friday."},
            {"role": "assistant", "content": "Done, both flights are on Friday."},
        ],
    }


def test_rollout_turns_keep_each_original_prefix():
    conv = Conversation(**airline_like(0))
    turns = rollout_turns(conv)
    assert [t.id for t in turns] == ["task0#turn0", "task0#turn1", "task0#turn2"]
    assert [[m["role"] for m in t.messages] for t in turns] == [
        ["system", "user"],
        ["system", "user", "assistant", "tool"],
        ["system", "user", "assistant", "tool", "assistant", "user"],
    ]
    assert turns[2].messages[2] == conv.messages[2]  # the original tool call, as it was
    assert all(t.meta["rollout_of"] == "task0" for t in turns)
    single = Conversation("x", "s", "c", [{"role": "user", "content": "hi"}])
    assert rollout_turns(single) == [single]


def test_data_regenerates_every_assistant_turn_and_trains_only_on_it(tmp_path, tiny_target_dir):
    prompts = tmp_path / "rollouts.jsonl"
    prompts.write_text("".join(json.dumps(airline_like(i)) + "\n" for i in range(6)))
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
                "data.rollouts=true",
                "data.regen.max_new_tokens=5",
                "data.regen.batch_size=4",
                "data.val_fraction=0.34",
                "data.min_tokens=4",
            ]
        )
        == 0
    )
    replies = [json.loads(line) for line in (out / "replies.jsonl").read_text().splitlines()]
    assert len(replies) == 18 and {r["id"].split("#")[0] for r in replies} == {f"task{i}" for i in range(6)}
    by_turn = {r["id"]: r for r in replies}
    third = by_turn["task3#turn2"]["messages"]
    assert [m["role"] for m in third] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert third[4]["content"] == "I found your reservation with two flights."  # the original earlier reply
    rows = {s: [json.loads(line) for line in (out / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "val")}
    tasks = {s: {r["id"].split("#")[0] for r in rows[s]} for s in rows}
    assert rows["val"] and not tasks["train"] & tasks["val"]  # split by task: all turns on one side
    for row in rows["train"] + rows["val"]:
        mask = row["loss_mask"]
        first = mask.index(1)
        assert all(mask[first : first + sum(mask)])  # one contiguous span: the last reply only
        # After the whole prefix (one template token of slack: a token merged across the reply's
        # boundary counts as the reply's): no earlier, original reply is a loss token.
        assert first >= by_turn[row["id"]]["provenance"]["prompt_tokens"] - 1


def test_tau_bench_trials_split_by_task_by_default_and_the_summary_says_why(tmp_path, tiny_target_dir):
    prompts = tmp_path / "rollouts.jsonl"
    trials = [{**airline_like(i), "id": f"tau-airline-{i // 3}-{i % 3}"} for i in range(9)]  # 3 tasks x 3 trials
    prompts.write_text("".join(json.dumps(c) + "\n" for c in trials))
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
                "data.rollouts=true",
                "data.rollout_max_turns=1",
                "data.regen.max_new_tokens=3",
                "data.val_fraction=0.34",
                "data.min_tokens=4",
            ]
        )
        == 0
    )
    tasks = {s: {r["id"].split("#")[0].rsplit("-", 1)[0] for r in _rows(out, s)} for s in ("train", "val")}
    assert tasks["val"] and not tasks["train"] & tasks["val"]  # no task's trials on both sides
    split = json.loads((out / "summary.json").read_text())["split"]
    assert split["key"] == "task" and split["set"] == "auto" and split["why"].startswith("auto: 9 of 9 records")


def _rows(out, split):
    return [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]


def test_rollout_turns_are_sampled_among_the_prefixes_that_fit(tmp_path, tiny_target_dir):
    long = airline_like(0)
    long["messages"][3]["content"] = json.dumps({"log": ["flight"] * 400})  # turns 1 and 2 over the limit
    prompts = tmp_path / "rollouts.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in [long] + [airline_like(i) for i in range(1, 7)]))
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
                "data.rollouts=true",
                "data.rollout_max_turns=2",
                "data.max_tokens=300",
                "data.regen.max_new_tokens=5",
                "data.val_fraction=0.3",
                "data.min_tokens=4",
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollout_turns"] == {"prompt_limit": 295, "turns": 21, "over_limit": 2, "sampled_out": 6}
    assert summary["regenerated"] == 13 and summary["skipped_long_prompts"] == 0
    ids = [r["id"] for r in _rows(out, "train") + _rows(out, "val")]
    assert [i for i in ids if i.startswith("task0#")] == ["task0#turn0"]  # the only turn of task0 that fits
    per_task = {}
    for i in ids:
        per_task.setdefault(i.split("#")[0], []).append(i)
    assert all(len(v) == 2 for k, v in per_task.items() if k != "task0")
    rerun = tmp_path / "data2"  # the sample is seeded: the same turns again
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
                str(rerun),
                "data.rollouts=true",
                "data.rollout_max_turns=2",
                "data.max_tokens=300",
                "data.regen.max_new_tokens=5",
                "data.val_fraction=0.3",
                "data.min_tokens=4",
            ]
        )
        == 0
    )
    assert sorted(r["id"] for r in _rows(rerun, "train")) == sorted(r["id"] for r in _rows(out, "train"))


def test_a_32k_token_prefix_is_regenerated_and_kept_whole(tmp_path, tiny_target_dir):
    from transformers import AutoTokenizer

    from tests.helpers import saved_tiny_target

    target = saved_tiny_target(
        tmp_path / "long-target",
        AutoTokenizer.from_pretrained(tiny_target_dir),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32768,
    )
    conv = airline_like(0)
    conv["messages"] = conv["messages"][:5]  # two turns: one short prefix, one of ~32k tokens
    conv["messages"][3]["content"] = " ".join(f"seat {i % 97} row {i % 31};" for i in range(3800))
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps(conv) + "\n")
    out = tmp_path / "data"
    assert (
        main(
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
                "data.rollouts=true",
                "data.max_tokens=32768",
                "data.regen.max_new_tokens=3",
                "data.regen.batch_size=1",
                "data.val_fraction=0",
                "data.min_tokens=4",
            ]
        )
        == 0
    )
    longest = {r["id"]: r for r in _rows(out, "train")}["task0#turn1"]
    mask = longest["loss_mask"]
    assert 30000 < len(longest["input_ids"]) <= 32768  # the whole prefix: nothing truncated or skipped
    assert 1 <= sum(mask) <= 4 and mask.index(1) > len(mask) - 8  # the reply at the very end
    assert json.loads((out / "summary.json").read_text())["rollout_turns"]["over_limit"] == 0


def test_max_tokens_over_the_target_context_is_refused(tmp_path, tiny_target_dir, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(airline_like(0)) + "\n")
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
                str(tmp_path / "d"),
                "data.max_tokens=4096",
            ]
        )
        != 0
    )
    assert "data.max_tokens=4096 is over" in capsys.readouterr().err and not (tmp_path / "d").exists()


@pytest.mark.parametrize("engine", ["off", "on"])  # HF generate, and the batched engine
def test_samples_per_prompt_adds_sampled_training_replies(tmp_path, tiny_target_dir, engine):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"Tell me about {i}."}]}) + "\n"
            for i in range(8)
        )
    )

    def data(out):
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
                    "data.regen.samples_per_prompt=3",
                    "data.regen.sample_temperature=1.0",
                    "data.regen.max_new_tokens=6",
                    "data.val_fraction=0.25",
                    "data.min_tokens=4",
                    f"data.regen.engine={engine}",
                ]
            )
            == 0
        )
        return [json.loads(line) for line in (out / "replies.jsonl").read_text().splitlines()]

    replies = data(tmp_path / "d")
    val = {r["id"] for r in _rows(tmp_path / "d", "val")}
    train_prompts = {f"q{i}" for i in range(8)} - val
    by_id = {r["id"]: r for r in replies}
    assert set(by_id) == val | train_prompts | {f"{p}#sample{k}" for p in train_prompts for k in (1, 2)}
    assert {by_id[f"{p}#sample2"]["provenance"]["temperature"] for p in train_prompts} == {1.0}
    assert {by_id[p]["provenance"]["temperature"] for p in train_prompts | val} == {0.0}
    reply = lambda r: r["messages"][-1]["content"]  # noqa: E731
    assert any(reply(by_id[f"{p}#sample1"]) != reply(by_id[p]) for p in train_prompts)  # sampled, not greedy
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert summary["sampled_replies"] == 2 * len(train_prompts)
    assert summary["skipped_long_prompts"] == 0  # the sampled replies are not counted against the prompts
    assert [reply(r) for r in data(tmp_path / "d2")] == [reply(r) for r in replies]  # seeded: the same again
