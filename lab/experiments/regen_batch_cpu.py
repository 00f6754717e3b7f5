"""Regeneration throughput on the CPU against the batch size: the quickstart's data stage is
compute-bound, so a batch that generates faster buys more replies in the same minutes.
The same 128 prompts (the quickstart's mix: the first 32 of each file's seeded sample, with
the quickstart_cpu profile's keep_teacher_states) with 96 new tokens, once per batch size.
One run each.

    python lab/experiments/regen_batch_cpu.py OUT.json [BATCH ...]   # default: 64 128
"""

import json
import platform
import sys
import time

from draftling.config import load_config
from draftling.data.prepare import load_prompt_files
from draftling.data.regen import regenerate
from draftling.io import write_json
from draftling.target import load_target


def main(out_path: str, batches: list[int]) -> None:
    cfg = load_config("quickstart_cpu", [])
    target = load_target(cfg.target, dtype=cfg.dtype, device="cpu", aux_layer_ids=cfg.aux_layer_ids)
    convs, _ = load_prompt_files(cfg)
    per_file = cfg.data.max_prompts_per_file
    convs = [c for i in range(0, len(convs), per_file) for c in convs[i : i + 32]]
    rc = cfg.data.regen
    runs = []
    for batch in batches:
        rc.batch_size = batch
        t0 = time.perf_counter()
        rows = list(
            regenerate(
                target,
                convs,
                rc,
                max_prompt_tokens=cfg.data.max_tokens,
                progress=False,
                keep_states=cfg.data.keep_teacher_states,
            )
        )
        dt = time.perf_counter() - t0
        tokens = sum(r["provenance"]["reply_tokens"] for r in rows)
        runs.append(
            {
                "batch_size": batch,
                "prompts": len(rows),
                "reply_tokens": tokens,
                "s": round(dt, 1),
                "reply_tok_s": round(tokens / dt, 1),
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    write_json(
        out_path,
        {
            "what": __doc__.strip().splitlines()[0],
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {cfg.device}, torch threads as default",
            "max_new_tokens": rc.max_new_tokens,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], [int(b) for b in sys.argv[2:]] or [64, 128])
