"""Regenerate assistant replies with the target itself (the EAGLE recipe): the draft must
learn the target's own distribution, not whatever model wrote the original replies."""

from __future__ import annotations

import sys
from typing import Iterable

import torch

from draftling.config import RegenConfig
from draftling.data.prompts import Conversation, prompt_messages
from draftling.data.template import render
from draftling.target import Target


def render_prompt_ids(tokenizer, conv: Conversation) -> list[int]:
    text = render(tokenizer, prompt_messages(conv), tools=conv.tools, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def regenerate(target: Target, convs: list[Conversation], cfg: RegenConfig,
               max_prompt_tokens: int | None = None, progress: bool = True) -> Iterable[dict]:
    """Yield one record per conversation: the prompt messages plus the target's reply,
    with provenance (target, generation parameters, and whether the reply hit the cap)."""
    tok, model = target.tokenizer, target.model
    prompts = [(c, render_prompt_ids(tok, c)) for c in convs]
    if max_prompt_tokens:
        prompts = [(c, ids) for c, ids in prompts if len(ids) <= max_prompt_tokens]
    # Similar lengths per batch waste less padding; the output order does not matter.
    prompts.sort(key=lambda p: len(p[1]))
    eos_ids = target.stop_token_ids()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(prompts), desc="regenerate", disable=not sys.stderr.isatty())
    done = 0
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[start:start + cfg.batch_size]
        width = max(len(ids) for _, ids in chunk)
        # Left padding keeps every prompt's last token at the same column for generate().
        input_ids = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(input_ids)
        for i, (_, ids) in enumerate(chunk):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attn[i, width - len(ids):] = 1
        sampling = cfg.temperature > 0
        if sampling:
            # generate() takes no generator; seed per batch so a rerun is reproducible.
            torch.manual_seed(cfg.seed + start)
        sample_kwargs = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": None} if sampling else {}
        out = model.generate(input_ids=input_ids.to(target.device), attention_mask=attn.to(target.device),
                             max_new_tokens=cfg.max_new_tokens, do_sample=sampling,
                             pad_token_id=tok.pad_token_id, eos_token_id=eos_ids, **sample_kwargs)
        for (conv, ids), row in zip(chunk, out[:, width:].tolist()):
            reply, stopped = _cut_at_eos(row, eos_ids)
            text = tok.decode(reply, skip_special_tokens=True)
            yield {
                "id": conv.id, "source": conv.source, "category": conv.category,
                "messages": prompt_messages(conv) + [{"role": "assistant", "content": text}],
                **({"tools": conv.tools} if conv.tools else {}),
                "provenance": {"target": target.spec.name, "max_new_tokens": cfg.max_new_tokens,
                               "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,
                               "stopped": stopped, "reply_tokens": len(reply),
                               "prompt_tokens": len(ids)},
            }
        done += len(chunk)
        if bar is not None:
            bar.update(len(chunk))
        if not sys.stderr.isatty() and progress:
            print(f"regenerate: {done}/{len(prompts)} prompts", flush=True)
    if bar is not None:
        bar.close()


def _cut_at_eos(row: list[int], eos_ids: list[int]) -> tuple[list[int], str]:
    for i, t in enumerate(row):
        if t in eos_ids:
            return row[:i], "eos"
    return row, "length"
