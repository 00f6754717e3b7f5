"""lab/gpu/scale.py's ``target_8b`` section (issue 47 item 2): a Llama-3.1-8B-shaped target in
bf16 with random weights on the engine (engine/generate.py), one device.

- plain decode at batch 1 (greedy_generate on the engine's settings for the sweep: CUDA graphs,
  compiled layers, unpadded) against the HBM roofline: bytes read per decode step (every weight
  but the input embedding, of which a step reads one row) / bandwidth, at the GPU's published
  bandwidth (scale.PUBLISHED_TB_S) and at the bandwidth a device-to-device copy measures here;
- a verify pass of each config's draft tokens against a plain step (bench/concurrency._step_ms:
  the target pass alone, through the engine's graphs) and a draft level's cost (the draft phase
  of speculative rounds with an untrained head, RoundTimer, divided by the config's steps);
- the speedup those costs give at the 135M recipe head's measured taus (PROJECTED, labelled so);
- regeneration throughput through batch_generate with ``regen_rows`` rows;
- training tok/s with the teacher resident (the trainer's own step, train_bench's synthetic run).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from scale import CONFIGS, LLAMA31_8B, NoTokenizer, free, log, model_config, peak_gib, published_tb_s, random_model

_ROOT = Path(__file__).resolve().parents[2]


def copy_bandwidth(device, gib: float = 4.0) -> float | None:
    """Bytes/s of a device-to-device copy (read + write), median of 5; None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * gib * 2**30 / sorted(times[2:])[len(times[2:]) // 2]


def decode_bytes(model) -> int:
    """Bytes a decode step reads: every parameter but the input embedding table."""
    skip = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not skip)


def measured_taus(path: str) -> dict:
    """The 135M recipe head's batch-1 taus and speedups per config (level 1 of the one-engine sweep)."""
    data = json.loads((_ROOT / path).read_text())
    rows = [r for r in data["concurrency_sweep"] if r["concurrency"] == 1 and r["config"] in CONFIGS]
    return {r["config"]: {"tau": r["tau"], "speedup": r["speedup"]} for r in rows} | {"_source": path}


def untrained_draft(target, s, folder: Path):
    """A head of the recipe's shape for this target (random, untrained), saved and loaded back."""
    from draftling.config import RunConfig, VocabConfig
    from draftling.draft.store import save_draft
    from draftling.draft.vocab import build_vocab
    from draftling.export.formats import load_any_draft
    from draftling.train.draft_setup import build_draft

    counts = torch.randint(0, 1000, (target.config.vocab_size,), generator=torch.Generator().manual_seed(0))
    vocab = build_vocab(counts, min(s.draft_vocab, target.config.vocab_size), "synthetic")
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    save_draft(build_draft(RunConfig(vocab=VocabConfig(size=vocab.size)), target, vocab), folder)
    return load_any_draft(folder, target.device, next(target.model.parameters()).dtype)


def engine_options(device):
    from draftling.engine import EngineOptions

    return EngineOptions(cuda_graphs="auto", compile="auto", query_pad=0, attention="auto").resolve(device)


def decode_costs(target, draft, s, device) -> dict:
    """Plain batch-1 tok/s, step times by query count, and each config's round split."""
    from draftling.bench.concurrency import _step_ms
    from draftling.bench.simple import build_engine, parse_decode_config
    from draftling.engine.generate import batch_generate, greedy_generate
    from draftling.timing import timed

    opts = engine_options(device)
    size = s.prompt_len + s.decode_tokens + 32
    eng, runner = build_engine(target, draft, size, opts)
    prompt = torch.randint(3, target.config.vocab_size, (s.prompt_len,), generator=torch.Generator().manual_seed(2))
    greedy_generate(eng, prompt, 16, eos_ids=[])  # compile and capture
    plain = [timed(lambda: greedy_generate(eng, prompt, s.decode_tokens, eos_ids=[]), device) for _ in range(3)]
    tokens = plain[0][0].shape[1]
    plain_tok_s = sorted(tokens / sec for _, sec in plain)[1]
    configs = [parse_decode_config(c) for c in CONFIGS]
    step_ms = {q: _step_ms(eng, q, s.step_reps) for q in sorted({1} | {c.draft_tokens for c in configs})}
    rounds = {}
    for c in configs:
        tree = (c.steps, c.topk, c.draft_tokens)
        batch_generate(eng, [prompt], 16, draft=runner, tree=tree, eos_ids=[])  # capture
        (res,) = batch_generate(eng, [prompt], s.decode_tokens, draft=runner, tree=tree, eos_ids=[], timing=True)
        rounds[c.name] = {"steps": c.steps, "draft_tokens": c.draft_tokens, **(res.stats.timing or {})}
    return {"engine": str(opts), "plain_tok_s": plain_tok_s, "step_ms": step_ms, "rounds": rounds}


def projection(costs: dict, taus: dict) -> dict:
    """tau x plain step / (verify pass + steps x draft level) per config; also over the whole
    measured round (drafting, verify, acceptance and commit as the engine ran them)."""
    t1 = costs["step_ms"][1]
    out = {}
    for name, r in costs["rounds"].items():
        tau = taus.get(name, {}).get("tau")
        level = r["draft_ms"] / r["steps"]
        denom = costs["step_ms"][r["draft_tokens"]] + r["steps"] * level
        out[name] = {
            "tau_135m": tau,
            "measured_speedup_135m": taus.get(name, {}).get("speedup"),
            "projected_speedup": None if tau is None else round(tau * t1 / denom, 3),
            "projected_speedup_whole_round": None if tau is None else round(tau * t1 / r["round_ms"], 3),
        }
    return out


def regen_throughput(target, s, device) -> dict:
    """Reply tok/s of batch_generate with ``regen_rows`` rows over 2 x rows random prompts."""
    from draftling.engine import build_target
    from draftling.engine.generate import batch_generate
    from draftling.timing import timed

    n = 2 * s.regen_rows
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, target.config.vocab_size, (s.prompt_len,), generator=g) for _ in range(n)]
    eng = build_target(
        target.model,
        target.aux_layer_ids,
        s.prompt_len + s.regen_tokens + 8,
        batch_size=s.regen_rows,
        options=engine_options(device),
    )
    batch_generate(eng, prompts[: s.regen_rows], 8, eos_ids=[])  # compile and capture
    out, sec = timed(lambda: batch_generate(eng, prompts, s.regen_tokens, eos_ids=[]), device)
    tokens = sum(len(r.tokens) for r in out)
    return {
        "rows": s.regen_rows,
        "requests": n,
        "new_tokens": s.regen_tokens,
        "seconds": sec,
        "reply_tok_s": tokens / sec,
    }


def training(target, s, device) -> dict:
    """Training tok/s with the 8B teacher resident: the trainer's defaults, synthetic batches."""
    from draftling.config import TrainConfig
    from lab.benches.train_bench import flow_step_seconds, phase_split, synthetic_run, synthetic_vocab

    g = torch.Generator().manual_seed(1)
    n = 2 + s.train_steps
    batches = [torch.randint(3, target.config.vocab_size, (s.train_batch, s.seq), generator=g) for _ in range(n)]
    vocab = synthetic_vocab(target, batches[:2], s.draft_vocab, device)
    run = synthetic_run(target, vocab, TrainConfig(ttt_steps=7, batch_size=s.train_batch), batches)
    keys = [list(range(i * s.train_batch, (i + 1) * s.train_batch)) for i in range(n)]
    split, _ = phase_split("target_8b", run, keys[:4], 2, s.seq * s.train_batch)
    step_s = flow_step_seconds(run, keys[2:])
    mean = [sum(x[k] for x in split[2:]) / len(split[2:]) for k in range(3)]
    return {
        "batch": s.train_batch,
        "seq": s.seq,
        "tok_s": s.train_batch * s.seq / step_s,
        "step_s": step_s,
        "time_split_s": {"teacher_prefill": mean[0], "draft_fwd_bwd": mean[1], "optimizer": mean[2]},
        "memory_policy": run.memory_policy,
    }


def section_target_8b(s, device, args) -> dict:
    from draftling.target.load import wrap_target

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    cfg, arch = model_config("llama", LLAMA31_8B, s.dry)
    t0 = time.perf_counter()
    model = random_model(cfg, device, dtype)
    target = wrap_target(model, NoTokenizer(int(cfg.pad_token_id)), name=f"random-llama-3.1-8b-shape{'-toy' * s.dry}")
    log(f"8B-shape target built in {time.perf_counter() - t0:.1f}s, {peak_gib(device)} GiB")
    nbytes = decode_bytes(model)
    measured_bw = copy_bandwidth(device)
    out: dict = {
        "arch": arch,
        "dtype": str(dtype),
        "decode_bytes": nbytes,
        "copy_bandwidth_tb_s": measured_bw and measured_bw / 1e12,
    }
    gpu = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    published = published_tb_s(gpu)
    out.update(gpu=gpu, published_bandwidth_tb_s=published)
    # The published figure where this GPU has one, else the copy measured here.
    bw = published * 1e12 if published else measured_bw
    out["roofline_tok_s"] = bw / nbytes if bw else None
    out["roofline_tok_s_measured_bw"] = measured_bw and measured_bw / nbytes
    taus = measured_taus(args.taus)
    with tempfile.TemporaryDirectory() as tmp:
        draft = untrained_draft(target, s, Path(tmp) / "draft")
        costs = decode_costs(target, draft, s, device)
    del draft
    free(device)
    t1 = costs["step_ms"][1]
    out.update(
        plain_tok_s=costs["plain_tok_s"],
        roofline_fraction=out["roofline_tok_s"] and costs["plain_tok_s"] / out["roofline_tok_s"],
        plain_step_ms=t1,
        step_ms=costs["step_ms"],
        verify_over_plain={n: costs["step_ms"][r["draft_tokens"]] / t1 for n, r in costs["rounds"].items()},
        rounds_ms=costs["rounds"],
        draft_level_ms=costs["rounds"]["chain-3-1-4"]["draft_ms"] / 3,
        draft_level_ms_by_config={n: r["draft_ms"] / r["steps"] for n, r in costs["rounds"].items()},
        engine=costs["engine"],
        taus_source=taus.pop("_source"),
    )
    proj = projection(costs, taus)
    out["projected_speedup"] = {n: p["projected_speedup"] for n, p in proj.items()}
    out["projection"] = proj | {"label": "PROJECTION from measured 8B-shape costs and the 135M head's taus"}
    for name, fn in (("regen", regen_throughput), ("training", training)):
        try:
            out[name] = fn(target, s, device)
        except Exception as e:  # noqa: BLE001 - the decode figures stand without it
            from scale import error_line

            out[name] = {"error": error_line(e)}
        free(device)
    out["peak_gib"] = peak_gib(device)
    return out
