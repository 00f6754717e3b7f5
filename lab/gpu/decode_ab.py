"""Issue 47 item 2's roofline gap: where the 8B-shape plain decode step loses its time.

    python3 lab/gpu/decode_ab.py --out decode_ab.json            # GPU: Llama-3.1-8B shape, bf16
    python3 lab/gpu/decode_ab.py --out decode_ab.json --dry-run  # CPU: toy shape, same schema
    python3 lab/gpu/decode_ab.py --out d.json --target T.gguf --device cpu --variants sdpa,sdpa_fused

A Llama-3.1-8B-shaped target with random weights (lab/gpu/scale.py's model), then the engine's
plain greedy step at batch 1 (``fast_greedy``: CUDA graphs, compiled layers) timed over
``--steps`` steps per variant, at the context scale_8b.py uses:

- ``exact``: the engine as scale_8b.py ran it (exact attention, the speculative engine's);
- ``matmul``, ``sdpa``: the other attention kinds;
- ``<kind>_fused`` (``matmul_fused``, ...): q/k/v and gate/up each one matmul over
  concatenated weights (the engine's ``fuse`` option, engine/fused.py); the other variants run
  with it off, as the engine ran before it fused;
- ``gemv_floor`` / ``gemv_floor_fused``: only the step's weight matmuls (every layer's
  projections and the output head) replayed as one CUDA graph: what cuBLAS alone reaches on
  these shapes, the floor the engine's other kernels add to.

Each figure is also given as a fraction of the roofline (decode bytes / published bandwidth,
and / the device-to-device copy bandwidth measured here). Timing only: weights are random.
``--target`` times a real model instead (draftling's loader, float32 on the CPU).
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
from draftling.engine.fused import fuse_layer  # noqa: E402
from draftling.io import write_json  # noqa: E402

VARIANTS = ("exact", "matmul", "matmul_fused", "sdpa")


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
    fused = variant.endswith("_fused")
    attention = variant.removesuffix("_fused")
    opts = EngineOptions(cuda_graphs=gpu, compile=gpu, query_pad=0, attention=attention, fuse=fused)
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


def gemv_floor_ms(model, fused: bool, device, steps: int) -> float:
    """The step's weight matmuls alone, on one token, as one graph."""
    from draftling.target.aux import decoder_layers

    layers = decoder_layers(model)
    parts = [fuse_layer(layer) for layer in layers] if fused else [None] * len(layers)
    x = torch.randn(1, 1, model.config.hidden_size, device=device, dtype=layers[0].mlp.down_proj.weight.dtype)
    head = model.get_output_embeddings().weight

    def chain():
        for layer, f in zip(layers, parts):
            a, m = layer.self_attn, layer.mlp
            if f is not None:
                F.linear(x, f.qkv.weight)
                gu = F.linear(x, f.gate_up.weight)
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
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="engine variants (attention kind, _fused); the floors always run"
    )
    p.add_argument("--target", help="a real target (draftling's --target forms) instead of the random 8B shape")
    p.add_argument("--device", help="default: cuda, or cpu with --dry-run")
    args = p.parse_args(argv)
    known = {a + f for a in ("exact", "matmul", "sdpa") for f in ("", "_fused")}
    if bad := [v for v in args.variants.split(",") if v and v not in known]:
        p.error(f"--variants: unknown {bad}; known: {sorted(known)} (the gemv floors always run)")
    device = args.device or ("cpu" if args.dry_run else "cuda")
    cpu = torch.device(device).type == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    if args.target:
        from draftling.target.load import load_target

        target = load_target(args.target, dtype=str(dtype).removeprefix("torch."), device=device)
        model, shape = target.model, Path(target.spec.name).name
    else:
        cfg, _ = model_config("llama", LLAMA31_8B, args.dry_run)
        model, shape = random_model(cfg, device, dtype), "llama-3.1-8b" + "-toy" * args.dry_run
    nbytes = decode_bytes(model)
    bw = copy_bandwidth(device)
    pub = published_tb_s(device_name(device)) if not cpu else None
    size = 128 + 256 + 32  # scale_8b.py's cache: prompt + decoded tokens + slack
    out: dict = {"shape": shape, "dtype": str(dtype), "decode_bytes": nbytes}
    out.update(copy_bandwidth_tb_s=bw and bw / 1e12, published_bandwidth_tb_s=pub, cache_slots=size, context=size // 2)
    floor = {"published": pub and nbytes / (pub * 1e12) * 1e3, "measured_copy": bw and nbytes / bw * 1e3}
    out["roofline_step_ms"] = floor
    cmd = "python3 lab/gpu/decode_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    what = f"the {shape} plain decode step by engine variant, and the weight matmuls alone (lab/gpu/decode_ab.py)"
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
