"""Issue 26 item 3 on one GPU: a teacher split by ``--device-map FILE`` against the same teacher
loaded whole. The aux states, logits and a short online training run must agree.

    python lab/gpu/device_map_check.py --target GGUF --out DIR   # on a GPU (device_map_check.sh)
    python lab/gpu/device_map_check.py --smoke --out DIR         # tiny random Llama, CPU + disk

The map is built here and written to DIR/device_map.json: the embedding and the first half of
the decoder layers on cuda:0; the other layers, the final norm and lm_head on "cpu". Both loads
go through ``load_target_from_config``, the path every command uses; only ``device_map`` differs.

What the split is. With a GPU in the map, accelerate keeps a "cpu" module's weights in host RAM
and copies them to the GPU for each call: the module RUNS ON THE GPU (dispatch_model's
execution device). Nothing is computed on the CPU, so the same kernels see the same bf16
values, and the states should be bitwise equal. There is no CPU-vs-GPU bf16 gap to allow
for, and an fp32 rerun would test nothing more. A tied lm_head (SmolLM2) is re-tied to the
resident embedding, so it stays on the GPU whatever the map says; "split" records where each
module really is. In --smoke the device has no GPU: the split is "cpu" and "disk", and the
disk modules are loaded from the offload folder for each call.

Tolerances (TOL):
- forward: relative max difference (max|a-b| / max|a|) at most 1e-3, below one bf16 step
  (2^-7). Argmax agreement at least 0.999.
- training: 20 steps, same seed and data, for each teacher, and again with the whole teacher
  (``repeat``). The repeat measures the run-to-run noise of GPU training (compiled kernels,
  atomics). Loss and weight differences of split vs whole must stay within NOISE_FACTOR times
  that noise, or within the floors in TOL when the noise is zero. Both runs set
  ``train.compile_teacher=false``: accelerate's hooked layers always run eager
  (aux.compiled_decoder_layers), so a compiled whole teacher would differ by kernel, not by
  placement. Likewise ``train.memory_policy=config``: the auto policy plans from the teacher's
  share of the GPU, which the map changes. tok/s is the median over steps after warm-up, from metrics.jsonl.

Writes DIR/device-map-check.json, DIR/device_map.json, DIR/runs/{single,split,repeat}/ (each
run's metrics.jsonl, config.yaml and train_result.json; the heads are compared, then removed)
and DIR/manifest.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

_ROOT = str(Path(__file__).resolve().parents[2])  # this checkout, for lab.benches
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from draftling.bench.manifest import device_name, write_manifest
from draftling.bench.release import load_prompt_set
from draftling.config import load_config
from draftling.draft.vocab import build_vocab_file, load_vocab
from draftling.io import write_json, write_jsonl
from draftling.target import load_target_from_config
from draftling.target.devmap import dispatched_devices, execution_device
from draftling.target.load import load_target_config
from draftling.timing import sync
from draftling.train.teacher import teacher_forward
from draftling.train.trainer import train

TOL = {"forward_rel": 1e-3, "argmax_agreement_min": 0.999, "loss_abs_floor": 1e-3, "weights_rel_floor": 1e-3}
NOISE_FACTOR = 2.0
RUNS = ("single", "split", "repeat")


@dataclasses.dataclass
class Settings:
    compare_prompts: int = 8  # v1 prompts for the forward comparison, round robin over workloads
    reply_tokens: int = 64  # greedy reply per v1 prompt: the training data
    val_rows: int = 8
    steps: int = 20
    warm_steps: int = 5  # left out of the tok/s median (compile, allocator)
    profile: str | None = "lab/configs/gpu_smollm2.yaml"  # from the checkout
    overrides: tuple[str, ...] = ("train.batch_size=8", "train.warmup_steps=5", "train.max_val_batches=2")


def smoke_settings() -> Settings:
    return Settings(
        compare_prompts=4,
        reply_tokens=12,
        val_rows=4,
        steps=4,
        warm_steps=1,
        profile=None,
        overrides=("train.batch_size=4", "train.ttt_steps=2", "train.warmup_steps=1", "train.lr=1e-3", "vocab.size=64"),
    )


def tiny_target_dir(folder: Path) -> Path:
    """A tiny random Llama (untied head: transformers cannot disk-offload a tied one) with a
    word-level tokenizer and a chat template; tests/target/test_device_map.py trains on it too."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = 300
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w2", pad_token="w0", eos_token="w1")
    tok.chat_template = (
        "{% for m in messages %}w3 {{ m['content'] }} w1 {% endfor %}{% if add_generation_prompt %}w4 {% endif %}"
    )
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def split_map(num_layers: int, near, far) -> dict:
    """Embedding and layers [0, L/2) on ``near``; layers [L/2, L), final norm and lm_head on ``far``."""
    half = num_layers // 2
    layers = {f"model.layers.{i}": near if i < half else far for i in range(num_layers)}
    return {"model.embed_tokens": near, "model.rotary_emb": near, **layers, "model.norm": far, "lm_head": far}


def split_summary(model, declared: dict) -> dict:
    """Modules per device as the map says, and where they really are: resident (weights on a
    device) or streamed (offloaded: weights in host RAM or on disk, brought in per call)."""
    modules = dict(model.named_modules())
    mapped, really = {}, {}
    for name, device in declared.items():
        mapped[str(device)] = mapped.get(str(device), 0) + 1
        params = list(modules[name].parameters())
        if not params:
            continue  # rotary_emb: buffers only
        where = (
            f"streamed from {device}, runs on {execution_device(modules[name])}"
            if params[0].device.type == "meta"
            else f"resident on {params[0].device}"
        )
        really[where] = really.get(where, 0) + 1
    return {"modules_per_device": mapped, "effective": really, "devices": [str(d) for d in dispatched_devices(model)]}


def pick_prompts(target, n: int) -> list[list[int]]:
    """v1 prompts through the target's chat template, round robin over workloads."""
    _, prompts = load_prompt_set("v1", target)
    by_w: dict[str, list] = {}
    for p in prompts:
        by_w.setdefault(p.workload, []).append(p.input_ids)
    rounds = [ids for k in range(max(map(len, by_w.values()))) for ids in (v[k] for v in by_w.values() if k < len(v))]
    return rounds[:n] if n else rounds


def rel(diff: float, scale: float) -> float:
    return diff / scale if scale else float(diff != 0)


class Gap:
    """The largest difference between two loads' tensors, over prompts."""

    def __init__(self):
        self.diff, self.scale = 0.0, 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        a, b = a.float(), b.to(a.device).float()
        self.diff = max(self.diff, float((a - b).abs().max()))
        self.scale = max(self.scale, float(a.abs().max()))

    def record(self) -> dict:
        return {"max_abs_diff": self.diff, "rel_diff": rel(self.diff, self.scale), "max_abs": self.scale}


@torch.no_grad()
def forward_pass(target, prompts: list[list[int]], t2d: torch.Tensor) -> tuple[list, float]:
    """Per prompt (batch 1): the teacher's outputs and the full logits; and tokens per second."""
    device = target.device
    ids = [torch.tensor([p], device=device) for p in prompts]
    teacher_forward(target, ids[0], torch.ones_like(ids[0]), t2d)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    outs = [(teacher_forward(target, x, torch.ones_like(x), t2d), target.model(input_ids=x).logits) for x in ids]
    sync(device)
    return outs, sum(map(len, prompts)) / (time.perf_counter() - t0)


def compare_forward(whole, split, prompts: list[list[int]], t2d: torch.Tensor) -> dict:
    (a_outs, a_tok_s), (b_outs, b_tok_s) = (forward_pass(t, prompts, t2d) for t in (whole, split))
    aux, logits, draft_logits = Gap(), Gap(), Gap()
    agree = positions = 0
    for (ta, la), (tb, lb) in zip(a_outs, b_outs):
        aux.add(ta.aux, tb.aux)
        logits.add(la, lb)
        draft_logits.add(ta.draft_logits, tb.draft_logits)
        agree += int((la.argmax(-1).cpu() == lb.argmax(-1).cpu()).sum())
        positions += la.shape[1]
    return {
        "prompts": len(prompts),
        "tokens": sum(map(len, prompts)),
        "aux": aux.record(),
        "logits": logits.record(),
        "draft_logits": draft_logits.record(),
        "argmax_agreement": agree / positions,
        "tok_s_single": a_tok_s,
        "tok_s_split": b_tok_s,
    }


@torch.no_grad()
def greedy_replies(target, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The whole target's greedy replies (HF generate, one left-padded batch), cut at a stop."""
    stops, pad = target.stop_token_ids(), int(target.tokenizer.pad_token_id or 0)
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=target.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device)
    out = target.model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=pad,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    replies = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        replies.append(row[: cut + 1] if cut < len(row) else row)
    return replies


def write_data(whole, folder: Path, s: Settings, vocab_size: int) -> Path:
    """train.jsonl / val.jsonl (every v1 prompt and its greedy reply) and the draft vocab."""
    prompts = pick_prompts(whole, 0)
    rows = [
        {"id": f"v1-{i}", "source": "v1+greedy", "input_ids": p + r, "loss_mask": [0] * len(p) + [1] * len(r)}
        for i, (p, r) in enumerate(zip(prompts, greedy_replies(whole, prompts, s.reply_tokens)))
        if r
    ]
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "train.jsonl", rows[: -s.val_rows])
    write_jsonl(folder / "val.jsonl", rows[-s.val_rows :])
    build_vocab_file(folder / "train.jsonl", whole.config.vocab_size, vocab_size, folder / "vocab.safetensors")
    return folder


def train_run(cfg, target, data: Path, run_dir: Path) -> dict:
    """The library's online training (what `draftling train` runs after loading the target)."""
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    train(cfg, target, run_dir, data / "train.jsonl", data / "val.jsonl", data / "vocab.safetensors")
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("split") == "train"]
    return {
        "loss": [r["loss"] for r in steps],
        "tok_s": [r["tok_s"] for r in steps],
        "wall_s": wall,
        "weights": load_file(str(run_dir / "draft" / "draft.safetensors")),
    }


def weight_gap(a: dict, b: dict) -> dict:
    """Largest per-tensor max|a-b| / max|a| over the draft's tensors, and which tensor."""
    if a.keys() != b.keys():
        raise SystemExit(f"device-map-check: the drafts' tensors differ: {sorted(a.keys() ^ b.keys())}")
    worst, name, abs_diff = 0.0, None, 0.0
    for key in sorted(a):
        diff = float((a[key].float() - b[key].float()).abs().max()) if a[key].numel() else 0.0
        r = rel(diff, float(a[key].float().abs().max()) if a[key].numel() else 0.0)
        abs_diff = max(abs_diff, diff)
        if r > worst:
            worst, name = r, key
    return {"max_rel_diff": worst, "worst_tensor": name, "max_abs_diff": abs_diff}


def curve_gap(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=math.inf) if len(a) == len(b) else math.inf


def median_tok_s(run: dict, warm: int) -> float:
    rates = run["tok_s"][warm:] or run["tok_s"]
    return statistics.median(rates)


def compare_training(runs: dict, s: Settings) -> dict:
    single, split, repeat = (runs[k] for k in RUNS)
    floor_w, split_w = weight_gap(single["weights"], repeat["weights"]), weight_gap(single["weights"], split["weights"])
    return {
        "steps": s.steps,
        "loss_max_abs_diff": curve_gap(single["loss"], split["loss"]),
        "weights_max_rel_diff": split_w["max_rel_diff"],
        "weights": split_w,
        "repeat_loss_max_abs_diff": curve_gap(single["loss"], repeat["loss"]),
        "repeat_weights_max_rel_diff": floor_w["max_rel_diff"],
        "tok_s_single": median_tok_s(single, s.warm_steps),
        "tok_s_split": median_tok_s(split, s.warm_steps),
        "wall_s": {k: round(runs[k]["wall_s"], 1) for k in RUNS},
        "loss": {k: runs[k]["loss"] for k in RUNS},
    }


def verdict(fwd: dict, tr: dict) -> dict:
    """Each check's value, limit and result (see TOL and the module doc)."""
    max_loss = max(max(tr["loss"]["single"], default=0.0), 1e-9)
    checks = {
        "aux_rel": (fwd["aux"]["rel_diff"], TOL["forward_rel"]),
        "logits_rel": (fwd["logits"]["rel_diff"], TOL["forward_rel"]),
        "loss_abs": (
            tr["loss_max_abs_diff"],
            max(NOISE_FACTOR * tr["repeat_loss_max_abs_diff"], TOL["loss_abs_floor"] * max_loss),
        ),
        "weights_rel": (
            tr["weights_max_rel_diff"],
            max(NOISE_FACTOR * tr["repeat_weights_max_rel_diff"], TOL["weights_rel_floor"]),
        ),
    }
    out = {k: {"value": v, "limit": lim, "pass": v <= lim} for k, (v, lim) in checks.items()}
    out["argmax"] = {
        "value": fwd["argmax_agreement"],
        "limit": TOL["argmax_agreement_min"],
        "pass": fwd["argmax_agreement"] >= TOL["argmax_agreement_min"],
    }
    return out


def configs(args, s: Settings, target: str, map_path: Path, offload: Path | None):
    """The run config of the whole load and of the split load: the same but for device_map."""
    # memory_policy=config: "auto" plans from the teacher's share of the GPU, which the map changes.
    base = [
        f"target={target}",
        f"dtype={args.dtype}",
        f"device={args.device}",
        f"train.max_steps={s.steps}",
        "train.log_every=1",
        "train.ckpt_every=100000",
        "train.max_minutes=0",
        "train.compile_teacher=false",
        "train.memory_policy=config",
        *s.overrides,
        *args.override,
    ]
    if offload is not None:
        base.append(f"offload_folder={offload}")
    profile = str(Path(_ROOT) / s.profile) if s.profile else None
    return load_config(profile, base), load_config(profile, [*base, f"device_map={map_path}"])


def caveats(args, summary: dict) -> list[str]:
    notes = [
        "a GPU in the map makes accelerate stream a 'cpu' module's weights to the GPU per call and run it "
        "there: the split differs from the whole load in where weights are stored, not where they are computed",
        "both training runs and their repeat use train.compile_teacher=false (hooked layers run eager anyway)",
        "tok/s: median of the per-step figures in metrics.jsonl after the warm-up steps; single run each",
    ]
    if args.smoke:
        notes.append("--smoke: a tiny random Llama on the CPU, split between 'cpu' and 'disk'; figures mean nothing")
    if "tied" in summary:
        notes.append("lm_head is tied to the input embedding: it stays where the embedding is, whatever the map says")
    return notes


def check(args, s: Settings, out: Path, work: Path) -> dict:
    target = args.target or str(tiny_target_dir(work / "tiny"))
    layers = load_target_config(target).num_hidden_layers
    near, far = ("cpu", "disk") if args.smoke else (0, "cpu")
    declared = split_map(layers, near, far)
    write_json(out / "device_map.json", declared)
    cfg_whole, cfg_split = configs(args, s, target, out / "device_map.json", work if args.smoke else None)
    whole, split = load_target_from_config(cfg_whole), load_target_from_config(cfg_split)
    summary = {**split_summary(split.model, declared), "map_file": "device_map.json", "split_after_layer": layers // 2}
    if split.model.get_output_embeddings().weight is split.model.get_input_embeddings().weight:
        summary["tied"] = "lm_head shares the input embedding's weight"
    data = write_data(whole, work / "data", s, cfg_whole.vocab.size)
    t2d = load_vocab(data / "vocab.safetensors").t2d.to(whole.device)
    fwd = compare_forward(whole, split, pick_prompts(whole, s.compare_prompts), t2d)
    print(
        f"[device-map-check] forward: aux rel {fwd['aux']['rel_diff']:.2e}, logits rel "
        f"{fwd['logits']['rel_diff']:.2e}, argmax {fwd['argmax_agreement']:.4f}",
        flush=True,
    )
    runs = {}
    for name, cfg, teacher in zip(RUNS, (cfg_whole, cfg_split, cfg_whole), (whole, split, whole)):
        runs[name] = train_run(cfg, teacher, data, out / "runs" / name)
        print(f"[device-map-check] {name}: loss {runs[name]['loss'][-1]:.4f}, {runs[name]['wall_s']:.1f} s", flush=True)
    tr = compare_training(runs, s)
    for name in RUNS:  # the heads are compared above (120 MB each for gpu_smollm2): keep metrics and config
        for folder in ("checkpoints", "draft", "tensorboard"):
            shutil.rmtree(out / "runs" / name / folder, ignore_errors=True)
    return {"target": target, "summary": summary, "forward": fwd, "train": tr, "caveats": caveats(args, summary)}


def results_of(args, found: dict, date: str, wall: float) -> dict:
    fwd, tr = found["forward"], found["train"]
    checks = verdict(fwd, tr)
    return {
        "date": date,
        "gpu": device_name(args.device),
        "target": found["target"],
        "dtype": args.dtype,
        "split": found["summary"],
        "aux_max_abs_diff": fwd["aux"]["max_abs_diff"],
        "aux_rel_diff": fwd["aux"]["rel_diff"],
        "logits_max_abs_diff": fwd["logits"]["max_abs_diff"],
        "logits_rel_diff": fwd["logits"]["rel_diff"],
        "argmax_agreement": fwd["argmax_agreement"],
        "forward": fwd,
        "train": tr,
        "tolerance": {
            **TOL,
            "noise_factor": NOISE_FACTOR,
            "why": "both loads run every module on the same "
            "device with the same kernels, so the forward must agree to below one bf16 step; training "
            "may differ only by GPU run-to-run noise, measured by the repeat run",
        },
        "checks": checks,
        "pass": all(c["pass"] for c in checks.values()),
        "wall_s": round(wall, 1),
        "caveats": found["caveats"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for device-map-check.json, device_map.json, manifest.json")
    p.add_argument("--target", help="the teacher (the SmolLM2 GGUF at $T on the device); not with --smoke")
    p.add_argument("--smoke", action="store_true", help="a tiny random Llama on the CPU, split over cpu and disk")
    p.add_argument(
        "--device",
        default=None,
        help="where the draft trains and the map's first half lives (default: cuda; cpu with --smoke)",
    )
    p.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 20)")
    p.add_argument("override", nargs="*", help="KEY=VALUE config overrides for all three runs")
    args = p.parse_args(argv)
    if not args.smoke and not args.target:
        p.error("--target is needed (or --smoke)")
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.dtype = args.dtype or ("float32" if args.smoke else "bfloat16")
    s = smoke_settings() if args.smoke else Settings()
    if args.steps:
        s.steps = args.steps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date, t0 = datetime.date.today().isoformat(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="device-map-check-") as work:
        found = check(args, s, out, Path(work))
    results = results_of(args, found, date, time.perf_counter() - t0)
    write_json(out / "device-map-check.json", results)
    write_manifest(
        out,
        None,
        {
            "settings": dataclasses.asdict(s),
            "target": results["target"],
            "dtype": args.dtype,
            "device": args.device,
            "overrides": args.override,
        },
        args.device,
        date,
        what="device-map-check",
        files=["device-map-check.json", "device_map.json", "runs/"],
    )
    print(
        f"[device-map-check] {'PASS' if results['pass'] else 'FAIL'}: "
        + ", ".join(f"{k} {c['value']:.3g} (limit {c['limit']:.3g})" for k, c in results["checks"].items()),
        flush=True,
    )
    return 0 if results["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
