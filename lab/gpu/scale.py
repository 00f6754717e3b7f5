"""Issue 47 items 1, 2 and 4 in one run (lab/gpu/scale.sh on one H200): scale.json.

    python3 lab/gpu/scale.py --out DIR [--target GGUF --data DATA]   # GPU: every section
    python3 lab/gpu/scale.py --dry-run --out DIR                     # CPU: toy sizes, same schema

Each section runs in a child process of its own (``--section NAME``; ``--in-process`` runs them
here), so an OOM, a device-side assert or a hang (``--section-timeout``) loses that section only:
its entry in scale.json is ``{"error": ...}`` and the others still run.

- ``teacher_36b_4bit`` (item 1): a Seed-OSS-36B-shaped teacher (SEED_OSS_36B, the published
  config of ByteDance-Seed/Seed-OSS-36B-Instruct; transformers' ``SeedOssConfig`` where it exists,
  else a Llama config with the same numbers and attention biases, said in ``arch``), random
  weights, built one decoder layer at a time on the GPU and quantized to 4 bits as it is built
  (bitsandbytes NF4, else torchao int4, ``--quant``), resident; the draft trained on it at
  sequence 2048 under a hard cap (``torch.cuda.set_per_process_memory_fraction``, 32 GiB) for
  at least 50 steps. Peak memory, tok/s, the step split (teacher prefill, draft, optimizer) and
  ``draftling plan``'s estimate for the same run (train.memory_fit.plan_run, what the command prints).
- ``target_8b`` (item 2): a Llama-3.1-8B-shaped target in bf16, random weights: plain decode
  at batch 1 against the HBM roofline, verify passes against a plain step, a draft level's cost,
  the speedup those costs give at the 135M recipe head's measured taus (a projection), the
  batched engine's regeneration throughput, and training tok/s with the teacher resident.
- ``peer`` (item 4, lab/gpu/scale_peer.py): draftling against speculators 0.9.0 on the same data.

Random weights everywhere but the peer: timing and memory only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[2]
for _p in (str(_ROOT / "src"), str(_ROOT), str(Path(__file__).resolve().parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from draftling.bench.manifest import device_name, write_manifest  # noqa: E402
from draftling.io import write_json  # noqa: E402

GIB = 2**30
SECTIONS = ("teacher_36b_4bit", "target_8b", "peer")
# Published HBM bandwidth, TB/s, by the name CUDA reports (the roofline's denominator; the copy
# bandwidth measured on the device is recorded beside it).
PUBLISHED_TB_S = {"H200": 4.8, "H100 NVL": 3.9, "H100 PCIe": 2.0, "H100 80GB HBM3": 3.35}


def published_tb_s(name: str) -> float | None:
    return next((bw for key, bw in PUBLISHED_TB_S.items() if key in name), None)


# ByteDance-Seed/Seed-OSS-36B-Instruct's published config (its model card: 64 layers, 80/8/8 QKV
# heads of 128, hidden 5120, SwiGLU 27648, vocab 155136, RoPE base 1e7). transformers'
# SeedOssConfig defaults hidden_size to 4096, so every number is given here.
SEED_OSS_36B = dict(
    vocab_size=155136,
    hidden_size=5120,
    intermediate_size=27648,
    num_hidden_layers=64,
    num_attention_heads=80,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=524288,
    rms_norm_eps=1e-6,
    attention_bias=True,
    tie_word_embeddings=False,
    bos_token_id=0,
    pad_token_id=1,
    eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7},
)
LLAMA31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
    pad_token_id=128004,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
TOY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)
TOY.update(head_dim=32, vocab_size=512, max_position_embeddings=4096)
CONFIGS = ("chain-3-1-4", "tree-3-4-8", "tree-5-8-16")
TAUS_FILE = "bench/results/2026-12-06-one-engine-d2e3610-nvidia-h200/concurrency.json"


@dataclasses.dataclass
class Sizes:
    """What each section runs; ``dry`` shrinks every model to TOY and every loop to a few steps."""

    dry: bool = False
    cap_gib: float | None = 32.0
    seq: int = 2048
    teacher_batch: int = 1
    teacher_steps: int = 50  # flow steps (tok/s); the split steps come on top
    split_steps: int = 6
    warmup_steps: int = 2
    draft_vocab: int = 32000
    decode_tokens: int = 256
    prompt_len: int = 128
    regen_rows: int = 64
    regen_tokens: int = 256
    train_batch: int = 4
    train_steps: int = 6
    step_reps: int = 20

    @classmethod
    def for_run(cls, dry: bool) -> Sizes:
        if not dry:
            return cls()
        return cls(
            dry=True,
            cap_gib=None,
            seq=64,
            teacher_steps=3,
            split_steps=2,
            warmup_steps=1,
            draft_vocab=256,
            decode_tokens=16,
            prompt_len=16,
            regen_rows=4,
            regen_tokens=16,
            train_batch=2,
            train_steps=2,
            step_reps=3,
        )


def log(msg: str) -> None:
    print(f"[scale] {msg}", flush=True)


def free(device) -> None:
    """train_bench's release of unused device memory, for a device name or object."""
    from lab.benches.train_bench import _free

    _free(torch.device(device))


def peak_gib(device) -> float | None:
    """train_bench's peak allocated GiB (None off CUDA), rounded for the JSON."""
    from lab.benches.train_bench import _peak_gib

    peak = _peak_gib(torch.device(device))
    return None if peak is None else round(peak, 3)


def error_line(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:600]}{where}"


# --- random-weight models, built on the device a layer at a time ------------------------------


class NoTokenizer:
    """A random model has no tokenizer: the runs use token ids, and read only the pad id."""

    def __init__(self, pad: int):
        self.pad_token_id, self.eos_token_id = pad, None

    def get_vocab(self) -> dict:
        return {}


def model_config(arch: str, fields: dict, toy: bool):
    """A transformers config of ``arch`` ("seed_oss" or "llama"); seed_oss falls back to a Llama
    config with the same numbers where this transformers lacks it. Returns (config, arch used)."""
    import transformers

    fields = dict(fields)
    if toy:
        fields.update(TOY)
        fields.update(pad_token_id=1, bos_token_id=0, eos_token_id=2)
        if fields.get("rope_parameters", {}).get("rope_type") == "llama3":
            fields["rope_parameters"] = dict(fields["rope_parameters"], original_max_position_embeddings=512)
    if arch == "seed_oss" and hasattr(transformers, "SeedOssConfig"):
        return transformers.SeedOssConfig(**fields), "seed_oss"
    used = "llama" if arch == "llama" else "llama (transformers has no seed_oss: its published numbers, biases on)"
    return transformers.LlamaConfig(**fields), used


def _materialize(module: torch.nn.Module, device) -> None:
    """Give every meta tensor of ``module`` (recursively) real storage on ``device`` and a random
    init: Linear/Embedding their own reset, norms ones, other biases zeros. The dtype stays the
    meta tensors' (the model was cast on meta): a quantized layer is never cast."""
    for m in module.modules():
        own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        if not any(t.is_meta for t in own):
            continue
        m.to_empty(device=device, recurse=False)
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
            continue
        for name, p in m.named_parameters(recurse=False):
            with torch.no_grad():
                p.fill_(1.0 if name == "weight" else 0.0)


def _rotary_fresh(model, device) -> None:
    """Rotary tables are buffers computed at init: rebuild them on the device (meta had none)."""
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                with torch.device(device):
                    setattr(parent, name, type(child)(config=model.config))


def random_model(cfg, device, dtype, quantize=None):
    """The causal LM of ``cfg`` with random weights on ``device``: built on meta, then each decoder
    layer materialised (and quantized by ``quantize(layer)`` if given) before the next, so the
    device never holds more than one unquantized layer beyond the quantized model."""
    import transformers

    from draftling.target.aux import decoder_layers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.to(dtype)
    torch.manual_seed(0)
    for layer in decoder_layers(model):
        _materialize(layer, device)
        if quantize is not None:
            quantize(layer)
    _materialize(model, device)
    _rotary_fresh(model, device)
    return model.eval().requires_grad_(False)


def quantizer(name: str, device, dtype):
    """(quantize(layer), record) for ``name``; raises where the method cannot run here."""
    if torch.device(device).type != "cuda":
        raise RuntimeError("skipped: needs CUDA")
    if name == "bnb-nf4":
        import bitsandbytes as bnb

        def quantize(layer):
            for parent in list(layer.modules()):
                for child_name, child in list(parent.named_children()):
                    if type(child) is torch.nn.Linear:
                        q = bnb.nn.Linear4bit(
                            child.in_features,
                            child.out_features,
                            bias=child.bias is not None,
                            compute_dtype=dtype,
                            compress_statistics=False,
                            quant_type="nf4",
                            device="meta",
                        )
                        q.weight = bnb.nn.Params4bit(
                            child.weight.data, requires_grad=False, quant_type="nf4", compress_statistics=False
                        )
                        q.bias = child.bias
                        setattr(parent, child_name, q.to(device))

        return quantize, {"method": "bitsandbytes NF4 (no double quant)", "version": bnb.__version__, "bits": 4.5}
    if name == "torchao-int4":
        import torchao
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        def quantize(layer):
            quantize_(layer, Int4WeightOnlyConfig(group_size=128))

        return quantize, {"method": "torchao Int4WeightOnly, group 128", "version": torchao.__version__, "bits": 4.25}
    raise ValueError(f"unknown quantization {name!r}")


# --- section 1: the 36B-shaped 4-bit teacher under a 32 GiB cap --------------------------------


def _cap(device, cap_gib) -> float | None:
    if cap_gib is None or torch.device(device).type != "cuda":
        return None
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index  # the cap needs an index, not "cuda"
    fraction = min(1.0, cap_gib * GIB / torch.cuda.get_device_properties(index).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def _quantized_teacher(cfg, device, dtype, methods: list[str]):
    """The first of ``methods`` that quantizes here: (model, record with every attempt)."""
    tried = {}
    for name in methods:
        try:
            quantize, record = quantizer(name, device, dtype)
            t0 = time.perf_counter()
            model = random_model(cfg, device, dtype, quantize)
            record.update(name=name, build_s=round(time.perf_counter() - t0, 1), tried=tried)
            return model, record
        except Exception as e:  # noqa: BLE001 - the next method is tried, the reason kept
            tried[name] = error_line(e)
            log(f"quantization {name}: {tried[name]}")
            free(device)
    model = random_model(cfg, device, dtype)
    why = "skipped: needs CUDA" if all("needs CUDA" in v for v in tried.values()) else "none: every method failed"
    return model, {"name": None, "method": why, "bits": None, "tried": tried}


def _plan(target_config, tc, quant: dict, s: Sizes, dtype_name: str) -> dict:
    """``draftling plan --gpu-mem 32GiB --seq S --batch-size B [--teacher-bits b]`` for this run."""
    import tempfile

    from draftling.config import RunConfig, VocabConfig
    from draftling.train.memory_fit import plan_run

    cfg = RunConfig(dtype=dtype_name, train=tc, vocab=VocabConfig(size=s.draft_vocab))
    with tempfile.TemporaryDirectory():
        plan = plan_run(
            cfg, target_config, int((s.cap_gib or 32.0) * GIB), s.seq, s.teacher_batch, teacher_bits=quant["bits"]
        )
    est = plan["estimate"]
    return {
        "plan_gib": round(est["total"] / GIB, 3),
        "plan_peak_phase": est.get("peak_phase"),
        "plan_fits": plan["fits"],
        "plan_teacher_bits": quant["bits"],
        "plan_components_gib": {k: round(v / GIB, 3) for k, v in est.items() if isinstance(v, int) and k != "total"},
    }


def section_teacher_36b_4bit(s: Sizes, device, args) -> dict:
    from draftling.target.load import wrap_target
    from lab.benches.train_bench import all_on_config, flow_step_seconds, phase_split, synthetic_run, synthetic_vocab

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    fraction = _cap(device, s.cap_gib)
    cfg, arch = model_config("seed_oss", SEED_OSS_36B, s.dry)
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model, quant = _quantized_teacher(cfg, device, dtype, args.quant.split(","))
    target = wrap_target(model, NoTokenizer(int(cfg.pad_token_id)), name=f"random-seed-oss-36b-shape{'-toy' * s.dry}")
    weights_gib = peak_gib(device)
    g = torch.Generator().manual_seed(1)
    n = s.warmup_steps + s.split_steps + s.teacher_steps
    batches = [torch.randint(3, cfg.vocab_size, (s.teacher_batch, s.seq), generator=g) for _ in range(n)]
    vocab = synthetic_vocab(target, batches[:2], s.draft_vocab, device)
    tc = all_on_config(7, batch_size=s.teacher_batch)  # every memory feature on: what a 32 GiB card needs
    run = synthetic_run(target, vocab, tc, batches)
    keys = [list(range(i * s.teacher_batch, (i + 1) * s.teacher_batch)) for i in range(n)]
    split, _ = phase_split(
        "teacher_36b", run, keys[: s.warmup_steps + s.split_steps], s.warmup_steps, s.seq * s.teacher_batch
    )
    measured = split[s.warmup_steps :]
    step_s = flow_step_seconds(run, keys[s.warmup_steps + s.split_steps :])
    mean = [sum(x[k] for x in measured) / len(measured) for k in range(3)]
    out = {
        "steps": n,
        "flow_steps": s.teacher_steps,
        "seq": s.seq,
        "batch": s.teacher_batch,
        "arch": arch,
        "quant": quant["name"] or quant["method"],
        "quant_detail": quant,
        "cap_gib": s.cap_gib if fraction is not None else None,
        "cap_fraction": fraction,
        "peak_gib": peak_gib(device),
        "teacher_resident_gib": weights_gib,
        "tok_s": round(s.teacher_batch * s.seq / step_s, 1),
        "step_s": round(step_s, 4),
        "time_split_s": {"teacher_prefill": mean[0], "draft_fwd_bwd": mean[1], "optimizer": mean[2]},
        "memory_policy": run.memory_policy,
        "draft_params_m": round(sum(p.numel() for p in run.draft.parameters() if p.requires_grad) / 1e6, 1),
    }
    out.update(_plan(cfg, run.cfg.train, quant, s, "bfloat16" if dtype == torch.bfloat16 else "float32"))
    if out["peak_gib"]:
        out["plan_error"] = round((out["plan_gib"] - out["peak_gib"]) / out["peak_gib"], 4)
        out["plan_within_15pct"] = abs(out["plan_error"]) <= 0.15
    return out


# --- the run ----------------------------------------------------------------------------------


def run_section(name: str, s: Sizes, device, args) -> dict:
    fn = {
        "teacher_36b_4bit": section_teacher_36b_4bit,
        "target_8b": lambda *a: __import__("scale_8b").section_target_8b(*a),
        "peer": lambda *a: __import__("scale_peer").section_peer(*a),
    }[name]
    t0 = time.perf_counter()
    try:
        out = fn(s, device, args)
    except Exception as e:  # noqa: BLE001 - a failed section is a result
        out = {"error": error_line(e)}
        log(f"{name} failed: {out['error']}")
        traceback.print_exc()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def scale_json(results: dict, s: Sizes, device) -> dict:
    """The contract's keys first (issue 47), each section's whole record under ``sections``."""
    t1, t2, peer = (results.get(k) or {} for k in SECTIONS)
    return {
        "dry_run": s.dry,
        "date": datetime.date.today().isoformat(),
        "gpu": device_name(device),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "teacher_36b_4bit": {k: t1.get(k) for k in ("peak_gib", "cap_gib", "tok_s", "plan_gib", "steps", "quant")}
        | ({"error": t1["error"]} if "error" in t1 else {}),
        "target_8b": {
            k: t2.get(k)
            for k in (
                "plain_tok_s",
                "roofline_tok_s",
                "roofline_fraction",
                "verify_over_plain",
                "draft_level_ms",
                "projected_speedup",
            )
        }
        | ({"error": t2["error"]} if "error" in t2 else {}),
        "peer": {
            k: peer.get(k)
            for k in ("draftling_tok_s", "speculators_tok_s", "draftling_peak_gib", "speculators_peak_gib", "val_acc")
        }
        | ({"error": peer["error"]} if "error" in peer else {}),
        "sections": results,
        "caveats": caveats(s),
    }


def caveats(s: Sizes) -> list[str]:
    notes = [
        "random weights for the 36B and 8B shapes: timing and memory only (no tau, no acceptance)",
        "target_8b.projected_speedup is a projection: tau (the 135M recipe head's, measured) x plain step / "
        "(verify pass + steps x draft level), all timed here on the 8B shape; the measured 135M speedups stand beside it",
        "teacher_36b_4bit: the teacher is built and quantized a decoder layer at a time on the GPU (a 72 GB bf16 "
        "checkpoint is never written), as from_pretrained with a BitsAndBytesConfig/TorchAoConfig would leave it; "
        "the draft trains with every memory feature on (train_bench.all_on_config), the plan is estimated for that config",
        "peak_gib is torch.cuda.max_memory_allocated over the section (teacher build included); the CUDA context comes on top",
    ]
    if s.dry:
        notes.insert(0, "DRY RUN: toy sizes on the CPU; no figure here is a result")
    return notes


def child(name: str, args, out: Path) -> dict:
    """Run one section in a child process; its JSON, or the reason it has none."""
    path = out / "sections" / f"{name}.json"
    cmd = [sys.executable, __file__, "--section", name, "--out", str(out)] + passed_args(args)
    log(f"section {name}: {' '.join(cmd[2:])}")
    try:
        proc = subprocess.run(cmd, timeout=args.section_timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if path.is_file():
        return json.loads(path.read_text())
    return {"error": f"section process ended ({rc}) without results (timeout {args.section_timeout} s)"}


def passed_args(args) -> list[str]:
    out = ["--quant", args.quant, "--device", args.device, "--taus", args.taus]
    for flag in ("target", "data", "spec_python", "peer_steps"):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out + (["--dry-run"] if args.dry_run else [])


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results folder: scale.json, manifest.json, sections/")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU, the same schema")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--section", help=argparse.SUPPRESS)  # a child: run this one and write its JSON
    p.add_argument("--in-process", action="store_true", help="run the sections here, not in children")
    p.add_argument("--section-timeout", type=int, default=1500)
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --dry-run)")
    p.add_argument("--quant", default="bnb-nf4,torchao-int4", help="4-bit methods to try, in order")
    p.add_argument("--taus", default=TAUS_FILE, help="the 135M recipe head's measured taus (concurrency.json)")
    p.add_argument("--target", help="peer: the SmolLM2 GGUF (default: the dry run's tiny random target)")
    p.add_argument("--data", help="peer: `draftling data` output of the 135M recipe (train/val/vocab)")
    p.add_argument("--spec-python", help="peer: a python with speculators 0.9.0 (default: this one)")
    p.add_argument("--peer-steps", type=int, default=None, help="peer: steps for each trainer")
    a = p.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() and not a.dry_run else "cpu")
    return a


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out)
    (out / "sections").mkdir(parents=True, exist_ok=True)
    s = Sizes.for_run(args.dry_run)
    device = torch.device(args.device)
    if args.section:
        write_json(out / "sections" / f"{args.section}.json", run_section(args.section, s, device, args))
        return 0
    t0 = time.perf_counter()
    names = [n for n in args.sections.split(",") if n]
    results = {}
    for name in names:
        results[name] = run_section(name, s, device, args) if args.in_process else child(name, args, out)
        if not args.in_process:
            write_json(out / "sections" / f"{name}.json", results[name])
        write_json(out / "scale.json", scale_json(results, s, device))
    summary = scale_json(results, s, device)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(out / "scale.json", summary)
    config = {"sizes": dataclasses.asdict(s), "sections": names, **vars(args)}
    write_manifest(out, None, config, device, what="issue 47 items 1, 2 and 4: lab/gpu/scale.py")
    log(json.dumps({k: summary[k] for k in ("teacher_36b_4bit", "target_8b", "peer")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
