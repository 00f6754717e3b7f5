"""bf16 against fp32 on this CPU: matmuls at the quickstart's shapes (the target's projections
over a regeneration batch, a long teacher forward, the output head), the probe's own decision
(draftling.hardware), and the teacher's full-vocab head plus argmax over 2048 tokens.

    python lab/experiments/cpu_bf16_matmul.py OUT.json
"""

import json
import platform
import sys
import time
from pathlib import Path

import torch

from draftling.hardware import bf16_matmul_is_faster

SHAPES = ((64, 576, 1536), (1536, 576, 1536), (64, 576, 49152), (1, 576, 1536))


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(out_path: str) -> None:
    torch.set_num_threads(2)
    rows = []
    for m, k, n in SHAPES:
        row = {"shape": [m, k, n]}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
            s = best_seconds(lambda: a @ b, max(3, int(2e9 / (2 * m * k * n))))
            row[str(dtype)[6:]] = {"ms": round(s * 1e3, 3), "gflop_s": round(2 * m * k * n / s / 1e9, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    head = torch.randn(49152, 576) * 0.05
    x = torch.randn(2048, 576)
    head_bf16 = head.to(torch.bfloat16)
    fp32 = best_seconds(lambda: (x @ head.T).argmax(-1), 3)
    bf16 = best_seconds(lambda: (x.to(torch.bfloat16) @ head_bf16.T).argmax(-1), 3)
    result = {
        "what": __doc__.strip().splitlines()[0],
        "date": time.strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "threads": 2,
        "matmuls": rows,
        "probe_says_bf16_faster": bf16_matmul_is_faster("cpu"),
        "teacher_head_argmax_2048_tokens_ms": {"float32": round(fp32 * 1e3), "bfloat16": round(bf16 * 1e3)},
    }
    print(json.dumps(result, indent=1))
    Path(out_path).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
