"""Regenerate assistant replies with the target itself (the EAGLE recipe): the draft must
learn the target's own distribution, not whatever model wrote the original replies."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from draftling.config import AUTO, RegenConfig
from draftling.data.prompts import Conversation, prompt_messages, reply_record
from draftling.data.template import render
from draftling.dtypes import dtype_name
from draftling.errors import ConfigError
from draftling.faults import fault_point
from draftling.hardware import resolve_fast_dtype
from draftling.progress import Progress
from draftling.target import Target
from draftling.target.aux import recording_aux_states
from draftling.target.devmap import dispatched_devices
from draftling.target.load import set_cpu_linear_layout
from draftling.target.quant import has_plain_weights

log = logging.getLogger(__name__)


# With an engine's replies, a regeneration batch holds this many times data.regen.batch_size
# prompts for batch_size engine rows: rows that finish early take the next prompt.
REPLY_CHUNKS = 4


def render_prompt_ids(tokenizer, conv: Conversation) -> list[int]:
    text = render(tokenizer, prompt_messages(conv), tools=conv.tools, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def regen_dtype(target: Target, cfg: RegenConfig) -> torch.dtype:
    """``cfg.dtype`` resolved on the target's device (null: the target's own); a ConfigError
    if it is not a float dtype, or if it asks to cast a quantized target."""
    dtype = resolve_fast_dtype(cfg.dtype, target.device, target.model.dtype, "data.regen.dtype")
    if dtype != target.model.dtype and not has_plain_weights(target.model):
        raise ConfigError(
            f"data.regen.dtype={cfg.dtype}: {target.spec.name} is quantized, so it cannot "
            "be cast; leave data.regen.dtype unset"
        )
    if dtype != target.model.dtype and dispatched_devices(target.model):
        raise ConfigError(
            f"data.regen.dtype={cfg.dtype}: {target.spec.name} is spread over devices by a device "
            "map, so it cannot be copied and cast; leave data.regen.dtype unset or load it in "
            "that dtype (--dtype)"
        )
    return dtype


def generating_model(target: Target, cfg: RegenConfig):
    """The model that writes the replies: the target itself, or a copy cast to
    ``cfg.dtype`` (the target keeps its own weights for validation, training and the bench)."""
    dtype = regen_dtype(target, cfg)
    if dtype == target.model.dtype:
        return target.model
    model = copy.deepcopy(target.model).to(dtype)
    if model.device.type == "cpu":  # .to() keeps each weight's strides: lay them out for the new dtype
        set_cpu_linear_layout(model)
    return model


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


def _fed_positions(
    calls: list[torch.Tensor], row: int, pad: int, fed: int, prefill_calls: int = 1, dtype: torch.dtype | None = None
) -> torch.Tensor:
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
    if budget == AUTO:
        budget = 4096 if torch.device(device).type == "cpu" else 0
    if budget <= 0 or rows * width <= budget:
        return None
    return max(16, budget // rows)


@dataclass(frozen=True)
class RegenRun:
    """How one ``regenerate`` call runs, beside what it generates (``RegenConfig``)."""

    max_prompt_tokens: int | None = None  # longer prompts are skipped, and counted in pace["skipped_long"]
    progress: bool = True
    # Also attach record["_states"] = (ids, aux, final), the target's aux and final-normed
    # states at every token it was fed (the prompt and every reply token but the last
    # generated one), so training need not run the target over them again. Not JSON: the
    # caller takes it off before writing the record.
    keep_states: bool = False
    # A time.perf_counter() value: start no batch that would likely end after it, judged by
    # the slowest batch so far (pace["slowest_batch_s"], carried over from earlier calls that
    # share ``pace``); what is done is kept.
    deadline: float | None = None
    pace: dict | None = None
    # data/journal.py: a batch whose replies are all journaled is not run again; every batch
    # that is run is journaled before its records are yielded.
    journal: object = None
    # Replies from a batched engine instead of HF generate: ``replies(model)`` gives
    # ``fn(prompt_ids, max_new_tokens, eos_ids[, temperature, top_p, seed]) -> [(reply, "eos" | "length")]`` for the model
    # that writes the replies (engine.replies.reply_engine_for). A batch then holds REPLY_CHUNKS x
    # data.regen.batch_size prompts, so finished rows are refilled.
    replies: object = None


def regenerate(
    target: Target, convs: list[Conversation], cfg: RegenConfig, run: RegenRun | None = None, **run_fields
) -> Iterable[dict]:
    """Yield one record per conversation: the prompt messages plus the target's reply,
    with provenance (target, generation parameters, and whether the reply hit the cap).

    ``run_fields``: RegenRun's fields by name (progress=False, keep_states=True, ...), over
    ``run``. Nothing runs until the first record is asked for."""
    return _regenerate(target, convs, cfg, dataclasses.replace(run or RegenRun(), **run_fields))


@torch.no_grad()
def _regenerate(target: Target, convs: list[Conversation], cfg: RegenConfig, run: RegenRun) -> Iterator[dict]:
    model = generating_model(target, cfg)
    prompts = _prompts(target.tokenizer, convs, run)
    if run.replies is not None and run.keep_states:
        raise ConfigError(
            "regeneration through the engine keeps no states; use HF generate (data.regen.engine=off) for kept states"
        )
    replies = run.replies(model) if run.replies is not None else None
    batches = _BatchGenerator(target, model, cfg, target.stop_token_ids(), run.keep_states, replies)
    bar = Progress(len(prompts), "regenerate", enabled=run.progress)
    done = generated = 0
    t0 = time.perf_counter()
    pace = {} if run.pace is None else run.pace
    chunk_size = cfg.batch_size * (REPLY_CHUNKS if run.replies is not None else 1)
    for start in range(0, len(prompts), chunk_size):
        chunk = prompts[start : start + chunk_size]
        if run.journal is not None and run.journal.has_all(c.id for c, _ in chunk):
            yield from (run.journal.get(c.id) for c, _ in chunk)
            done += len(chunk)
            bar.skip(len(chunk))  # journaled: no time, not in the rate
            continue
        slowest = pace.get("slowest_batch_s")
        if run.deadline is not None and slowest is not None and time.perf_counter() + slowest > run.deadline:
            log.info(f"\nregenerate: stopped at its time budget after {done} of {len(prompts)} prompts")
            break
        t_batch = time.perf_counter()
        records, reply_tokens = batches.records(chunk, start)
        if run.journal is not None:
            run.journal.add(records)
        fault_point("data.batch")
        yield from records
        done += len(chunk)
        pace["slowest_batch_s"] = max(pace.get("slowest_batch_s", 0.0), time.perf_counter() - t_batch)
        generated += reply_tokens
        dt = time.perf_counter() - t0
        width = max(len(ids) for _, ids in chunk)
        bar.update(
            len(chunk),
            f"regenerate: {done}/{len(prompts)} prompts, {dt:.0f}s, {generated / dt:.1f} reply "
            f"tok/s (batch of {len(chunk)}, prompts up to {width} tokens)",
        )
    bar.close()


def _prompts(tokenizer, convs: list[Conversation], run: RegenRun) -> list[tuple[Conversation, list[int]]]:
    """Each conversation with its prompt's ids, less those over ``run.max_prompt_tokens``,
    shortest first: similar lengths per batch waste less padding (the output order does not
    matter)."""
    prompts = [(c, render_prompt_ids(tokenizer, c)) for c in convs]
    limit = run.max_prompt_tokens
    if limit:
        long = [c.id for c, ids in prompts if len(ids) > limit]
        if long:
            log.info(
                f"regenerate: skipping {len(long)} prompts over the {limit}-token prompt limit "
                f"(data.max_tokens - data.regen.max_new_tokens): {', '.join(long[:5])}"
                f"{' ...' if len(long) > 5 else ''}"
            )
        if run.pace is not None:
            run.pace["skipped_long"] = run.pace.get("skipped_long", 0) + len(long)
        prompts = [(c, ids) for c, ids in prompts if len(ids) <= limit]
    prompts.sort(key=lambda p: len(p[1]))
    return prompts


@dataclass(frozen=True)
class _Recording:
    """What one generate() recorded per forward call (see _recording_states)."""

    aux_calls: dict[int, list[torch.Tensor]]
    final_calls: list[torch.Tensor]
    prefill_calls: int  # the first calls, the prompt's prefill in pieces along the columns

    def row(self, target: Target, row: int, pad: int, fed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s aux and final states over the tokens it was fed, in the target's dtype."""
        dtype = target.model.dtype
        aux = torch.cat(
            [_fed_positions(self.aux_calls[a], row, pad, fed, self.prefill_calls, dtype) for a in target.aux_layer_ids],
            dim=-1,
        )
        return aux, _fed_positions(self.final_calls, row, pad, fed, self.prefill_calls, dtype)


@dataclass(frozen=True)
class _BatchGenerator:
    """Generates the batches of one regenerate() call."""

    target: Target
    model: object  # the target's model, or its copy in data.regen.dtype
    cfg: RegenConfig
    eos_ids: list[int]
    keep_states: bool
    replies: object = None  # RegenRun.replies(model)

    def records(self, chunk: list[tuple[Conversation, list[int]]], start: int) -> tuple[list[dict], int]:
        """The batch's records, and how many reply tokens it generated."""
        if self.replies is not None:
            cfg = self.cfg  # sampled: seeded per batch, as HF generate below
            sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed + start}
            done = self.replies(
                [ids for _, ids in chunk], cfg.max_new_tokens, self.eos_ids, **(sampling if cfg.temperature > 0 else {})
            )
            records = [self._record(conv, ids, reply, stopped) for (conv, ids), (reply, stopped) in zip(chunk, done)]
            return records, sum(len(reply) for reply, _ in done)
        out, width, recording = self._generate(chunk, start)
        records, reply_tokens = [], 0
        for i, ((conv, ids), row) in enumerate(zip(chunk, out[:, width:].tolist())):
            reply, stopped = _cut_at_eos(row, self.eos_ids)
            reply_tokens += len(reply)
            record = self._record(conv, ids, reply, stopped)
            if recording is not None:
                # Fed: every generated token but the last (the eos, or the one that hit the cap).
                fed = len(reply) if stopped == "eos" else max(0, len(reply) - 1)
                aux, final = recording.row(self.target, i, width - len(ids), fed)
                record["_states"] = (ids + reply[:fed], aux, final)
            records.append(record)
        return records, reply_tokens

    def _generate(
        self, chunk: list[tuple[Conversation, list[int]]], start: int
    ) -> tuple[torch.Tensor, int, _Recording | None]:
        """generate()'s output ids (prompt columns first), the prompt columns, and with
        keep_states the states recorded on the way."""
        target, cfg, pad_id = self.target, self.cfg, self.target.tokenizer.pad_token_id
        width = max(len(ids) for _, ids in chunk)
        # Left padding keeps every prompt's last token at the same column for generate().
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attn = torch.zeros_like(input_ids)
        for i, (_, ids) in enumerate(chunk):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attn[i, width - len(ids) :] = 1
        sampling = cfg.temperature > 0
        if sampling:
            # generate() takes no generator; seed per batch so a rerun is reproducible.
            torch.manual_seed(cfg.seed + start)
        sample_kwargs = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": None} if sampling else {}
        columns = prefill_chunk_columns(cfg, len(chunk), width, target.device)
        recording = (
            _recording_states(self.model, target.aux_layer_ids)
            if self.keep_states
            else contextlib.nullcontext((None, None))
        )
        with recording as (aux_calls, final_calls):
            out = self.model.generate(
                input_ids=input_ids.to(target.device),
                attention_mask=attn.to(target.device),
                max_new_tokens=cfg.max_new_tokens,
                do_sample=sampling,
                pad_token_id=pad_id,
                eos_token_id=self.eos_ids,
                prefill_chunk_size=columns,
                **sample_kwargs,
            )
        if not self.keep_states:
            return out, width, None
        return out, width, _Recording(aux_calls, final_calls, 1 if columns is None else -(-width // columns))

    def _record(self, conv: Conversation, ids: list[int], reply: list[int], stopped: str) -> dict:
        cfg = self.cfg
        text = self.target.tokenizer.decode(reply, skip_special_tokens=True)
        origin = {"target": self.target.spec.label, "dtype": dtype_name(self.model.dtype)}
        return reply_record(conv, {"role": "assistant", "content": text}, origin, cfg, stopped, len(reply), len(ids))


def regenerate_within(
    regen, convs: list[Conversation], batch_size: int, deadline: float, seed: int, report: dict, round_batches: int = 4
) -> Iterable[dict]:
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
        for record in regen(order[start : start + size], deadline=deadline, pace=pace):
            done += 1
            yield record
    seconds, skipped = time.perf_counter() - t0, pace.get("skipped_long", 0)
    stopped = done + skipped < len(convs)
    report.update(
        available=len(convs),
        regenerated=done,
        skipped_long=skipped,
        seconds=round(seconds, 1),
        rate_prompts_s=round(done / max(seconds, 1e-9), 3),
        stopped_by_budget=stopped,
    )
    log.info(
        f"regenerate: {done} of {len(convs)} training prompts in {seconds:.0f} s "
        f"({done / max(seconds, 1e-9):.2f} prompts/s){'; the rest did not fit the budget' if stopped else ''}"
    )


def _cut_at_eos(row: list[int], eos_ids: list[int]) -> tuple[list[int], str]:
    for i, t in enumerate(row):
        if t in eos_ids:
            return row[:i], "eos"
    return row, "length"
