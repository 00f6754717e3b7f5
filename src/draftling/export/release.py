"""`draftling release RUN --out DIR`: a folder a model hub takes as it is.

It holds the export (SGLang format by default, speculators with ``--format speculators``; a
dflash head has speculators' dflash layout only), a model card (README.md with the hub's YAML
metadata), and ``serving.json``: the vLLM ``speculative_config`` dict and the launch commands
(vLLM's, and SGLang's for an EAGLE-3 head). The folder is built aside
and renamed into place, so a failed release leaves nothing half-written.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from draftling.config import load_config
from draftling.draft.block import METHOD as BLOCK_METHOD
from draftling.draft.model import NORM_FLAGS
from draftling.draft.store import WEIGHTS_FILE, load_draft
from draftling.errors import DraftlingError
from draftling.export.cli import DEFAULT_TARGET_HUB_ID, check_weight_fingerprint, export_draft
from draftling.io import OUTPUT_MARKER, atomic_dir, check_output_dir, write_json, write_text
from draftling.network import hub_unreachable
from draftling.target.fingerprint import describe

DEFAULT_CONFIG = (3, 4, 8)  # steps, topk, draft tokens: tree-3-4-8, the v1 release bench's best mean


@dataclass(frozen=True)
class ReleaseSpec:
    run_dir: str
    out: str
    fmt: str | None = None  # None: sglang for an EAGLE-3 head, speculators for a dflash head
    target_id: str = DEFAULT_TARGET_HUB_ID  # the verifier's hub id, as serving engines load it
    repo: str | None = None  # where the folder will live on the hub (names the draft in the commands)
    bench: str | None = None  # a release-bench results JSON: the card's table and the serving config
    overwrite: bool = False
    # What ships: "final" (RUN/draft), a checkpoint's name, or None = the winner of RUN's
    # `draftling select` report where there is one, else the final head.
    checkpoint: str | None = None
    serve_check: str | None = None  # a `draftling serve-check` results JSON: vLLM's figures in the card
    weight_fingerprint: bool = False  # the export's target fingerprint also hashes a sample of the weights


SELECTION = Path("selection") / "selection.json"  # where `draftling select` writes by default


def shipped_head(run: Path, checkpoint: str | None) -> tuple[Path, dict | None]:
    """The head directory to ship, and the selection report that chose it (or None)."""
    selection = None
    if checkpoint is None and (run / SELECTION).is_file():
        selection = json.loads((run / SELECTION).read_text())
        checkpoint = selection["selection"]["winner"]
    head = run / "draft" if checkpoint in (None, "final") else run / "checkpoints" / checkpoint
    if not (head / WEIGHTS_FILE).is_file():
        what = (
            "no final draft (run/draft); finish or --resume the training first"
            if head.name == "draft"
            else f"no checkpoint {checkpoint} (checkpoints/{checkpoint}/{WEIGHTS_FILE})"
        )
        raise DraftlingError(f"{run}: {what}")
    return head, selection


def release(spec: ReleaseSpec, target) -> Path:
    run = Path(spec.run_dir)
    draft_dir, selection = shipped_head(run, spec.checkpoint)
    config = load_draft(draft_dir).config
    if spec.fmt is None:
        spec = dataclasses.replace(spec, fmt="speculators" if _is_block(config) else "sglang")
    bench = _read_json(spec.bench, "--bench", "a release-bench results JSON")
    served = _read_json(spec.serve_check, "--serve-check", "a serve-check results JSON")
    check_output_dir(spec.out, "release", spec.overwrite)
    check_weight_fingerprint(spec.weight_fingerprint, spec.fmt, target is not None)
    with atomic_dir(spec.out) as tmp:
        export_draft(
            draft_dir,
            tmp / "export",
            spec.fmt,
            False,
            target,
            "bfloat16",
            verifier_id=spec.target_id if spec.fmt == "speculators" else None,
            weight_fingerprint=spec.weight_fingerprint,
        )
        recorded = (json.loads((tmp / "export" / "config.json").read_text()).get("draftling") or {}).get(
            "target_fingerprint"
        )
        for f in (tmp / "export").iterdir():  # the export's files at the folder's top, as hubs serve them
            f.rename(tmp / f.name)
        (tmp / "export").rmdir()
        serving = serving_configs(spec, config, bench)
        write_json(tmp / "serving.json", serving)
        card = model_card(spec, run, recorded, serving, bench, served)
        write_text(tmp / "README.md", card + "\n" + _selection_section(draft_dir, selection))
        files = sorted(p.name for p in tmp.iterdir() if p.name != OUTPUT_MARKER)
        write_json(tmp / OUTPUT_MARKER, {"kind": "release", "files": files})
    return Path(spec.out)


def _read_json(path: str | None, flag: str, what: str) -> dict | None:
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DraftlingError(f"{flag} {path}: not {what} ({e})") from None


def chosen_config(bench: dict | None) -> tuple[tuple[int, int, int], str]:
    """(steps, topk, draft tokens) to serve with, and which bench chose it: the config with the
    release bench's best mean speedup, else DEFAULT_CONFIG."""
    configs = [c for c in (bench or {}).get("configs", []) if c.get("mean_speedup") is not None]
    if not configs:
        return DEFAULT_CONFIG, (
            "no release bench was given: draftling's default tree-3-4-8, the best mean "
            "speedup of the v1 release bench of the GPU recipe head (BENCHMARKS.md)"
        )
    best = max(configs, key=lambda c: c["mean_speedup"])
    why = (
        f"the best mean speedup ({best['mean_speedup']:.2f}x) of the release bench of {bench.get('date')} "
        f"({_engine_words(bench)}, prompt set {(bench.get('prompt_set') or {}).get('name')})"
    )
    return (int(best["steps"]), int(best["topk"]), int(best["draft_tokens"])), f"{best['name']}: {why}"


def _engine_words(bench: dict) -> str:
    """Which engine measured a release bench's speeds, on what, at what concurrency."""
    return f"the engine of {bench.get('engine', 'draftling')} on {bench.get('gpu')}, {bench.get('dtype')}, batch 1"


def _is_block(draft_config) -> bool:
    return getattr(draft_config, "draft_method", None) == BLOCK_METHOD


def serving_configs(spec: ReleaseSpec, draft_config, bench: dict | None = None) -> dict:
    if _is_block(draft_config):
        return _block_serving(spec, draft_config)
    (steps, topk, tokens), why = chosen_config(bench)
    draft = spec.repo or "<path to this folder>"
    # vLLM's EAGLE-3 proposes a chain: the chosen config's depth; the tree's width is SGLang's.
    vllm = {"method": "eagle3", "model": draft, "num_speculative_tokens": steps}
    return {
        "target": spec.target_id,
        "draft": draft,
        "format": spec.fmt,
        "chosen_by": why,
        "max_position_embeddings": int(getattr(draft_config, "max_position_embeddings", 0)),
        "vllm": {
            "speculative_config": vllm,
            "command": f"vllm serve {spec.target_id} --speculative-config '{json.dumps(vllm)}'",
        },
        "sglang": {
            "command": (
                f"python -m sglang.launch_server --model-path {spec.target_id} "
                f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} "
                f"--speculative-num-steps {steps} --speculative-eagle-topk {topk} "
                f"--speculative-num-draft-tokens {tokens}"
            )
        },
    }


def _block_serving(spec: ReleaseSpec, draft_config) -> dict:
    """A dflash head serves its one shape: a block of ``block_size - 1`` drafts a round. Its export
    is in speculators' dflash layout, which vLLM reads; SGLang's DFLASH loader reads another."""
    draft = spec.repo or "<path to this folder>"
    k = int(draft_config.block_size) - 1
    vllm = {"method": "dflash", "model": draft, "num_speculative_tokens": k}
    return {
        "target": spec.target_id,
        "draft": draft,
        "format": spec.fmt,
        "chosen_by": f"the head's block of {k + 1} (block-{k + 1}: {k} drafts a round, one drafting pass)",
        "max_position_embeddings": int(getattr(draft_config, "max_position_embeddings", 0)),
        "vllm": {
            "speculative_config": vllm,
            "command": f"vllm serve {spec.target_id} --speculative-config '{json.dumps(vllm)}'",
        },
        "sglang": None,
    }


def model_card(
    spec: ReleaseSpec, run: Path, fp: dict | None, serving: dict, bench: dict | None, served: dict | None = None
) -> str:
    """``fp``: the target fingerprint the export records (None: it records none)."""
    result = json.loads((run / "train_result.json").read_text()) if (run / "train_result.json").is_file() else {}
    lines = [
        *_card_head(spec, fp, serving),
        "## Training",
        "",
        *_data_lines(run),
        *_variant_lines(run),
        f"- steps: {result.get('steps', '?')}; validation: "
        + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in (result.get("val") or {}).items()
            if isinstance(v, (int, float))
        ),
        "",
    ]
    lines += _bench_section(bench) + _served_section(served)
    lines += _serving_section(serving)
    return "\n".join(lines)


def _variant_lines(run: Path) -> list[str]:
    """The EAGLE-3.1 options the head was trained with, where any (engines read them from its config)."""
    path = run / "draft" / "draft_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    on = [k for k in NORM_FLAGS if config.get(k)]
    return [f"- EAGLE-3.1 options: {', '.join(on)} (in the export's config; vLLM 0.32 reads them)"] if on else []


def _card_head(spec: ReleaseSpec, fp: dict | None, serving: dict) -> list[str]:
    """The card's front matter, what the head is, and its target."""
    block = serving["vllm"]["speculative_config"]["method"] == BLOCK_METHOD
    return [
        "---",
        f"base_model: {spec.target_id}",
        "library_name: draftling",
        "license: apache-2.0",
        "tags:",
        "- speculative-decoding",
        f"- {BLOCK_METHOD if block else 'eagle3'}",
        "- draft-model",
        "---",
        "",
        *(_block_lines(spec, serving) if block else _eagle3_lines(spec)),
        "## Target",
        "",
        f"- {spec.target_id}; "
        + (
            f"the export's checkpoint fingerprint: {describe(fp)} (`draftling check` compares them)."
            if fp
            else "the export records no checkpoint fingerprint."
        ),
        f"- context length of the head's config: {serving['max_position_embeddings']} positions",
        "",
    ]


def _eagle3_lines(spec: ReleaseSpec) -> list[str]:
    return [
        f"# EAGLE-3 draft head for {spec.target_id}",
        "",
        f"A one-layer EAGLE-3 draft head ({spec.fmt} format) trained with draftling to speed up "
        f"{spec.target_id} by speculative decoding. Output is the target's: verification is lossless.",
        "",
        "The export omits the embedding: serving engines share the target's own. It holds the fused "
        "feature layer, one decoder layer, the norm, the draft-vocabulary output head and the d2t/t2d "
        "vocabulary maps.",
        "",
    ]


def _block_lines(spec: ReleaseSpec, serving: dict) -> list[str]:
    k = serving["vllm"]["speculative_config"]["num_speculative_tokens"]
    return [
        f"# DFlash block draft head for {spec.target_id}",
        "",
        f"A block-parallel (DFlash) draft head (speculators' dflash layout) trained with draftling to speed up "
        f"{spec.target_id} by speculative decoding: one forward pass proposes {k} tokens, which the target "
        "verifies as a chain. Output is the target's: verification is lossless.",
        "",
        "The export omits the embedding: serving engines share the target's own. It holds the context "
        "projection of the target's hidden states (fc, hidden_norm), the decoder layers, the norm, the "
        "draft-vocabulary output head and the d2t/t2d vocabulary maps.",
        "",
    ]


def _serving_section(serving: dict) -> list[str]:
    """How to serve it: vLLM's command and speculative_config, SGLang's command."""
    if serving["sglang"] is None:
        how = "vLLM reads this layout (`method: dflash`); SGLang's DFLASH loader reads another, so no SGLang line."
    else:
        how = "vLLM's EAGLE-3 drafts a chain, so its line takes the config's depth; SGLang's takes the whole tree."
    lines = [
        "## Serving",
        "",
        f"Config: {serving['chosen_by']}. {how}",
        "",
        "vLLM:",
        "",
        "```bash",
        serving["vllm"]["command"],
        "```",
        "",
        "`speculative_config` for frameworks that embed vLLM:",
        "",
        "```json",
        json.dumps(serving["vllm"]["speculative_config"], indent=2),
        "```",
        "",
    ]
    if serving["sglang"] is not None:
        lines += ["SGLang:", "", "```bash", serving["sglang"]["command"], "```", ""]
    return lines


def _data_lines(run: Path) -> list[str]:
    """The run's data and its split, from the config the run recorded."""
    if not (run / "config.yaml").is_file():
        return []
    cfg = load_config(run / "config.yaml")
    dc, tc = cfg.data, cfg.train
    how = "; agent rollouts (each assistant turn a prompt, the target's reply its only loss)" if dc.rollouts else ""
    held = f"; ids of {', '.join(Path(f).name for f in dc.exclude_ids)} kept out" if dc.exclude_ids else ""
    split = "task when the records carry a task identity, else id" if dc.split_key == "auto" else dc.split_key
    return [
        f"- data: replies the target wrote to {', '.join(dc.prompts)}{how}, up to {dc.max_tokens} tokens "
        f"a sequence; split by {split}, {dc.val_fraction:.0%} of tasks to validation{held}",
        f"- recipe: {tc.epochs:g} epochs, batch {tc.batch_size}, lr {tc.lr:g}, {tc.ttt_steps} TTT steps"
        + (f", warm-started from {Path(cfg.draft.init_from).name}" if cfg.draft.init_from else ""),
    ]


def _selection_section(head: Path, selection: dict | None) -> str:
    """Which head ships, and the served-speed selection that picked it."""
    lines = [
        "## Checkpoint",
        "",
        f"This folder holds `{head.parent.name}/{head.name}`" + (" (the final head)." if head.name == "draft" else "."),
    ]
    if selection:
        sel = selection["selection"]
        tested = selection.get("protocol", {}).get("max_prompt_tokens")
        proto, machine = selection.get("protocol", {}), (selection.get("manifest") or {}).get("machine", "?")
        lines += [
            f"`draftling select` chose it by served speed: {sel['reason']}"
            + (f" Context length tested: prompts of up to {tested} tokens." if tested else ""),
            "",
            f"Speeds measured by draftling's batched engine ({machine}), {proto.get('config', '?')}, "
            f"concurrency {proto.get('concurrency', '?')}; not vLLM's or SGLang's.",
            "",
            "| checkpoint | val loss | tau | tok/s |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {c['checkpoint']} | {c['val_loss']:.4f} | {c['tau']:.2f} | {c['tok_s']:.1f} |"
            for c in sel["candidates"]
        ]
        if selection.get("adaptation"):
            a = selection["adaptation"]
            lines += [
                "",
                f"Adapted to {a['workload']} ({a['prompts']} held-out prompts): tau {a['base']['tau']:.2f} -> "
                f"{a['adapted']['tau']:.2f}, {a['base']['tok_s']:.1f} -> {a['adapted']['tok_s']:.1f} tok/s "
                "against the base head.",
            ]
    return "\n".join(lines + [""])


def _bench_section(bench: dict | None) -> list[str]:
    if not bench:
        return ["## Speed", "", "No release bench was given (`draftling bench --release`, then `--bench FILE`).", ""]
    rows = ["| config | mean speedup | mean tau |", "|---|---|---|"]
    rows += [f"| {c['name']} | {c['mean_speedup']:.2f}x | {c['mean_tau']:.2f} |" for c in bench.get("configs", [])]
    return (
        [
            "## Speed",
            "",
            f"Release bench, {bench.get('date')}, measured by {_engine_words(bench)} (one "
            f"request at a time), prompt set {(bench.get('prompt_set') or {}).get('name')}; speedup over the same "
            "engine without speculation, tau counting the bonus token. These are not vLLM's or SGLang's speeds:",
            "",
        ]
        + rows
        + ["", "Caveats:", ""]
        + [f"- {c}" for c in bench.get("caveats", [])]
        + [""]
    )


def _served_section(served: dict | None) -> list[str]:
    """vLLM's own acceptance of the export beside draftling's engine's (`draftling serve-check`)."""
    if not served:
        return [
            "## Served by vLLM",
            "",
            "Not checked: `draftling serve-check EXPORT --out FILE`, then `release --serve-check FILE`.",
            "",
        ]
    rows = [
        "| format | config | engine (device) | tau | draftling's engine tau | ratio | within band |",
        "|---|---|---|---|---|---|---|",
    ]
    rows += [
        f"| {r['format']} | {r['config']} | vLLM {r['vllm_version']} ({r['device']}) | {r['tau_vllm']:.2f} | "
        f"{r['tau_draftling']:.2f} ({r.get('draftling_device', '?')}) | {r['ratio']:.3f} | "
        f"{'yes' if r['within_band'] else 'NO'} (+-{r['band']:.0%}) |"
        for r in served.get("vllm_check", [])
    ]
    versions = sorted({f"vLLM {r['vllm_version']} ({r['device']})" for r in served.get("vllm_check", [])})
    return (
        [
            "## Served by vLLM",
            "",
            f"`draftling serve-check`, {served.get('date')}: the export loaded as vLLM's "
            "EAGLE-3 speculator, greedy, tau from vLLM's own spec-decode counters (bonus token counted), beside "
            f"draftling's engine on the same prompts. Engine versions checked: {', '.join(versions)}.",
            "",
        ]
        + rows
        + [""]
        + [f"- {c}" for c in served.get("caveats", [])]
        + [""]
    )


def push(folder: Path, repo: str) -> str:
    """Upload the release folder with huggingface_hub; one clear line where no hub is reachable."""
    why = hub_unreachable()
    if why:
        raise DraftlingError(
            f"--push {repo}: the hub is out of reach ({why}); the release is in {folder}, "
            "upload it from a machine with network access"
        )
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo)
    return f"https://huggingface.co/{repo}"
