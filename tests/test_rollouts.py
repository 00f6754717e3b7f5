"""Agent rollouts (data.rollouts): every assistant turn of a multi-turn conversation with tool
turns becomes its own prompt (the original prefix) with the target's reply as its only loss."""

import json

from draftling.cli import main
from draftling.data.prompts import Conversation, rollout_turns


def airline_like(i: int) -> dict:
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_reservation",
                                                             "arguments": json.dumps({"id": f"R{i}"})}}]}
    return {"id": f"task{i}", "source": "airline", "category": "agent", "messages": [
        {"role": "system", "content": "You are an airline agent."},
        {"role": "user", "content": f"Please change my booking {i}."},
        call,
        {"role": "tool", "content": json.dumps({"reservation": f"R{i}", "flights": 2})},
        {"role": "assistant", "content": "I found your reservation with two flights."},
        {"role": "user", "content": "Move both to Friday."},
        {"role": "assistant", "content": "Done, both flights are on Friday."}]}


def test_rollout_turns_keep_each_original_prefix():
    conv = Conversation(**airline_like(0))
    turns = rollout_turns(conv)
    assert [t.id for t in turns] == ["task0#turn0", "task0#turn1", "task0#turn2"]
    assert [[m["role"] for m in t.messages] for t in turns] == [
        ["system", "user"], ["system", "user", "assistant", "tool"],
        ["system", "user", "assistant", "tool", "assistant", "user"]]
    assert turns[2].messages[2] == conv.messages[2]  # the original tool call, as it was
    assert all(t.meta["rollout_of"] == "task0" for t in turns)
    single = Conversation("x", "s", "c", [{"role": "user", "content": "hi"}])
    assert rollout_turns(single) == [single]


def test_data_regenerates_every_assistant_turn_and_trains_only_on_it(tmp_path, tiny_target_dir):
    prompts = tmp_path / "rollouts.jsonl"
    prompts.write_text("".join(json.dumps(airline_like(i)) + "\n" for i in range(6)))
    out = tmp_path / "data"
    assert main(["data", "--target", str(tiny_target_dir), "--device", "cpu", "--prompts", str(prompts),
                 "--out", str(out), "data.rollouts=true", "data.regen.max_new_tokens=5", "data.regen.batch_size=4",
                 "data.val_fraction=0.34", "data.min_tokens=4"]) == 0
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
        assert all(mask[first:first + sum(mask)])  # one contiguous span: the last reply only
        # After the whole prefix (one template token of slack: a token merged across the reply's
        # boundary counts as the reply's): no earlier, original reply is a loss token.
        assert first >= by_turn[row["id"]]["provenance"]["prompt_tokens"] - 1
