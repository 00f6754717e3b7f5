"""The real SmolLM2 target's forward on this CPU with row-major against column-major Linear
weights, in fp32 and bf16, beside what hardware.column_major_linear_is_faster decides for
each dtype (load_target lays the weights out by that decision).
Usage: python3 lab/experiments/cpu_weight_layout_by_dtype.py OUT.json"""

import json
import platform
import sys
import time

import torch

from draftling.hardware import bf16_matmul_is_faster, column_major_linear_is_faster
from draftling.target import load_target


def forward_ms(model, b, t, n=3):
    x = torch.randint(0, 40000, (b, t))
    with torch.no_grad():
        model(x)
        start = time.perf_counter()
        for _ in range(n):
            model(x)
    return round((time.perf_counter() - start) / n * 1000, 1)


def lay_out(model, column: bool):
    head = model.get_output_embeddings()
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod is not head:
            w = mod.weight.data.contiguous()
            mod.weight.data = w.t().contiguous().t() if column else w


result = {
    "machine": platform.processor() or platform.machine(),
    "threads": torch.get_num_threads(),
    "torch": torch.__version__,
    "bf16_matmul_is_faster": bf16_matmul_is_faster("cpu"),
    "dtypes": {},
}
for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    model = load_target(None, dtype=name).model
    row = {"probe_says_column_major": column_major_linear_is_faster(dtype)}
    for column in (False, True):
        lay_out(model, column)
        key = "column_major" if column else "row_major"
        row[key] = {f"fwd_{b}x{t}_ms": forward_ms(model, b, t) for b, t in ((1, 4), (1, 64))}
    result["dtypes"][name] = row
    print(name, row, flush=True)
    del model
json.dump(result, open(sys.argv[1], "w"), indent=1)
