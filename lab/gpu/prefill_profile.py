"""Device script: where one admission's fixed cost goes, on a random model of SmolLM2-135M's
shape (prefill time does not depend on the weights, so no GGUF needs to travel).

For g prompts of T random tokens into a 64-row engine (CUDA graphs and compiled layers for
decoding, as the sweep runs it): the median ms of the target's ``prefill_rows``, the draft's
``extend_rows`` and both, eager, compiled (EngineOptions.compile_prefill) and padded and graphed
(EngineOptions.prefill_graphs), each with a sync after it; then torch.profiler over one
admission each way: operator calls, kernel launches, the host's and the device's busy time, and
the ten operators with the most host time.

    python3 lab/gpu/prefill_profile.py --out FILE [--prompts 1,16] [--tokens 128]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from draftling.draft.model import Eagle3Draft, draft_config_from_target
from draftling.engine import DraftRunner, EngineOptions, build_target
from draftling.io import write_json
from draftling.timing import sync, timed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_ab import set_prefill  # noqa: E402

SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip
AUX = [2, 15, 27]


def engine(dev, rows: int, max_len: int):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(dev, dtype).eval()
    draft = Eagle3Draft(draft_config_from_target(model.config, 32000, AUX)).to(dev, dtype).eval()
    options = EngineOptions(cuda_graphs=True, compile=True, attention="matmul").resolve(torch.device(dev), 0)
    tgt = build_target(model, AUX, max_len, batch_size=rows, options=options)
    runner = DraftRunner(draft, model.get_input_embeddings(), max_len, batch_size=rows, options=options)
    return tgt, runner


def admission(tgt, runner, g: int, t: int):
    ids = torch.randint(0, 49152, (g, t), device=tgt.device)
    lengths = torch.full((g,), t, device=tgt.device)
    rows = torch.arange(g, device=tgt.device)

    def target_only():
        return tgt.prefill_rows(rows, ids, lengths)

    _, aux = target_only()

    def draft_only():
        runner.extend_rows(rows, ids, aux, lengths)

    def both():
        _, a = target_only()
        runner.extend_rows(rows, ids, a, lengths)

    return {"target": target_only, "draft": draft_only, "both": both}


def median_ms(fn, dev, reps=7) -> float:
    for _ in range(2):
        fn()
    return statistics.median(timed(fn, dev)[1] * 1e3 for _ in range(reps))


def profiled(fn, dev) -> dict:
    fn()
    sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(dev)
    events = prof.key_averages()
    cpu_ops = [e for e in events if e.device_type.name == "CPU"]
    top = sorted(cpu_ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return {
        "operator_calls": sum(e.count for e in cpu_ops),
        "kernel_launches": sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel")),
        "host_self_ms": sum(e.self_cpu_time_total for e in cpu_ops) / 1e3,
        "device_ms": sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e3,
        "top_host_ops": [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in top],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", default="1,16")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rows", type=int, default=64, help="the engine's batch rows")
    p.add_argument("--device", default="cuda", help="cpu: a dry run in float32")
    a = p.parse_args()
    tgt, runner = engine(a.device, a.rows, a.tokens + 256)
    name = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    res = {"command": "python3 lab/gpu/prefill_profile.py " + " ".join(sys.argv[1:]), "device": name}
    res["shape"], res["tokens"], res["levels"] = "SmolLM2-135M (random weights, bf16)", a.tokens, []
    for g in (int(x) for x in a.prompts.split(",")):
        row: dict = {"prompts": g}
        for name in ("eager", "compiled", "graphed"):
            set_prefill(tgt, runner, name)
            fns = admission(tgt, runner, g, a.tokens)
            row[name] = {k: median_ms(f, tgt.device) for k, f in fns.items()}
            row[name]["profile"] = profiled(fns["both"], tgt.device)
        res["levels"].append(row)
        print(json.dumps(row), flush=True)
        write_json(a.out, res)


if __name__ == "__main__":
    main()
