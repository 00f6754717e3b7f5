"""Decode-engine variants on a randomly initialised model of the target's shape.

    python3 lab/benches/engine_profile.py --out engine-profile.json [--arch smollm2]

For each engine variant (layers compiled or not, SDPA or matmul attention, query padding
or not; CUDA graphs on a GPU) it measures, on the same weights:
  * the target forward alone at q = 1, 4, 8, 16 (median of graph replays);
  * plain greedy decode tok/s (256 tokens from a few prompts, warm-up excluded);
  * one speculative round per config with a random draft (its acceptance is ~0, so this is
    the cost of a round, not a speedup);
  * how often speculative greedy output equals plain greedy output token for token. In
    bf16 a random model has many near-tied logits, which makes this a hard test of whether
    a token's logits depend on how many queries ran beside it.
Random weights cost no download and time the same kernels as the real model. The JSON is
rewritten after every variant, so a cut run keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

_SRC = str(Path(__file__).resolve().parents[2] / "src")  # draftling from this checkout, installed or not
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)

from draftling.draft.model import Eagle3Draft, draft_config_from_target
from draftling.engine import (
    DraftRunner,
    EngineOptions,
    build_target,
    causal_mask,
    greedy_generate,
    speculative_generate,
)
from draftling.io import write_json
from draftling.timing import timed

# SmolLM2-135M-Instruct's shape (its config.json).
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
# A small stand-in of the same family, for a quick check of this script on a CPU.
TINY = dict(
    SMOLLM2,
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
CONFIGS = [(3, 1, 4), (3, 4, 8), (5, 8, 16)]
VARIANTS = {
    "graphs": dict(compile=False, attention="sdpa", query_pad=0),
    "compiled_sdpa": dict(compile=True, attention="sdpa", query_pad=0),
    "compiled_matmul": dict(compile=True, attention="matmul", query_pad=0),
    "compiled_matmul_pad16": dict(compile=True, attention="matmul", query_pad=16),
    "compiled_sdpa_pad16": dict(compile=True, attention="sdpa", query_pad=16),
    "compiled_exact_pad16": dict(compile=True, attention="exact", query_pad=16),
}


def random_models(device, dtype, shape=SMOLLM2, draft_vocab=32000, seed=0):
    torch.manual_seed(seed)
    draft_vocab = min(draft_vocab, shape["vocab_size"])
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(device=device, dtype=dtype).eval()
    layers = model.config.num_hidden_layers
    aux = [2, layers // 2, layers - 3]
    draft = Eagle3Draft(draft_config_from_target(model.config, draft_vocab, aux))
    d2t = torch.zeros(draft_vocab, dtype=torch.long)  # draft id i -> target id i
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[:draft_vocab] = True
    draft.set_vocab(d2t, t2d)
    return model, draft.to(device=device, dtype=dtype).eval(), aux


def forward_ms(target, q, ctx, device, reps):
    ids = torch.full((1, q), 17, dtype=torch.long, device=device)
    pos = ctx + torch.arange(q, device=device)
    mask = causal_mask(ctx, q, target.max_seq_len, device)
    for _ in range(3):
        target.fast(ids, pos, pos, mask)
    times = [timed(lambda: target.fast(ids, pos, pos, mask), device)[1] for _ in range(reps)]
    return statistics.median(times) * 1e3


def profile_variant(model, draft, aux, variant, device, prompts, new_tokens, max_len):
    graphs = device.type == "cuda"
    t0 = time.perf_counter()
    options = EngineOptions(cuda_graphs=graphs, **variant)
    target = build_target(model, aux, max_len, options=options)
    runner = DraftRunner(draft, model.get_input_embeddings(), max_len, options=options)
    # Warm-up: compiles and captures every shape used below.
    greedy_generate(target, prompts[0], 8)
    for steps, topk, q in CONFIGS:
        speculative_generate(target, runner, prompts[0], 8, steps, topk, q)
    reps = 50 if graphs else 5
    row = {
        "variant": variant,
        "warmup_s": round(time.perf_counter() - t0, 1),
        "forward_ms": {q: round(forward_ms(target, q, 300, device, reps), 3) for q in (1, 4, 8, 16)},
    }
    plain_tokens, plain_s, refs = 0, 0.0, []
    for x in prompts:
        out, s = timed(lambda: greedy_generate(target, x, new_tokens), device)
        refs.append(out[0].tolist())
        plain_tokens += out.shape[1]
        plain_s += s
    row["plain_tok_s"] = round(plain_tokens / plain_s, 1)
    row["plain_ms_per_token"] = round(1e3 * plain_s / plain_tokens, 3)
    row["configs"] = {}
    for steps, topk, q in CONFIGS:
        same, rounds, secs = 0, 0, 0.0
        for x, ref in zip(prompts, refs):
            (out, stats), s = timed(lambda: speculative_generate(target, runner, x, new_tokens, steps, topk, q), device)
            same += out[0].tolist() == ref
            rounds += stats.verify_steps
            secs += s
        row["configs"][f"{steps}-{topk}-{q}"] = {
            "identical": f"{same}/{len(prompts)}",
            "round_ms": round(1e3 * secs / max(1, rounds), 3),
        }
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="a 4-layer stand-in (checks the script on a CPU)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else SMOLLM2
    model, draft, aux = random_models(device, dtype, shape)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, shape["vocab_size"], (1, 200 + 40 * i), generator=g).to(device) for i in range(args.prompts)
    ]
    max_len = 200 + 40 * args.prompts + args.new_tokens + 64
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "torch": torch.__version__,
        "shape": ("tiny stand-in" if args.tiny else "SmolLM2-135M") + ", random weights",
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "variants": {},
    }
    for name in args.variants.split(","):
        torch._dynamo.reset()
        try:
            result["variants"][name] = profile_variant(
                model, draft, aux, VARIANTS[name], device, prompts, args.new_tokens, max_len
            )
        except Exception as e:  # keep the other variants' numbers
            result["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(name, json.dumps(result["variants"][name]), flush=True)
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
