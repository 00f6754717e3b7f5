"""CPU decode cost with row-major vs column-major Linear weights (the layout load_target now
leaves): target forward at q = 1/4/8 queries, plain greedy and chain-3 speculative decoding
of one prompt with a trained head. Run with the weights as loaded, then after transposing.
Usage: python3 lab/experiments/cpu_weight_layout_decode.py DRAFT_DIR

As run on 2026-12-01 on a 2-core Xeon, before 5150e62 (bench/results/
2026-12-01-cpu-weight-layout-0572392-cpu-xeon-2core/), this loaded the target row-major (before
the layout change); with the change in place the first half already measures column-major weights."""

import sys
import time

import torch

from draftling.bench.simple import build_engine
from draftling.engine.generate import greedy_generate, speculative_generate
from draftling.engine.target_model import causal_mask
from draftling.export.formats import load_any_draft
from draftling.target import load_target

tg = load_target(None, dtype="float32")
draft = load_any_draft(sys.argv[1], torch.device("cpu"), torch.float32)
ct, runner = build_engine(tg, draft, 512)
ids = torch.tensor(
    [
        tg.tokenizer("<|im_start|>user\nWrite a python function to reverse a list.<|im_end|>\n<|im_start|>assistant\n")[
            "input_ids"
        ]
    ]
)


def measure(tag):
    greedy_generate(ct, ids, 8)
    speculative_generate(ct, runner, ids, 8, 3, 1, 4)
    with torch.no_grad():
        for q in (1, 4, 8):
            p = torch.arange(100, 100 + q)
            m, x = causal_mask(100, q, 512, "cpu"), torch.zeros(1, q, dtype=torch.long)
            ct.decode(x, p, p, m)
            t = time.time()
            for _ in range(10):
                ct.decode(x, p, p, m)
            print(tag, "decode q", q, (time.time() - t) / 10 * 1000, "ms")
    t = time.time()
    greedy_generate(ct, ids, 64)
    print(tag, "plain ms/tok", (time.time() - t) / 64 * 1000)
    t = time.time()
    _, st = speculative_generate(ct, runner, ids, 64, 3, 1, 4)
    dt = time.time() - t
    print(
        tag,
        "spec rounds",
        len(st.accept_lengths),
        "tau",
        st.tau,
        "ms/round",
        dt / len(st.accept_lengths) * 1000,
        "tok/s",
        64 / dt,
    )


measure("as loaded")
for mod in tg.model.modules():
    if isinstance(mod, torch.nn.Linear) and mod.weight.shape[0] < 10000:  # not the tied head
        mod.weight.data = mod.weight.data.t().contiguous().t()
measure("column-major")
