"""Load prompt conversations from jsonl in the project schema, ShareGPT or OpenAI-messages shape.

Tool calls in the shared corpus are plain text: the assistant message's `content` holds the JSON
of the call (tau-bench: `[{"arguments": "<json string>", "name": ...}]`, glaive:
`{"name": ..., "arguments": {...}}`) and the result comes back as a `tool` message. OpenAI-style
`tool_calls` keys are kept as they are when a user's file has them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from draftling.errors import DataError

ROLES = ("system", "user", "assistant", "tool")

# ShareGPT speaker names -> our roles. "function_call" is LLaMA-Factory's name for an assistant
# turn that calls a tool; "observation" is the tool's answer.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "function_call": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

# OpenAI's newer/legacy role names in the messages shape.
_OPENAI_ALIASES = {"developer": "system", "function": "tool"}


@dataclass
class Conversation:
    id: str
    source: str
    category: str
    messages: list[dict]
    tools: list | None = None
    meta: dict = field(default_factory=dict)


def load_conversations(path: str | os.PathLike) -> list[Conversation]:
    """Read a jsonl prompt file; the shape (project, ShareGPT, OpenAI messages) is detected per line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such prompt file")
    with open(path, "rb") as f:
        convs = [_parse_record(record, path.stem, lineno, where) for lineno, where, record in jsonl_values(f, path)]
    if not convs:
        raise DataError(f"{path}: no prompts (the file is empty or blank)")
    return convs


def jsonl_values(lines: Iterable[bytes], path: Path) -> Iterator[tuple[int, str, object]]:
    """(line number, "path:line", value) of each non-blank line of a jsonl file's ``lines``; a bad
    byte or malformed JSON is a DataError naming the line."""
    for lineno, raw in enumerate(lines, start=1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON: {e.msg} (col {e.colno})") from None
        yield lineno, where, value


def _parse_record(record, stem: str, lineno: int, where: str) -> Conversation:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = _parse_messages(record["messages"], where)
    elif "conversations" in record:
        turns = record["conversations"]
        # SpecForge writes ShareGPT's 'conversations' with OpenAI-style role/content turns.
        role_content = isinstance(turns, list) and turns and isinstance(turns[0], dict) and "role" in turns[0]
        parse = _parse_messages if role_content else _parse_sharegpt
        messages = _with_system(parse(turns, where), record.get("system"))
    else:
        raise DataError(f"{where}: expected a 'messages' or 'conversations' list")
    return _build_conversation(record, messages, stem, lineno, where)


def _with_system(messages: list[dict], system) -> list[dict]:
    """``messages`` with a ShareGPT/LLaMA-Factory ``system`` string put first, unless a system
    turn is already there."""
    if isinstance(system, str) and system and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _build_conversation(record: dict, messages: list[dict], stem: str, lineno: int, where: str) -> Conversation:
    """A Conversation from parsed ``messages`` and the rest of ``record`` (id, source, category,
    tools; other keys go to ``meta``). Used for jsonl lines and for rows of a dataset (data/hub.py)."""
    if not any(m["role"] == "user" for m in messages):
        raise DataError(f"{where}: conversation has no user turn")

    tools = record.get("tools")
    if isinstance(tools, str):  # LLaMA-Factory's ShareGPT stores the tool list as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: 'tools' is a string but not valid JSON: {e.msg}") from None
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list, got {type(tools).__name__}")

    conv_id = record.get("id")
    source = record.get("source")
    category = record.get("category")
    known = {"id", "source", "category", "messages", "conversations", "tools", "system"}
    return Conversation(
        id=str(conv_id) if conv_id is not None and conv_id != "" else f"{stem}:{lineno}",
        source=str(source) if source else stem,
        category=str(category) if category else "unknown",
        messages=messages,
        tools=tools or None,
        meta={k: v for k, v in record.items() if k not in known},
    )


def _parse_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: missing or empty 'messages' list")
    out = []
    for n, m in enumerate(messages, start=1):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {n} is not an object")
        role = m.get("role")
        role = _OPENAI_ALIASES.get(role, role)
        if role not in ROLES:
            raise DataError(f"{where}: unknown role {role!r} in message {n} (expected {', '.join(ROLES)})")
        content = m.get("content")
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise DataError(f"{where}: message {n} ({role}) content must be a string, got {type(content).__name__}")
        out.append({**m, "role": role, "content": content})
    return out


def _parse_sharegpt(turns, where: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: missing or empty 'conversations' list")
    out = []
    for n, t in enumerate(turns, start=1):
        if not isinstance(t, dict):
            raise DataError(f"{where}: message {n} is not an object")
        speaker = t.get("from")
        role = _SHAREGPT_ROLES.get(str(speaker).lower()) if speaker is not None else None
        if role is None:
            raise DataError(
                f"{where}: unknown role {speaker!r} in message {n} "
                f"(expected one of {', '.join(sorted(_SHAREGPT_ROLES))})"
            )
        value = t.get("value")
        if not isinstance(value, str):
            raise DataError(f"{where}: message {n} ({speaker}) value must be a string, got {type(value).__name__}")
        out.append({"role": role, "content": value})
    return out


def has_tool_calls(conv: Conversation) -> bool:
    """True if the conversation uses tools: a tool turn, an assistant `tool_calls`, or a tool list."""
    if conv.tools:
        return True
    return any(m["role"] == "tool" or m.get("tool_calls") or m.get("function_call") for m in conv.messages)


ROLLOUT_TURN = "#turn"  # a rollout prompt's id: the conversation's, then this and the turn


def rollout_turns(conv: Conversation) -> list[Conversation]:
    """One prompt per assistant turn that follows a user or tool turn: the messages before it,
    exactly as the conversation has them. A conversation without such a turn stays whole."""
    out = []
    for i, m in enumerate(conv.messages):
        if m["role"] == "assistant" and i > 0 and any(x["role"] in ("user", "tool") for x in conv.messages[:i]):
            out.append(
                dataclasses.replace(
                    conv,
                    id=f"{conv.id}{ROLLOUT_TURN}{len(out)}",
                    messages=[dict(x) for x in conv.messages[:i]],
                    meta={**conv.meta, "rollout_of": conv.id},
                )
            )
    return out or [conv]


def is_rollout_turn(record_id: str) -> bool:
    return ROLLOUT_TURN in record_id


def prompt_messages(conv: Conversation) -> list[dict]:
    """The messages up to and including the last user or tool turn (trailing assistant turns dropped)."""
    last = max((i for i, m in enumerate(conv.messages) if m["role"] in ("user", "tool")), default=-1)
    return [dict(m) for m in conv.messages[: last + 1]]


def reply_record(
    conv: Conversation, assistant: dict, origin: dict, cfg, stopped: str, reply_tokens: int, prompt_tokens: int
) -> dict:
    """One line of replies.jsonl: the prompt's messages with the reply as the last turn, and its
    provenance: ``origin`` (who wrote it: the local target or a server) first, then the
    generation settings of ``cfg`` (a RegenConfig) and how the reply ended. The one schema
    for every writer of replies."""
    return {
        "id": conv.id,
        "source": conv.source,
        "category": conv.category,
        "messages": prompt_messages(conv) + [assistant],
        **({"tools": conv.tools} if conv.tools else {}),
        "provenance": {
            **origin,
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "seed": cfg.seed,
            "stopped": stopped,
            "reply_tokens": reply_tokens,
            "prompt_tokens": prompt_tokens,
        },
    }
