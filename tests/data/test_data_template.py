import copy

import pytest

from draftling.data.template import load_chat_template, tokenize_conversation
from draftling.errors import TargetError

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say one."},
    {"role": "assistant", "content": "reply one"},
    {"role": "user", "content": "Now two."},
    {"role": "assistant", "content": "reply two"},
]

LLAMA3_STYLE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Renders the system prompt only once the conversation has more than two messages, so the prefix
# rendered for the first reply is not a prefix of the full conversation.
UNSTABLE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% if messages|length > 2 %}{{ 'SYS: ' + m['content'] + '\n' }}{% endif %}"
    "{% else %}{{ '[' + m['role'] + ']\n' + m['content'] + '[/end]\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant]\n' }}{% endif %}"
)

# Every prefix differs from the full render: a header counts the messages.
COUNTED = (
    "{{ messages|length }} turns\n"
    "{% for m in messages %}{{ m['role'] + ':\n' + m['content'] + ' END\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
)

# Marks the last user message, so an earlier turn renders differently once a later user turn
# exists: each reply's prefix is stable locally but not within the full conversation.
LAST_USER_MARKED = (
    "{% set last_user = (messages | selectattr('role', 'equalto', 'user') | list)[-1] %}"
    "{% for m in messages %}"
    "{{ '<' + m['role'] + ('*' if m is sameas last_user else '') + '>\n' + m['content'] + '</>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>\n' }}{% endif %}"
)

# No generation prompt at all: the assistant header is only rendered with the reply.
NO_GEN_PROMPT = "{% for m in messages %}{{ m['role'] + ':\n' + m['content'] + ' END\n' }}{% endfor %}"


def with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def masked_text(tok, ids, mask):
    assert len(ids) == len(mask)
    return tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


def unmasked_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False)


def test_smollm2_chatml_golden(smol_tokenizer):
    tok = smol_tokenizer
    ids, mask = tokenize_conversation(tok, CONV)
    assert ids == tok(tok.apply_chat_template(CONV, tokenize=False), add_special_tokens=False)["input_ids"]
    assert masked_text(tok, ids, mask) == "reply one<|im_end|>reply two<|im_end|>"
    rest = unmasked_text(tok, ids, mask)
    for text in ("You are terse.", "Say one.", "Now two.", "<|im_start|>assistant\n"):
        assert text in rest
    # The newline after each <|im_end|> belongs to the next turn, not the reply.
    assert tok.convert_ids_to_tokens(ids[-1]) == "Ċ" and mask[-1] == 0


def test_smollm2_default_system_prompt_not_masked(smol_tokenizer):
    tok = smol_tokenizer
    ids, mask = tokenize_conversation(tok, CONV[1:3])
    assert "You are a helpful AI assistant named SmolLM" in unmasked_text(tok, ids, mask)
    assert masked_text(tok, ids, mask) == "reply one<|im_end|>"


def test_llama3_style_template(smol_tokenizer):
    tok = with_template(smol_tokenizer, LLAMA3_STYLE)
    # As in the real Llama 3 tokenizer, the markers are single special tokens. Left as plain text,
    # BPE would merge "<|eot_id|>" + "<|start_header_id|>" into a "><" token across the boundary.
    tok.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    ids, mask = tokenize_conversation(tok, CONV)
    assert masked_text(tok, ids, mask) == "reply one<|eot_id|>reply two<|eot_id|>"
    rest = unmasked_text(tok, ids, mask)
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n" in rest
    assert "Say one." in rest and "You are terse." in rest


@pytest.mark.parametrize("template, marker", [(UNSTABLE, "[/end]"), (COUNTED, " END"), (LAST_USER_MARKED, "</>")])
def test_template_not_prefix_stable(smol_tokenizer, template, marker):
    tok = with_template(smol_tokenizer, template)
    full = tok.apply_chat_template(CONV, tokenize=False)
    prefix = tok.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    assert not full.startswith(prefix)  # the case under test
    ids, mask = tokenize_conversation(tok, CONV)
    assert masked_text(tok, ids, mask) == f"reply one{marker}reply two{marker}"


def test_template_without_generation_prompt(smol_tokenizer):
    tok = with_template(smol_tokenizer, NO_GEN_PROMPT)
    ids, mask = tokenize_conversation(tok, CONV)
    assert masked_text(tok, ids, mask) == "reply one ENDreply two END"
    assert unmasked_text(tok, ids, mask).count("assistant:\n") == 2


def test_reply_repeating_earlier_text(smol_tokenizer):
    # The reply text also appears in the user turn; only the assistant's copy is masked.
    tok = with_template(smol_tokenizer, COUNTED)
    conv = [{"role": "user", "content": "echo yes"}, {"role": "assistant", "content": "yes"}]
    ids, mask = tokenize_conversation(tok, conv)
    assert masked_text(tok, ids, mask) == "yes END"
    assert "echo yes" in unmasked_text(tok, ids, mask)


def test_tool_turns_not_masked(smol_tokenizer):
    tok = smol_tokenizer
    conv = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '{"name": "weather", "arguments": {"city": "Paris"}}'},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 C."},
    ]
    ids, mask = tokenize_conversation(tok, conv, tools=[{"name": "weather"}])
    assert masked_text(tok, ids, mask) == (
        '{"name": "weather", "arguments": {"city": "Paris"}}<|im_end|>It is 21 C.<|im_end|>'
    )


def test_max_length_truncates(smol_tokenizer):
    ids, mask = tokenize_conversation(smol_tokenizer, CONV)
    short_ids, short_mask = tokenize_conversation(smol_tokenizer, CONV, max_length=10)
    assert short_ids == ids[:10] and short_mask == mask[:10]


def test_missing_template_raises(smol_tokenizer):
    tok = with_template(smol_tokenizer, None)
    with pytest.raises(TargetError, match="has no chat template; pass --chat-template FILE"):
        tokenize_conversation(tok, CONV)


def test_load_chat_template(smol_tokenizer, tmp_path):
    tok = with_template(smol_tokenizer, None)
    path = tmp_path / "llama3.jinja"
    path.write_text(LLAMA3_STYLE)
    load_chat_template(tok, path)
    assert tok.chat_template == LLAMA3_STYLE
    with pytest.raises(TargetError, match="missing.jinja"):
        load_chat_template(tok, tmp_path / "missing.jinja")
