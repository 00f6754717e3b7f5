"""One regeneration batch four ways: states kept or not, CPU weight layout (column-major, as
load_target leaves it) or row-major. Usage: python3 lab/experiments/regen_keep_states_ab.py [OUT.json]"""

import json
import sys
import time

import torch

from draftling.config import RegenConfig
from draftling.data.prompts import load_conversations
from draftling.data.regen import regenerate
from draftling.data.sources import resolve_prompt_path
from draftling.target import load_target

target = load_target(None)
convs = load_conversations(resolve_prompt_path("shared:instruct.jsonl"))[:64]
cfg = RegenConfig(max_new_tokens=64, batch_size=64)
seconds = {}


def run(tag, keep):
    t0 = time.perf_counter()
    records = list(regenerate(target, convs, cfg, progress=False, keep_states=keep))
    seconds[tag] = time.perf_counter() - t0
    print(tag, f"{seconds[tag]:.1f} s", sum(r["provenance"]["reply_tokens"] for r in records), "reply tokens")


run("transposed_keep", True)
run("transposed_nokeep", False)
for m in target.model.modules():  # back to row-major
    if isinstance(m, torch.nn.Linear) and not m.weight.is_contiguous():
        m.weight.data = m.weight.data.contiguous()
run("rowmajor_nokeep", False)
run("rowmajor_keep", True)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump({"seconds": seconds, "prompts": len(convs), "max_new_tokens": cfg.max_new_tokens}, f, indent=2)
