"""Regeneration speed by batch size on the CPU: the first 128 sharegpt prompts (<= 300 prompt tokens),
the quickstart profile's generation settings.

    python lab/experiments/regen_batch_speed.py 64 128
"""

import sys
import time

from draftling.config import load_config
from draftling.data.prompts import load_conversations
from draftling.data.regen import regenerate
from draftling.data.sources import find_shared_prompts
from draftling.target import load_target

cfg = load_config("quickstart_cpu", [])
t = load_target(cfg.target, dtype=cfg.dtype, device="cpu", aux_layer_ids=cfg.aux_layer_ids)
convs = load_conversations(find_shared_prompts() / "sharegpt.jsonl")[:128]
for bs in map(int, sys.argv[1:]):
    rc = cfg.data.regen
    rc.batch_size = bs
    t0 = time.perf_counter()
    rows = list(regenerate(t, convs, rc, max_prompt_tokens=300, progress=False))
    toks = sum(r["provenance"]["reply_tokens"] for r in rows)
    dt = time.perf_counter() - t0
    print("BS", bs, "prompts", len(rows), "s", round(dt, 1), "reply tok/s", round(toks / dt, 1), flush=True)
