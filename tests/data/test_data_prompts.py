import json
from pathlib import Path

import pytest

from draftling.data.prompts import (
    Conversation,
    has_tool_calls,
    load_conversations,
    prompt_messages,
)
from draftling.errors import DataError

SHARED_PROMPTS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "prompts"


def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_project_schema(tmp_path):
    rec = {
        "id": "t-1",
        "source": "demo",
        "category": "tool",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "w"},
        ],
        "tools": [{"name": "w", "parameters": {"type": "object", "properties": {}}}],
    }
    (conv,) = load_conversations(write_lines(tmp_path / "p.jsonl", [rec]))
    assert (conv.id, conv.source, conv.category) == ("t-1", "demo", "tool")
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool"]
    assert conv.messages[2]["content"] == ""  # None normalized for a tool-calling assistant turn
    assert conv.messages[2]["tool_calls"][0]["function"]["name"] == "w"
    assert conv.messages[3]["tool_call_id"] == "c1" and conv.messages[3]["name"] == "w"
    assert conv.tools == rec["tools"]
    assert has_tool_calls(conv)


def test_sharegpt_shape(tmp_path):
    rec = {
        "id": "sg1",
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
            {"from": "user", "value": "more"},
            {"from": "chatgpt", "value": "sure"},
            {"from": "observation", "value": "{}"},
            {"from": "bard", "value": "done"},
        ],
    }
    no_id = {"conversations": [{"from": "human", "value": "q"}, {"from": "bing", "value": "a"}]}
    a, b = load_conversations(write_lines(tmp_path / "sg.jsonl", [rec, "", no_id]))
    assert a.id == "sg1" and a.source == "sg" and a.category == "unknown"
    assert [m["role"] for m in a.messages] == ["system", "user", "assistant", "user", "assistant", "tool", "assistant"]
    assert [m["content"] for m in a.messages][:3] == ["S", "hi", "hello"]
    assert b.id == "sg:3"  # blank line 2 skipped, but line numbers still count it
    assert [m["role"] for m in b.messages] == ["user", "assistant"]


def test_openai_messages_shape(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]},
        {"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "q2"}]},
    ]
    a, b = load_conversations(write_lines(tmp_path / "oa.jsonl", rows))
    assert (a.id, a.source, a.category) == ("oa:1", "oa", "unknown")
    assert b.id == "oa:2"
    assert b.messages[0]["role"] == "system"
    assert not has_tool_calls(a)


def test_prompt_messages_drops_trailing_assistant():
    conv = Conversation(
        "x",
        "s",
        "c",
        [
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"},
            {"role": "tool", "content": "t1"},
            {"role": "assistant", "content": "a2"},
            {"role": "assistant", "content": "a3"},
        ],
    )
    assert [m["content"] for m in prompt_messages(conv)] == ["u1", "a1", "t1"]
    assert len(conv.messages) == 5  # not modified in place


def test_has_tool_calls_variants():
    plain = [{"role": "user", "content": "u"}]
    assert not has_tool_calls(Conversation("a", "s", "c", plain))
    assert has_tool_calls(Conversation("a", "s", "c", plain, tools=[{"name": "f"}]))
    assert has_tool_calls(Conversation("a", "s", "c", plain + [{"role": "tool", "content": "r"}]))
    assert has_tool_calls(
        Conversation("a", "s", "c", plain + [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}])
    )


GOOD = {"messages": [{"role": "user", "content": "ok"}]}


@pytest.mark.parametrize(
    "bad_line, lineno, needle",
    [
        ('{"messages": [{"role": "user", "content": "x"}', 3, "malformed JSON"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]},
            3,
            "unknown role 'robot' in message 2 (expected system, user, assistant, tool)",
        ),
        (
            {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
            3,
            "conversation has no user turn",
        ),
        ({"messages": []}, 3, "missing or empty 'messages'"),
        ({"id": "x"}, 3, "'messages' or 'conversations'"),
        ({"messages": [{"role": "user", "content": 5}]}, 3, "content must be a string"),
        ({"messages": [{"role": "user", "content": None}]}, 3, "content must be a string"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, 3, "unknown role 'alien' in message 1"),
    ],
)
def test_bad_input_names_file_and_line(tmp_path, bad_line, lineno, needle):
    path = write_lines(tmp_path / "prompts.jsonl", [GOOD, "", bad_line, GOOD])
    with pytest.raises(DataError) as exc:
        load_conversations(path)
    msg = str(exc.value)
    assert f"prompts.jsonl:{lineno}: " in msg
    assert needle in msg
    assert "\n" not in msg


def test_malformed_json_message_has_column(tmp_path):
    path = write_lines(tmp_path / "prompts.jsonl", ['{"a": 1 "b": 2}'])
    with pytest.raises(DataError, match=r"prompts\.jsonl:1: malformed JSON: Expecting ',' delimiter \(col 9\)"):
        load_conversations(path)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl"):
        load_conversations(tmp_path / "nope.jsonl")


EXPECTED_COUNTS = {
    "sharegpt.jsonl": 3807,
    "instruct.jsonl": 1761,
    "code_mbpp.jsonl": 974,
    "math_gsm8k_train.jsonl": 7473,
    "summarize.jsonl": 2955,
    "tool_use.jsonl": 2429,
    "agent_tau_airline.jsonl": 200,
}


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_shared_prompt_files_load(name):
    if not SHARED_PROMPTS.is_dir():
        pytest.skip(f"shared prompt corpus not found at {SHARED_PROMPTS}")
    convs = load_conversations(SHARED_PROMPTS / name)
    assert len(convs) == EXPECTED_COUNTS[name]
    assert len({c.id for c in convs}) == len(convs)
    # The corpus holds prompts only: every record ends in a user or tool turn.
    assert all(prompt_messages(c) == c.messages for c in convs)
    if name in ("tool_use.jsonl", "agent_tau_airline.jsonl"):
        assert any(has_tool_calls(c) for c in convs)
    else:
        assert not any(has_tool_calls(c) for c in convs)


def test_exclude_drops_bench_prompts_by_id_and_user_turn(tmp_path):
    from draftling.config import RunConfig
    from draftling.data.prepare import load_prompt_files
    from draftling.data.sources import resolve_prompt_path

    def conv(i, text, history=None):
        msgs = [{"role": "user", "content": history}, {"role": "assistant", "content": "ok"}] if history else []
        return {"id": i, "source": "s", "category": "chat", "messages": msgs + [{"role": "user", "content": text}]}

    train = tmp_path / "train.jsonl"
    train.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                conv("a", "keep me"),
                conv("bench-1", "renamed text"),  # same id as a bench prompt
                conv("c", "follow-up", history=" the bench question "),  # bench text as history
                conv("d", "also kept"),
            ]
        )
        + "\n"
    )
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps(conv("bench-1", "the bench question")) + "\n")
    cfg = RunConfig()
    cfg.data.prompts = [str(train)]
    cfg.data.exclude = [str(bench)]
    convs, excluded = load_prompt_files(cfg)
    assert [c.id for c in convs] == ["a", "d"] and excluded == 2
    cfg.data.exclude = []
    assert len(load_prompt_files(cfg)[0]) == 4
    # The shipped release-bench set resolves by name.
    assert resolve_prompt_path("set:v1").name == "v1.jsonl"
    with pytest.raises(Exception, match="no prompt set 'v9'"):
        resolve_prompt_path("set:v9")


def test_per_file_caps_replace_the_global_cap(tmp_path):
    from draftling.config import load_config
    from draftling.data.prepare import load_prompt_files
    from draftling.errors import ConfigError

    files = {}
    for name, n in (("big", 30), ("small", 12)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text(
            "".join(
                json.dumps({"id": f"{name}-{i}", "source": name, "messages": [{"role": "user", "content": f"q{i}"}]})
                + "\n"
                for i in range(n)
            )
        )
    prompts = f'data.prompts=["{files["big"]}", "{files["small"]}"]'
    cfg = load_config(
        None, [prompts, "data.max_prompts_per_file=10", f'data.max_prompts_by_file={{"{files["big"]}": 4}}']
    )
    convs, _ = load_prompt_files(cfg)
    by_source = {s: sum(c.source == s for c in convs) for s in ("big", "small")}
    assert by_source == {"big": 4, "small": 10}
    with pytest.raises(ConfigError, match=r"max_prompts_by_file: \['other.jsonl'\] not in data.prompts"):
        load_config(None, [prompts, 'data.max_prompts_by_file={"other.jsonl": 4}'])
    with pytest.raises(ConfigError, match=r"max_prompts_by_file\['.*big.jsonl'\]: expected an integer"):
        load_config(None, [prompts, f'data.max_prompts_by_file={{"{files["big"]}": 2.5}}'])


def test_sharegpt_conversations_with_role_content_turns_load_as_specforge_writes_them(tmp_path):
    rec = {
        "id": "sf-1",
        "conversations": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ],
    }
    (conv,) = load_conversations(write_lines(tmp_path / "sf.jsonl", [rec]))
    assert conv.id == "sf-1" and [m["role"] for m in conv.messages] == ["system", "user", "assistant"]
    assert conv.messages[1]["content"] == "Hi"
