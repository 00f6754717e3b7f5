"""CPU cost of a batched target forward (4 x 175 tokens, 1 x 64) and a 64-row generate() with
row-major vs column-major Linear weights, plus one 700x576x1536 matmul in fp32/bf16/fp16.
Usage: python3 lab/experiments/cpu_weight_layout_forward.py

As run on 2026-12-01 on a 2-core Xeon, before 5150e62 (bench/results/
2026-12-01-cpu-weight-layout-0572392-cpu-xeon-2core/), load_target left the weights row-major;
with the layout change in place the first row already measures column-major weights."""

import time

import torch

from draftling.target import load_target

m = load_target(None, dtype="float32").model


def run(b, t, n=3):
    x = torch.randint(0, 40000, (b, t))
    with torch.no_grad():
        m(x)
        t0 = time.time()
        for _ in range(n):
            m(x)
    return (time.time() - t0) / n * 1000


def gen():
    x = torch.randint(0, 40000, (64, 100))
    with torch.no_grad():
        t0 = time.time()
        m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    return time.time() - t0


for tag in ("as loaded", "column-major"):
    print(tag, "fwd 4x175 ms", run(4, 175), "fwd 1x64 ms", run(1, 64), "gen 64x16 s", gen())
    for mod in m.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.shape[0] < 10000:
            mod.weight.data = mod.weight.data.t().contiguous().t()

x, w = torch.randn(700, 576), torch.randn(1536, 576)
for dt in (torch.float32, torch.bfloat16, torch.float16):
    a, b = x.to(dt), w.to(dt)
    torch.nn.functional.linear(a, b)
    t0 = time.time()
    for _ in range(5):
        torch.nn.functional.linear(a, b)
    print(dt, "linear 700x576x1536 ms", (time.time() - t0) / 5 * 1000)
