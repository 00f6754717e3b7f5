"""Regenerate assistant replies with the target itself (the EAGLE recipe): the draft must
learn the target's own distribution, not whatever model wrote the original replies."""

from __future__ import annotations

import contextlib
import copy
import random
import time
from typing import Iterable

import torch

from draftling.config import RegenConfig
from draftling.data.prompts import Conversation, prompt_messages
from draftling.data.template import render
from draftling.errors import ConfigError
from draftling.faults import fault_point
from draftling.hardware import resolve_fast_dtype
from draftling.progress import Progress
from draftling.target import Target
from draftling.target.aux import recording_aux_states
from draftling.target.quant import has_plain_weights


def render_prompt_ids(tokenizer, conv: Conversation) -> list[int]:
    text = render(tokenizer, prompt_messages(conv), tools=conv.tools, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def regen_dtype(target: Target, cfg: RegenConfig) -> torch.dtype:
    """``cfg.dtype`` resolved on the target's device (null: the target's own); a ConfigError
    if it is not a float dtype, or if it asks to cast a quantized target."""
    dtype = resolve_fast_dtype(cfg.dtype, target.device, target.model.dtype, "data.regen.dtype")
    if dtype != target.model.dtype and not has_plain_weights(target.model):
        raise ConfigError(f"data.regen.dtype={cfg.dtype}: {target.spec.name} is quantized, so it cannot "
                          "be cast; leave data.regen.dtype unset")
    return dtype


def generating_model(target: Target, cfg: RegenConfig):
    """The model that writes the replies: the target itself, or a copy cast to
    ``cfg.dtype`` (the target keeps its own weights for validation, training and the bench)."""
    dtype = regen_dtype(target, cfg)
    if dtype == target.model.dtype:
        return target.model
    # .to() keeps each weight's strides, so the CPU's column-major Linear layout carries over.
    return copy.deepcopy(target.model).to(dtype)


@contextlib.contextmanager
def _recording_states(model, aux_layer_ids: list[int]):
    """Per forward call of one generate(): the aux layers' outputs and the decoder's
    final-normed output, which is what the trainer's teacher would recompute."""
    decoder = model.get_decoder()
    finals: list[torch.Tensor] = []

    def keep_final(_module, _inputs, output):
        finals.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = decoder.register_forward_hook(keep_final)
    try:
        with recording_aux_states(decoder, aux_layer_ids) as aux:
            yield aux, finals
    finally:
        handle.remove()


def _fed_positions(calls: list[torch.Tensor], row: int, pad: int, fed: int,
                   prefill_calls: int = 1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Row ``row``'s states over the tokens it was fed: the first ``prefill_calls`` calls are
    the left-padded prompt, in pieces along the columns (the row starts at column ``pad``);
    each later call fed one token. ``dtype``: cast to it (the target's own)."""
    prefill = torch.cat(calls[:prefill_calls], dim=1)
    steps = calls[prefill_calls:]
    return torch.cat([prefill[row, pad:]] + [s[row] for s in steps[:fed]]).to("cpu", dtype)


def prefill_chunk_columns(cfg: RegenConfig, rows: int, width: int, device) -> int | None:
    """generate()'s ``prefill_chunk_size`` (columns per prefill forward) for a batch of
    ``rows`` prompts padded to ``width``, or None for one forward."""
    budget = cfg.prefill_chunk_tokens
    if budget is None:
        budget = 4096 if torch.device(device).type == "cpu" else 0
    if budget <= 0 or rows * width <= budget:
        return None
    return max(16, budget // rows)


@torch.no_grad()
def regenerate(target: Target, convs: list[Conversation], cfg: RegenConfig,
               max_prompt_tokens: int | None = None, progress: bool = True,
               keep_states: bool = False, deadline: float | None = None,
               pace: dict | None = None, journal=None) -> Iterable[dict]:
    """Yield one record per conversation: the prompt messages plus the target's reply,
    with provenance (target, generation parameters, and whether the reply hit the cap).

    ``keep_states``: also attach ``record["_states"] = (ids, aux, final)``, the target's aux
    and final-normed states at every token it was fed (the prompt and every reply token but
    the last generated one), so training need not run the target over them again. Not JSON:
    the caller takes it off before writing the record.

    ``deadline`` (a ``time.perf_counter()`` value): start no batch that would likely end after
    it, judged by the slowest batch so far (``pace["slowest_batch_s"]``, carried over from
    earlier calls that share ``pace``); what is done is kept.

    ``journal`` (data/journal.py): a batch whose replies are all journaled is not run again;
    every batch that is run is journaled before its records are yielded."""
    tok, model = target.tokenizer, generating_model(target, cfg)
    own_dtype = target.model.dtype
    prompts = [(c, render_prompt_ids(tok, c)) for c in convs]
    if max_prompt_tokens:
        long = [c.id for c, ids in prompts if len(ids) > max_prompt_tokens]
        if long:
            print(f"regenerate: skipping {len(long)} prompts over the {max_prompt_tokens}-token prompt limit "
                  f"(data.max_tokens - data.regen.max_new_tokens): {', '.join(long[:5])}"
                  f"{' ...' if len(long) > 5 else ''}", flush=True)
        if pace is not None:
            pace["skipped_long"] = pace.get("skipped_long", 0) + len(long)
        prompts = [(c, ids) for c, ids in prompts if len(ids) <= max_prompt_tokens]
    # Similar lengths per batch waste less padding; the output order does not matter.
    prompts.sort(key=lambda p: len(p[1]))
    eos_ids = target.stop_token_ids()
    bar = Progress(len(prompts), "regenerate", enabled=progress)
    done = generated = 0
    t0 = time.perf_counter()
    pace = {} if pace is None else pace
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[start:start + cfg.batch_size]
        if journal is not None and journal.has_all(c.id for c, _ in chunk):
            yield from (journal.get(c.id) for c, _ in chunk)
            done += len(chunk)
            bar.update(len(chunk))
            continue
        slowest = pace.get("slowest_batch_s")
        if deadline is not None and slowest is not None and time.perf_counter() + slowest > deadline:
            print(f"\nregenerate: stopped at its time budget after {done} of {len(prompts)} prompts", flush=True)
            break
        t_batch = time.perf_counter()
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
        columns = prefill_chunk_columns(cfg, len(chunk), width, target.device)
        prefill_calls = 1 if columns is None else -(-width // columns)
        recording = (_recording_states(model, target.aux_layer_ids) if keep_states
                     else contextlib.nullcontext((None, None)))
        with recording as (aux_calls, final_calls):
            out = model.generate(input_ids=input_ids.to(target.device), attention_mask=attn.to(target.device),
                                 max_new_tokens=cfg.max_new_tokens, do_sample=sampling,
                                 pad_token_id=tok.pad_token_id, eos_token_id=eos_ids,
                                 prefill_chunk_size=columns, **sample_kwargs)
        cuts = [_cut_at_eos(row, eos_ids) for row in out[:, width:].tolist()]
        records = []
        for i, ((conv, ids), (reply, stopped)) in enumerate(zip(chunk, cuts)):
            text = tok.decode(reply, skip_special_tokens=True)
            extra = {}
            if keep_states:
                # Fed: every generated token but the last (the eos, or the one that hit the cap).
                fed = len(reply) if stopped == "eos" else max(0, len(reply) - 1)
                pad = width - len(ids)
                aux = torch.cat([_fed_positions(aux_calls[a], i, pad, fed, prefill_calls, own_dtype)
                                 for a in target.aux_layer_ids], dim=-1)
                final = _fed_positions(final_calls, i, pad, fed, prefill_calls, own_dtype)
                extra = {"_states": (ids + reply[:fed], aux, final)}
            records.append({
                "id": conv.id, "source": conv.source, "category": conv.category,
                "messages": prompt_messages(conv) + [{"role": "assistant", "content": text}],
                **({"tools": conv.tools} if conv.tools else {}),
                "provenance": {"target": target.spec.name, "dtype": str(model.dtype).removeprefix("torch."),
                               "max_new_tokens": cfg.max_new_tokens,
                               "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,
                               "stopped": stopped, "reply_tokens": len(reply),
                               "prompt_tokens": len(ids)},
                **extra,
            })
        if journal is not None:
            journal.add(records)
        fault_point("data.batch")
        yield from records
        done += len(chunk)
        pace["slowest_batch_s"] = max(pace.get("slowest_batch_s", 0.0), time.perf_counter() - t_batch)
        generated += sum(len(reply) for reply, _ in cuts)
        dt = time.perf_counter() - t0
        bar.update(len(chunk), f"regenerate: {done}/{len(prompts)} prompts, {dt:.0f}s, {generated / dt:.1f} reply "
                               f"tok/s (batch of {len(chunk)}, prompts up to {width} tokens)")
    bar.close()


def regenerate_within(regen, convs: list[Conversation], batch_size: int, deadline: float, seed: int,
                      report: dict, round_batches: int = 4) -> Iterable[dict]:
    """``regen(convs, deadline=..., pace=...)`` over a seeded random order of ``convs``, in
    rounds of ``round_batches`` batches, until ``deadline``. Each round is a random sample, so
    what is done when time runs out represents the whole pool; ``regenerate`` sorts a round by
    length, so its batches pad little. No batch starts that the slowest one so far says would
    end past the deadline. ``report`` receives the counts and the rate achieved."""
    order = random.Random(seed).sample(convs, len(convs))
    size = batch_size * round_batches
    pace: dict = {}
    t0, done = time.perf_counter(), 0
    for start in range(0, len(order), size):
        if time.perf_counter() + pace.get("slowest_batch_s", 0.0) > deadline:
            break
        for record in regen(order[start:start + size], deadline=deadline, pace=pace):
            done += 1
            yield record
    seconds, skipped = time.perf_counter() - t0, pace.get("skipped_long", 0)
    stopped = done + skipped < len(convs)
    report.update(available=len(convs), regenerated=done, skipped_long=skipped, seconds=round(seconds, 1),
                  rate_prompts_s=round(done / max(seconds, 1e-9), 3), stopped_by_budget=stopped)
    print(f"regenerate: {done} of {len(convs)} training prompts in {seconds:.0f} s "
          f"({done / max(seconds, 1e-9):.2f} prompts/s){'; the rest did not fit the budget' if stopped else ''}",
          flush=True)


def _cut_at_eos(row: list[int], eos_ids: list[int]) -> tuple[list[int], str]:
    for i, t in enumerate(row):
        if t in eos_ids:
            return row[:i], "eos"
    return row, "length"
