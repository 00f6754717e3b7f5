"""Issue 47 item 2's roofline gap: where the 8B-shape plain decode step loses its time.

    python3 lab/gpu/decode_ab.py --out decode_ab.json            # GPU: Llama-3.1-8B shape, bf16
    python3 lab/gpu/decode_ab.py --out decode_ab.json --dry-run  # CPU: toy shape, same schema

A Llama-3.1-8B-shaped target with random weights (lab/gpu/scale.py's model), then the engine's
plain greedy step at batch 1 (``fast_greedy``: CUDA graphs, compiled layers) timed over
``--steps`` steps per variant, at the context scale_8b.py uses:

- ``exact``: the engine as scale_8b.py ran it (exact attention, the speculative engine's);
- ``matmul``, ``sdpa``: the other attention kinds;
- ``matmul_fused``: q/k/v and gate/up each one matmul over concatenated weights (this script
  patches engine.target_model's two layer halves; the product engine does not fuse);
- ``gemv_floor`` / ``gemv_floor_fused``: only the step's weight matmuls (every layer's
  projections and the output head) replayed as one CUDA graph: what cuBLAS alone reaches on
  these shapes, the floor the engine's other kernels add to.

Each figure is also given as a fraction of the roofline (decode bytes / published bandwidth,
and / the device-to-device copy bandwidth measured here). Timing only: weights are random.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE.parents[1] / "src"), str(_HERE.parents[1]), str(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from scale import LLAMA31_8B, log, model_config, published_tb_s, random_model  # noqa: E402
from scale_8b import copy_bandwidth, decode_bytes  # noqa: E402

from draftling.bench.manifest import device_name, write_manifest  # noqa: E402
from draftling.engine import target_model as tm  # noqa: E402
from draftling.io import write_json  # noqa: E402

VARIANTS = ("exact", "matmul", "matmul_fused", "sdpa")


def fuse(layers) -> None:
    """Concatenated q/k/v and gate/up weights per layer, once (copies: the A/B has memory to spare)."""
    if hasattr(layers[0].self_attn, "qkv_w"):
        return
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        a.qkv_w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        a.qkv_split = (a.q_proj.weight.shape[0], a.k_proj.weight.shape[0], a.v_proj.weight.shape[0])
        m.gate_up_w = torch.cat([m.gate_proj.weight, m.up_proj.weight])


def fused_inputs(layer, x, cos, sin):
    attn = layer.self_attn
    b, q, _ = x.shape
    d = attn.head_dim
    h = layer.input_layernorm(x)
    qs, ks, vs = F.linear(h, attn.qkv_w).split(attn.qkv_split, dim=-1)
    qs, ks = qs.reshape(b, q, -1, d), ks.reshape(b, q, -1, d)
    vs = vs.reshape(b, q, -1, d).transpose(1, 2)
    qs, ks = tm.apply_rotary_pos_emb(qs.transpose(1, 2), ks.transpose(1, 2), cos, sin)
    return qs, ks, vs


def fused_outputs(layer, x, q, k_cache, v_cache, attn_mask, kind):
    attn, mlp = layer.self_attn, layer.mlp
    o = tm.matmul_attention(q, k_cache, v_cache, attn_mask, attn.scaling, exact=kind == "exact")
    b, _, t, _ = q.shape
    x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
    gate, up = F.linear(layer.post_attention_layernorm(x), mlp.gate_up_w).chunk(2, dim=-1)
    return x + mlp.down_proj(mlp.act_fn(gate) * up)


def graph_ms(fn, device, steps: int, reps: int = 5) -> float:
    """Median ms per call of ``fn`` run ``steps`` times per repeat (CUDA events; wall off CUDA)."""
    times = []
    for _ in range(reps):
        if torch.device(device).type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(steps):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(times)


def engine_step_ms(model, variant: str, size: int, device, steps: int) -> float:
    """The engine's plain greedy step (its graphs and compiled layers) at half the cache."""
    from draftling.engine import CachedTarget, EngineOptions

    gpu = torch.device(device).type == "cuda"
    attention = "matmul" if variant == "matmul_fused" else variant
    opts = EngineOptions(cuda_graphs=gpu, compile=gpu, query_pad=0, attention=attention)
    saved = tm.attention_inputs, tm.attention_outputs
    if variant == "matmul_fused":
        from draftling.target.aux import decoder_layers

        fuse(decoder_layers(model))
        tm.attention_inputs, tm.attention_outputs = fused_inputs, fused_outputs
    try:
        tm._COMPILED.clear()
        torch._dynamo.reset()
        n = model.config.num_hidden_layers
        eng = CachedTarget(model, [2, n // 2, n - 3], size, options=opts)
        state = {"tok": torch.zeros(1, 1, dtype=torch.long, device=device)}
        state["pos"] = torch.full((1,), size // 2, dtype=torch.long, device=device)

        def step():
            state["tok"], _ = eng.fast_greedy(state["tok"], state["pos"])  # the position stays

        for _ in range(3):
            step()
        return graph_ms(step, device, steps)
    finally:
        tm.attention_inputs, tm.attention_outputs = saved


def gemv_floor_ms(model, fused: bool, device, steps: int) -> float:
    """The step's weight matmuls alone, on one token, as one graph."""
    from draftling.target.aux import decoder_layers

    layers = decoder_layers(model)
    if fused:
        fuse(layers)
    x = torch.randn(1, 1, model.config.hidden_size, device=device, dtype=layers[0].mlp.down_proj.weight.dtype)
    head = model.get_output_embeddings().weight

    def chain():
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            if fused:
                F.linear(x, a.qkv_w)
                gu = F.linear(x, m.gate_up_w)
            else:
                F.linear(x, a.q_proj.weight), F.linear(x, a.k_proj.weight), F.linear(x, a.v_proj.weight)
                gu = torch.cat([F.linear(x, m.gate_proj.weight), F.linear(x, m.up_proj.weight)], -1)
            F.linear(x, a.o_proj.weight)
            F.linear(gu[..., : m.down_proj.weight.shape[1]], m.down_proj.weight)
        return F.linear(x, head)

    if torch.device(device).type != "cuda":
        return graph_ms(chain, device, steps)
    chain()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    return graph_ms(g.replay, device, steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, toy shape: the schema only")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    cfg, _ = model_config("llama", LLAMA31_8B, args.dry_run)
    model = random_model(cfg, device, dtype)
    nbytes = decode_bytes(model)
    bw = copy_bandwidth(device)
    pub = published_tb_s(device_name(device)) if not args.dry_run else None
    size = 128 + 256 + 32  # scale_8b.py's cache: prompt + decoded tokens + slack
    out: dict = {"shape": "llama-3.1-8b" + "-toy" * args.dry_run, "dtype": str(dtype), "decode_bytes": nbytes}
    out.update(copy_bandwidth_tb_s=bw and bw / 1e12, published_bandwidth_tb_s=pub, cache_slots=size, context=size // 2)
    floor = {"published": pub and nbytes / (pub * 1e12) * 1e3, "measured_copy": bw and nbytes / bw * 1e3}
    out["roofline_step_ms"] = floor
    cmd = "python3 lab/gpu/decode_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    what = "the 8B-shape plain decode step by engine variant, and the weight matmuls alone (lab/gpu/decode_ab.py)"
    write_manifest(Path(args.out).parent, command=cmd, config=vars(args), device=device, what=what)
    ms: dict = {}
    out["step_ms"] = ms
    for fused in (False, True):  # the floors first: quick, and they stand if a variant hangs
        name = "gemv_floor" + "_fused" * fused
        ms[name] = gemv_floor_ms(model, fused, device, args.steps)
        log(f"decode_ab {name}: {ms[name]:.3f} ms")
    for v in [v for v in args.variants.split(",") if v]:
        t0 = time.perf_counter()
        try:
            ms[v] = engine_step_ms(model, v, size, device, args.steps)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result
            ms[v] = None
            out.setdefault("errors", {})[v] = f"{type(e).__name__}: {e}"[:300]
        log(f"decode_ab {v}: {ms[v]} ms ({time.perf_counter() - t0:.0f} s)")
        out["roofline_fraction"] = {
            k: {b: f and t and f / t for b, f in floor.items()} for k, t in ms.items() if t is not None
        }
        write_json(args.out, out)  # after each variant: a run cut short keeps what it measured
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
