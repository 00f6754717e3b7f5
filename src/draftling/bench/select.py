"""`draftling select RUN_DIR --data DATA --prompts HELD_OUT`: the checkpoint to ship, chosen by
served speed.

Validation loss only shortlists: the ``shortlist`` checkpoints of lowest loss on DATA's
validation split (scored afresh, so every candidate is measured alike). Each then decodes the
held-out prompts through the batched engine at the concurrency asked for (16 by default: a
serving load; the prompts are repeated to fill the rows where there are fewer), against the same
engine without speculation. Every candidate is timed ``repeats`` times after one untimed
warm-up, the runs taken in turn (A1 B1 C1 A2 B2 C2 ...) so drift on the machine hits all alike;
the highest median tok/s is the fastest, and a candidate whose min-max range overlaps the
fastest's is tied with it: the earliest checkpoint of a tie ships (the cheaper one). tau and the
identity with plain greedy decoding are shown beside it. ``--base DIR`` also measures a base
head on the same prompts, in the same turns: the adaptation report (base against the winner).
The report is JSON plus markdown.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from draftling.bench.manifest import device_name, manifest_fields
from draftling.bench.release import load_prompt_set
from draftling.bench.simple import build_engine, build_runner, decode_configs
from draftling.config import load_config
from draftling.data.tokenized import load_tokenized
from draftling.engine import EngineOptions
from draftling.engine.generate import batch_generate
from draftling.errors import DraftlingError
from draftling.export.formats import load_any_draft
from draftling.io import write_json, write_text
from draftling.progress import Progress
from draftling.target import Target
from draftling.timing import timed
from draftling.train.batches import evaluate
from draftling.train.checkpoint import checkpoint_step, list_checkpoints


@dataclass(frozen=True)
class SelectOptions:
    prompts: str  # held-out prompts: a prompt-set name or a jsonl path, task-disjoint from training
    data: str  # the run's data directory: its val.jsonl scores the loss
    shortlist: int = 3
    config: str = "tree-3-4-8"
    concurrency: int = 16  # requests decoded at once: a serving load
    repeats: int = 3  # timed runs per candidate, after one untimed warm-up
    max_new_tokens: int = 128
    base: str | None = None  # a base head measured on the same prompts
    out: str | None = None  # the report's folder; default RUN_DIR/selection
    command: str | None = None


def select_checkpoint(target: Target, run_dir, opts: SelectOptions, measure=None) -> dict:
    """The selection report (see the module doc), written to ``opts.out``. ``measure(target,
    draft, ids, opts) -> dict``: one timed run of a head (at least ``tok_s`` and ``tau``); called
    ``opts.repeats`` times per head, in turns (default a ``HeadMeter``; tests pass their own)."""
    run_dir = Path(run_dir)
    shortlist, losses = shortlist_by_loss(target, run_dir, opts)
    info, prompts = load_prompt_set(opts.prompts, target)
    ids = [p.input_ids for p in prompts]
    requests = fill_rows(ids, opts.concurrency)
    base = load_any_draft(opts.base, target.device, _dtype(target)) if opts.base else None
    rows, base_row = measure_shortlist(target, shortlist, losses, requests, opts, measure or HeadMeter(), base)
    report = _report(rows, opts, ids, len(requests), info, target)
    if base_row is not None:
        win = next(r for r in rows if r["checkpoint"] == report["selection"]["winner"])
        report["adaptation"] = {
            "workload": _workload(prompts),
            "prompts": len(ids),
            "base": {k: base_row[k] for k in ("tau", "tok_s")},
            "adapted": {k: win[k] for k in ("tau", "tok_s")},
        }
    _write(report, Path(opts.out or run_dir / "selection"), target, opts)
    return report


def shortlist_by_loss(target: Target, run_dir: Path, opts: SelectOptions) -> tuple[list[Path], dict]:
    """The ``opts.shortlist`` checkpoints of lowest validation loss, and every checkpoint's loss."""
    cands = list_checkpoints(run_dir)
    if not cands:
        raise DraftlingError(
            f"{run_dir}: no checkpoints to select from (train with train.keep_checkpoints=0 "
            "or train.ckpt_every_epoch=true to keep candidates)"
        )
    run_cfg = load_config(run_dir / "config.yaml")
    val = load_tokenized(Path(opts.data) / "val.jsonl", target.config.vocab_size)
    losses = {}
    with Progress(len(cands), "select: validation loss", bar=False) as progress:
        for i, c in enumerate(cands):
            losses[c] = val_loss(target, c, run_cfg, val)
            progress.update(1, f"select: validation loss {i + 1}/{len(cands)}: {c.name} {losses[c]:.4f}")
    return sorted(cands, key=lambda c: losses[c])[: opts.shortlist], losses


def fill_rows(ids: list[list[int]], concurrency: int) -> list[list[int]]:
    """The requests one run decodes: the prompts, repeated in turn up to ``concurrency`` where
    there are fewer, so the batch's rows are full at the start."""
    return ids if len(ids) >= concurrency else [ids[i % len(ids)] for i in range(concurrency)]


def measure_shortlist(
    target: Target, shortlist: list[Path], losses: dict, ids, opts: SelectOptions, measure, base=None
) -> tuple[list[dict], dict | None]:
    """One row per shortlisted checkpoint (its step, validation loss and ``measure``'s figures over
    ``opts.repeats`` runs, see ``summarise``) and the ``base`` head's (None without one). The runs
    go in turns, A1 B1 C1 (base1) A2 B2 C2 ..., so drift on the machine hits every head alike."""
    heads = {c.name: load_any_draft(c, target.device, _dtype(target)) for c in shortlist}
    if base is not None:
        heads["base"] = base  # checkpoint names are step_NNNNNNN: no clash
    runs: dict[str, list[dict]] = {name: [] for name in heads}
    total, done = len(heads) * opts.repeats, 0
    with Progress(total, "select: served speed", bar=False) as progress:
        for r in range(opts.repeats):
            for name, draft in heads.items():
                m = measure(target, draft, ids, opts)
                runs[name].append(m)
                done += 1
                progress.update(
                    1,
                    f"select: served speed {done}/{total}: {name} run {r + 1}/{opts.repeats} "
                    f"{m['tok_s']:.1f} tok/s, tau {m['tau']:.2f}",
                )
    rows = [
        {"checkpoint": c.name, "step": checkpoint_step(c), "val_loss": losses[c], **summarise(runs[c.name])}
        for c in shortlist
    ]
    return rows, summarise(runs["base"]) if base is not None else None


def summarise(runs: list[dict]) -> dict:
    """One head's runs as one row: the first run's figures (tau and identity do not change
    between runs at temperature 0), tok/s the median with ``tok_s_runs`` (in order), min and max
    (the spread), speedup the median's against the plain baseline."""
    tok = [float(m["tok_s"]) for m in runs]
    med = statistics.median(tok)
    row = {**runs[0], "tok_s": med, "tok_s_median": med, "tok_s_min": min(tok), "tok_s_max": max(tok)}
    row["tok_s_runs"] = tok
    if row.get("plain_tok_s"):
        row["speedup"] = med / row["plain_tok_s"]
    return row


def _dtype(target: Target) -> torch.dtype:
    return next(target.model.parameters()).dtype


def _workload(prompts) -> str:
    return ",".join(dict.fromkeys(p.workload for p in prompts))


def val_loss(target: Target, ckpt: Path, run_cfg, examples) -> float:
    """The checkpoint's TTT loss on the validation ``examples``, as the trainer scores it."""
    draft = load_any_draft(ckpt, target.device, torch.float32)
    with torch.no_grad():
        return float(evaluate(draft, target, examples, run_cfg, target.device, run_cfg.train.max_val_batches)["loss"])


def engine_options(device) -> EngineOptions:
    """The engine select measures with: unpadded, uncompiled, CUDA graphs on a GPU."""
    return EngineOptions(cuda_graphs="auto", compile=False, query_pad=0, attention="auto").resolve(device)


class HeadMeter:
    """``measure`` kept across calls: one engine target per aux layers and request set, plain
    greedy decoding timed on it once (the baseline of speedup and identity, after a warm-up), one
    draft runner per head, warmed once; each call then times one speculative run of ``ids``
    through the batched engine at ``opts.concurrency`` rows."""

    def __init__(self) -> None:
        self.engines: dict = {}  # key -> (engine target, plain outputs, plain tok/s)
        self.runners: dict = {}  # (id(draft), key) -> (draft, runner): the draft kept, so its id is too

    def __call__(self, target: Target, draft, ids: list[list[int]], opts: SelectOptions) -> dict:
        c = decode_configs(draft, [opts.config])[-1]  # a block drafter: the tree asked, else its chain
        tree, eos = (c.steps, c.topk, c.draft_tokens), target.stop_token_ids()
        max_len = max(map(len, ids)) + opts.max_new_tokens + c.draft_tokens + 8
        key = (tuple(draft.config.eagle_aux_hidden_state_layer_ids), max_len, opts.concurrency, _ids_key(ids))
        tgt, plain, plain_tok_s = self._engine(key, target, draft, ids, opts)
        runner = self._runner(key, target, draft, ids, opts, tree)
        out, seconds = timed(
            lambda: batch_generate(tgt, ids, opts.max_new_tokens, draft=runner, tree=tree, eos_ids=eos), tgt.device
        )
        lengths = [a for r in out for a in r.stats.accept_lengths]
        tok_s = sum(len(r.tokens) for r in out) / seconds
        return {
            "config": c.name,  # a block drafter decodes its own block, whatever opts.config says
            "tok_s": tok_s,
            "tau": sum(lengths) / max(1, len(lengths)),
            "plain_tok_s": plain_tok_s,
            "speedup": tok_s / plain_tok_s,
            "identical": sum(a.tokens == b.tokens for a, b in zip(out, plain)) / len(out),
            "requests": len(out),
        }

    def _engine(self, key, target: Target, draft, ids, opts: SelectOptions):
        """(engine target, plain outputs, plain tok/s) for ``key``, built and timed on first use."""
        if key not in self.engines:
            max_len, eos = key[1], target.stop_token_ids()
            tgt, runner = build_engine(
                target, draft, max_len, engine_options(target.device), batch_size=opts.concurrency
            )
            self.runners[id(draft), key] = (draft, runner, False)
            batch_generate(tgt, ids[: opts.concurrency], 4, eos_ids=eos)  # warm-up, untimed
            plain, seconds = timed(lambda: batch_generate(tgt, ids, opts.max_new_tokens, eos_ids=eos), tgt.device)
            self.engines[key] = (tgt, plain, sum(len(r.tokens) for r in plain) / seconds)
        return self.engines[key]

    def _runner(self, key, target: Target, draft, ids, opts: SelectOptions, tree):
        """``draft``'s runner on ``key``'s engine, warmed (untimed) on first use."""
        tgt = self.engines[key][0]
        if (id(draft), key) not in self.runners:
            runner = build_runner(target, draft, key[1], engine_options(target.device), opts.concurrency)
            self.runners[id(draft), key] = (draft, runner, False)
        _, runner, warm = self.runners[id(draft), key]
        if not warm:
            batch_generate(tgt, ids[: opts.concurrency], 4, draft=runner, tree=tree, eos_ids=target.stop_token_ids())
            self.runners[id(draft), key] = (draft, runner, True)
        return runner


def _ids_key(ids: list[list[int]]) -> tuple:
    return tuple(tuple(p) for p in ids)


def measure_head(target: Target, draft, ids: list[list[int]], opts: SelectOptions) -> dict:
    """One timed run of ``draft`` on ``ids`` through the batched engine at ``opts.concurrency``
    (after an untimed warm-up): tok/s, tau, and the share of requests whose tokens equal plain
    greedy decoding's on the same engine. ``HeadMeter`` keeps the engine for more runs."""
    return HeadMeter()(target, draft, ids, opts)


def decide(rows: list[dict]) -> dict:
    """``fastest``: the highest median tok/s. ``tied``: the candidates whose min-max range overlaps
    the fastest's, itself included (empty without a tie). ``winner``: the earliest checkpoint of a
    tie (the lowest step: the cheaper), else the fastest. ``why``: one sentence."""
    ranked = sorted(rows, key=lambda r: r["tok_s_median"], reverse=True)
    best = ranked[0]
    tied = [r for r in ranked if r["tok_s_min"] <= best["tok_s_max"] and best["tok_s_min"] <= r["tok_s_max"]]
    tie = len(tied) > 1
    win = min(tied, key=lambda r: r["step"]) if tie else best
    if tie:
        spreads = ", ".join(f"{r['checkpoint']} {r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}" for r in tied)
        why = (
            f"{_names(tied)} are tied, their min-max tok/s overlapping the fastest's, {best['checkpoint']}'s "
            f"({spreads}), so the earliest checkpoint, {win['checkpoint']}, ships as the cheaper one"
        )
    elif len(ranked) > 1:
        ru = ranked[1]
        why = (
            f"{best['checkpoint']} is clear of the runner-up: its slowest run ({best['tok_s_min']:.1f} tok/s) "
            f"beats {ru['checkpoint']}'s fastest ({ru['tok_s_max']:.1f} tok/s)"
        )
    else:
        why = f"{best['checkpoint']} is the only candidate measured"
    return {
        "tie": tie,
        "tied": [r["checkpoint"] for r in tied] if tie else [],
        "fastest": best["checkpoint"],
        "winner": win["checkpoint"],
        "why": why,
    }


def _names(rows: list[dict]) -> str:
    names = [r["checkpoint"] for r in rows]
    return ", ".join(names[:-1]) + " and " + names[-1]


def _reason(rows: list[dict], decision: dict, repeats: int) -> str:
    """Why the winner ships, beside the lowest-loss checkpoint: loss ranks, served speed decides."""
    if decision["tie"]:
        return decision["why"]
    win = next(r for r in rows if r["checkpoint"] == decision["winner"])
    lowest = min(rows, key=lambda r: r["val_loss"])
    runs = f"the median of {repeats} run{'s' if repeats > 1 else ''}"
    if win is lowest:
        return f"{win['checkpoint']} has the lowest validation loss and is also the fastest ({win['tok_s']:.1f} tok/s, {runs})"
    return (
        f"{win['checkpoint']} served {win['tok_s']:.1f} tok/s ({runs}; tau {win['tau']:.2f}), "
        f"{win['tok_s'] / lowest['tok_s']:.2f}x the lowest-loss {lowest['checkpoint']} "
        f"({lowest['tok_s']:.1f} tok/s, tau {lowest['tau']:.2f}); loss ranks, served speed decides"
    )


def _report(
    rows: list[dict], opts: SelectOptions, ids: list[list[int]], requests: int, prompt_set: dict, target
) -> dict:
    """The report; it names the target and the prompt set (a file by its name and hash), not paths."""
    decision = decide(rows)
    return {
        "date": datetime.date.today().isoformat(),
        "selection": {
            "candidates": rows,
            "winner": decision["winner"],
            "reason": _reason(rows, decision, opts.repeats),
            "decision": decision,
        },
        "target": target.spec.label,
        "protocol": {
            "prompts": prompt_set["name"],
            "prompts_sha256": prompt_set["sha256"],
            "n": len(ids),
            "requests": requests,  # decoded per run: the prompts, repeated to fill the rows where fewer
            "max_prompt_tokens": max(map(len, ids)),  # the context length this selection tested
            "config": _decoded(rows, opts),
            "concurrency": opts.concurrency,
            "repeats": opts.repeats,
            "max_new_tokens": opts.max_new_tokens,
            "shortlist": opts.shortlist,
        },
        "caveats": _caveats(opts, len(ids), requests, target.device),
    }


def _decoded(rows: list[dict], opts: SelectOptions) -> str:
    """The decode config the candidates ran: ``opts.config``, or a block drafter's ``block-B``."""
    return ", ".join(dict.fromkeys(r.get("config", opts.config) for r in rows))


def _caveats(opts: SelectOptions, prompts: int, requests: int, device) -> list[str]:
    e = engine_options(device)
    filled = ", repeated in turn to fill the rows" if requests > prompts else ""
    return [
        f"Concurrency {opts.concurrency}: each run decodes {requests} requests ({prompts} held-out prompts{filled}), "
        f"up to {opts.max_new_tokens} new tokens each.",
        f"Repeats {opts.repeats}: each candidate ran {opts.repeats} times after one untimed warm-up, in turns "
        "(A1 B1 C1 A2 ...); tok/s is the median and the spread the min-max over those runs, on this machine "
        "only. A candidate whose range overlaps the fastest's is a tie, and the earliest checkpoint of a tie ships.",
        f"Engine: draftling's batched engine (cuda_graphs {e.cuda_graphs}, compile {e.compile}, query_pad "
        f"{e.query_pad}, attention {e.attention}), not vLLM's or SGLang's; plain tok/s, the speedup's baseline, "
        f"timed once on it. Device: {device_name(device)}.",
    ]


def _write(report: dict, out: Path, target: Target, opts: SelectOptions) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report["manifest"] = manifest_fields(
        opts.command,
        {k: str(v) for k, v in dataclasses.asdict(opts).items() if k != "command"},
        target.device,
        report["date"],
    )
    write_json(out / "selection.json", report)
    write_text(out / "selection.md", format_selection(report))


def format_selection(report: dict) -> str:
    s, p = report["selection"], report["protocol"]
    d = s.get("decision") or {"tie": False, "tied": [], "why": s["reason"]}
    lines = [
        f"# Checkpoint selection ({report['date']})",
        "",
        f"{p['n']} held-out prompts ({p['prompts']}) as {p.get('requests', p['n'])} requests per run, "
        f"{p['config']}, concurrency {p['concurrency']}, {p.get('repeats', 1)} runs per candidate, "
        f"up to {p['max_new_tokens']} new tokens; the {p['shortlist']} lowest validation losses measured.",
        "",
        "| checkpoint | val loss | tau | tok/s (median) | min-max | runs | plain tok/s | speedup | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["candidates"]:
        mark = " **(winner)**" if r["checkpoint"] == s["winner"] else ""
        mark += " (tied)" if r["checkpoint"] in d["tied"] else ""
        runs = r.get("tok_s_runs", [r["tok_s"]])
        lines.append(
            f"| {r['checkpoint']}{mark} | {r['val_loss']:.4f} | {r['tau']:.2f} | {r['tok_s']:.1f} | "
            f"{min(runs):.1f}-{max(runs):.1f} | {' / '.join(f'{x:.1f}' for x in runs)} | "
            f"{_num(r.get('plain_tok_s'), '.1f')} | {_num(r.get('speedup'), '.2f', 'x')} | "
            f"{_num(r.get('identical'), '.0%')} |"
        )
    lines += ["", f"Decision: {'a tie' if d['tie'] else 'no tie'}: {d['why']}."]
    if not d["tie"]:
        lines.append(f"Why {s['winner']}: {s['reason']}.")
    if "adaptation" in report:
        a = report["adaptation"]
        lines += [
            "",
            f"Adaptation ({a['workload']}, {a['prompts']} prompts): base tau {a['base']['tau']:.2f}, "
            f"{a['base']['tok_s']:.1f} tok/s; adapted tau {a['adapted']['tau']:.2f}, "
            f"{a['adapted']['tok_s']:.1f} tok/s (medians).",
        ]
    lines += ["", "Caveats:", ""] + [f"- {c}" for c in report.get("caveats", [])]
    lines += [
        "- Speedup is the median tok/s against the same engine without speculation in the same process. "
        "Tau counts the bonus token.",
    ]
    if any(r.get("identical", 1) < 1 for r in s["candidates"]):
        lines += [
            "",
            "Identical to plain below 100%: this engine runs unpadded, so a verify pass's logits can differ "
            "in the last bits from a plain pass's (bf16), and greedy continuations part at near-ties; "
            "`bench --release` pads queries and checks identity.",
        ]
    return "\n".join(lines) + "\n"


def _num(v, fmt: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{unit}"
