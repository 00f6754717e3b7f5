"""`draftling select RUN_DIR --data DATA --prompts HELD_OUT`: the checkpoint to ship, chosen by
served speed.

Validation loss only shortlists: the ``shortlist`` checkpoints of lowest loss on DATA's
validation split (scored afresh, so every candidate is measured alike). Each then decodes the
held-out prompts through the batched engine at the concurrency asked for, against the same
engine without speculation, and the fastest by measured tok/s wins; tau and the identity with
plain greedy decoding are shown beside it. ``--base DIR`` also measures a base head on the same
prompts: the adaptation report (base against the winner). The report is JSON plus markdown.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from pathlib import Path

import torch

from draftling.bench.concurrency import timed_after_warmup
from draftling.bench.manifest import manifest_fields
from draftling.bench.release import load_prompt_set
from draftling.bench.simple import build_engine, parse_decode_config
from draftling.config import load_config
from draftling.data.tokenized import load_tokenized
from draftling.engine import EngineOptions
from draftling.engine.generate import batch_generate
from draftling.errors import DraftlingError
from draftling.export.formats import load_any_draft
from draftling.io import write_json, write_text
from draftling.progress import Progress
from draftling.target import Target
from draftling.train.batches import evaluate
from draftling.train.checkpoint import list_checkpoints


@dataclass(frozen=True)
class SelectOptions:
    prompts: str  # held-out prompts: a prompt-set name or a jsonl path, task-disjoint from training
    data: str  # the run's data directory: its val.jsonl scores the loss
    shortlist: int = 3
    config: str = "tree-3-4-8"
    concurrency: int = 1
    max_new_tokens: int = 128
    base: str | None = None  # a base head measured on the same prompts
    out: str | None = None  # the report's folder; default RUN_DIR/selection
    command: str | None = None


def select_checkpoint(target: Target, run_dir, opts: SelectOptions, measure=None) -> dict:
    """The selection report (see the module doc), written to ``opts.out``. ``measure``: how a
    head is timed (default ``measure_head``; tests pass their own)."""
    run_dir = Path(run_dir)
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
    shortlist = sorted(cands, key=lambda c: losses[c])[: opts.shortlist]
    info, prompts = load_prompt_set(opts.prompts, target)
    ids = [p.input_ids for p in prompts]
    rows = measure_shortlist(target, shortlist, losses, ids, opts, measure or measure_head)
    report = _report(rows, opts, ids, info, target.spec.label)
    if opts.base:
        base = measure(target, load_any_draft(opts.base, target.device, _dtype(target)), ids, opts)
        win = next(r for r in rows if r["checkpoint"] == report["selection"]["winner"])
        report["adaptation"] = {
            "workload": _workload(prompts),
            "prompts": len(ids),
            "base": {k: base[k] for k in ("tau", "tok_s")},
            "adapted": {k: win[k] for k in ("tau", "tok_s")},
        }
    _write(report, Path(opts.out or run_dir / "selection"), target, opts)
    return report


def measure_shortlist(
    target: Target, shortlist: list[Path], losses: dict, ids, opts: SelectOptions, measure
) -> list[dict]:
    """One row per shortlisted checkpoint: its validation loss and what ``measure`` gives."""
    rows = []
    with Progress(len(shortlist), "select: served speed", bar=False) as progress:
        for i, c in enumerate(shortlist):
            m = measure(target, load_any_draft(c, target.device, _dtype(target)), ids, opts)
            rows.append({"checkpoint": c.name, "val_loss": losses[c], **m})
            progress.update(
                1, f"select: served speed {i + 1}/{len(shortlist)}: {c.name} {m['tok_s']:.1f} tok/s, tau {m['tau']:.2f}"
            )
    return rows


def _dtype(target: Target) -> torch.dtype:
    return next(target.model.parameters()).dtype


def _workload(prompts) -> str:
    return ",".join(dict.fromkeys(p.workload for p in prompts))


def val_loss(target: Target, ckpt: Path, run_cfg, examples) -> float:
    """The checkpoint's TTT loss on the validation ``examples``, as the trainer scores it."""
    draft = load_any_draft(ckpt, target.device, torch.float32)
    with torch.no_grad():
        return float(evaluate(draft, target, examples, run_cfg, target.device, run_cfg.train.max_val_batches)["loss"])


def measure_head(target: Target, draft, ids: list[list[int]], opts: SelectOptions) -> dict:
    """tok/s and tau of ``draft`` on ``ids`` through the batched engine at ``opts.concurrency``,
    and the share of requests whose tokens equal plain greedy decoding's on the same engine."""
    c = parse_decode_config(opts.config)
    engine = EngineOptions(cuda_graphs="auto", compile=False, query_pad=0, attention="auto").resolve(target.device)
    max_len = max(map(len, ids)) + opts.max_new_tokens + c.draft_tokens + 8
    tgt, runner = build_engine(target, draft, max_len, engine, batch_size=opts.concurrency)
    eos = target.stop_token_ids()
    tree = (c.steps, c.topk, c.draft_tokens)
    plain, plain_s = timed_after_warmup(  # the same engine without speculation: the baseline
        tgt,
        lambda: batch_generate(tgt, ids, opts.max_new_tokens, eos_ids=eos),
        lambda: batch_generate(tgt, ids[: opts.concurrency], 4, eos_ids=eos),
    )
    out, seconds = timed_after_warmup(
        tgt,
        lambda: batch_generate(tgt, ids, opts.max_new_tokens, draft=runner, tree=tree, eos_ids=eos),
        lambda: batch_generate(tgt, ids[: opts.concurrency], 4, draft=runner, tree=tree, eos_ids=eos),
    )
    lengths = [a for r in out for a in r.stats.accept_lengths]
    tok_s, plain_tok_s = sum(len(r.tokens) for r in out) / seconds, sum(len(r.tokens) for r in plain) / plain_s
    return {
        "tok_s": tok_s,
        "tau": sum(lengths) / max(1, len(lengths)),
        "plain_tok_s": plain_tok_s,
        "speedup": tok_s / plain_tok_s,
        "identical": sum(a.tokens == b.tokens for a, b in zip(out, plain)) / len(out),
    }


def _report(rows: list[dict], opts: SelectOptions, ids: list[list[int]], prompt_set: dict, target: str) -> dict:
    """The report; it names the target and the prompt set (a file by its name and hash), not paths."""
    win = max(rows, key=lambda r: r["tok_s"])
    lowest = min(rows, key=lambda r: r["val_loss"])
    if win is lowest:
        reason = (
            f"{win['checkpoint']} has the lowest validation loss and is also the fastest ({win['tok_s']:.1f} tok/s)"
        )
    else:
        reason = (
            f"{win['checkpoint']} served {win['tok_s']:.1f} tok/s (tau {win['tau']:.2f}), "
            f"{win['tok_s'] / lowest['tok_s']:.2f}x the lowest-loss {lowest['checkpoint']} "
            f"({lowest['tok_s']:.1f} tok/s, tau {lowest['tau']:.2f}); loss ranks, served speed decides"
        )
    return {
        "date": datetime.date.today().isoformat(),
        "selection": {"candidates": rows, "winner": win["checkpoint"], "reason": reason},
        "target": target,
        "protocol": {
            "prompts": prompt_set["name"],
            "prompts_sha256": prompt_set["sha256"],
            "n": len(ids),
            "max_prompt_tokens": max(map(len, ids)),  # the context length this selection tested
            "config": opts.config,
            "concurrency": opts.concurrency,
            "max_new_tokens": opts.max_new_tokens,
            "shortlist": opts.shortlist,
        },
    }


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
    lines = [
        f"# Checkpoint selection ({report['date']})",
        "",
        f"{p['n']} held-out prompts ({p['prompts']}), {p['config']}, concurrency {p['concurrency']}, "
        f"up to {p['max_new_tokens']} new tokens; the {p['shortlist']} lowest validation losses measured.",
        "",
        "| checkpoint | val loss | tau | tok/s | plain tok/s | speedup | identical to plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in s["candidates"]:
        mark = " **(winner)**" if r["checkpoint"] == s["winner"] else ""
        lines.append(
            f"| {r['checkpoint']}{mark} | {r['val_loss']:.4f} | {r['tau']:.2f} | {r['tok_s']:.1f} | "
            f"{_num(r.get('plain_tok_s'), '.1f')} | {_num(r.get('speedup'), '.2f', 'x')} | "
            f"{_num(r.get('identical'), '.0%')} |"
        )
    lines += ["", f"Why: {s['reason']}."]
    if "adaptation" in report:
        a = report["adaptation"]
        lines += [
            "",
            f"Adaptation ({a['workload']}, {a['prompts']} prompts): base tau {a['base']['tau']:.2f}, "
            f"{a['base']['tok_s']:.1f} tok/s; adapted tau {a['adapted']['tau']:.2f}, "
            f"{a['adapted']['tok_s']:.1f} tok/s.",
        ]
    lines += [
        "",
        "tok/s: measured after an untimed warm-up, on this machine only; speedup is against the "
        "same engine without speculation in the same process. Tau counts the bonus token.",
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
