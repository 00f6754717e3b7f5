"""Tokenize a conversation with the target's own chat template and mask the assistant tokens.

The loss mask covers what the target generates in an assistant turn: the content (or the
template's rendering of its tool calls) plus the end-of-turn marker the template emits right after
it (`<|im_end|>`, `<|eot_id|>`, ...), since the draft must learn to end a turn. It does not cover
the newline or next-turn header that follows that marker.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from draftling.errors import TargetError

log = logging.getLogger(__name__)


def load_chat_template(tokenizer, path: str | os.PathLike) -> None:
    """Set `tokenizer.chat_template` from a jinja file."""
    path = Path(path)
    if not path.is_file():
        raise TargetError(f"{path}: chat template file not found")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise TargetError(f"{path}: chat template file is empty")
    tokenizer.chat_template = text


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def render(tokenizer, messages: list[dict], tools=None, add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages`."""
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(f"target tokenizer {_name(tokenizer)} has no chat template; pass --chat-template FILE")
    kwargs = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools:
        kwargs["tools"] = tools
    try:
        out = tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as e:  # jinja errors, raise_exception() in templates that forbid a role order
        raise TargetError(f"chat template of {_name(tokenizer)} failed: {type(e).__name__}: {e}") from e
    if isinstance(out, list) and len(out) == 1 and isinstance(out[0], str):
        out = out[0]
    if not isinstance(out, str):
        raise TargetError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}, expected str")
    return out


def assistant_spans(tokenizer, messages: list[dict], tools=None) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` and return (text, [(start, end) character span of each assistant turn])."""
    full = render(tokenizer, messages, tools)
    # A template that ignores add_generation_prompt leaves the assistant header in the diff; then
    # the span has to start at the content instead.
    probe = [{"role": "user", "content": "x"}]
    try:
        has_gen_prompt = render(tokenizer, probe, tools, add_generation_prompt=True) != render(tokenizer, probe, tools)
    except TargetError:
        has_gen_prompt = True

    spans = []
    cursor = 0  # nothing of a later turn can start before this point in `full`
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            # Advance past other turns' content so a short reply is not found in an earlier turn.
            if msg["content"]:
                pos = full.find(msg["content"], cursor)
                if pos >= 0:
                    cursor = pos + len(msg["content"])
            continue
        try:
            pre = render(tokenizer, messages[:i], tools, add_generation_prompt=True)
            post = render(tokenizer, messages[: i + 1], tools)
        except TargetError:  # some templates reject a prefix (e.g. one not ending in a user turn)
            pre = post = ""
        if post and post.startswith(pre) and full.startswith(post) and len(pre) >= cursor:
            span = _trim(full, len(pre), len(post), msg["content"], has_gen_prompt)
        else:
            span = _search(full, cursor, pre, post, msg["content"])
        if span is None:
            log.warning("assistant message %d not found in the rendered template; left unmasked", i)
            continue
        spans.append(span)
        cursor = span[1]
    return full, spans


def _trim(text: str, start: int, end: int, content: str, has_gen_prompt: bool):
    """Span of a turn rendered as text[start:end]: drop trailing whitespace after the end marker."""
    c = text.find(content, start, end) if content else -1
    if not has_gen_prompt and c >= 0:
        start = c
    new_end = start + len(text[start:end].rstrip())
    if c >= 0:  # never cut into the content itself (it may end in whitespace)
        new_end = max(new_end, c + len(content))
    return (start, new_end) if new_end > start else None


def _search(full: str, cursor: int, pre: str, post: str, content: str):
    """Fallback for templates whose prefixes are not prefixes of the full render."""
    # 1. The turn renders the same locally: find its text (content + end marker) in the full render.
    if post.startswith(pre):
        turn = post[len(pre) :].rstrip()
        if turn:
            pos = full.find(turn, cursor)
            if pos >= 0:
                return pos, pos + len(turn)
    # 2. Find the content, then the end marker the template puts after it when it ends `post`.
    for needle in (content, content.strip()):
        if not needle:
            continue
        pos = full.find(needle, cursor)
        if pos < 0:
            continue
        end = pos + len(needle)
        k = post.rfind(needle)
        marker = post[k + len(needle) :].rstrip() if k >= 0 else ""
        if marker and full.startswith(marker, end):
            end += len(marker)
        return pos, end
    return None


def tokenize_conversation(
    tokenizer, messages: list[dict], tools=None, max_length: int | None = None, last_turn_only: bool = False
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a loss mask: 1 on assistant-turn tokens (on
    the last assistant turn only with ``last_turn_only``: a rollout's earlier replies were not
    written by the target)."""
    text, spans = assistant_spans(tokenizer, messages, tools)
    if last_turn_only:
        spans = spans[-1:]
    if not getattr(tokenizer, "is_fast", False):
        raise TargetError("a fast tokenizer is needed to map the assistant spans to tokens")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    si = 0
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        while si < len(spans) and spans[si][1] <= a:
            si += 1
        if si == len(spans):
            break
        s, e = spans[si]
        # A token counts if it overlaps the span (a token merged across the boundary is still
        # something the target produced in that turn); empty offsets count if they sit inside it.
        if (a < e and b > s) or (a == b and s <= a < e):
            mask[t] = 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask
