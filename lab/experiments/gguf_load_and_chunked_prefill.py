"""Two CPU speed-ups of the data stage, measured on the default target (one run each):

1. Loading the GGUF target with ``gguf_parsed_once`` (the file parsed once) vs without
   (transformers parses it for the tokenizer, the config and the weights). Each load runs in
   a fresh subprocess; imports are timed separately and excluded.
2. Regeneration's prefill of a batch of long prompts in one forward vs in pieces
   (``data.regen.prefill_chunk_tokens``), with the replies and kept states compared.

    python lab/experiments/gguf_load_and_chunked_prefill.py OUT.json
"""

import json
import subprocess
import sys
import time

LOAD = r"""
import time, json
t0 = time.perf_counter()
import torch, transformers, gguf
from draftling.target import load as L
t1 = time.perf_counter()
spec = L.resolve_target(None)
if MODE == "once":
    t = L.load_target(None, dtype="float32", device="cpu")
else:
    t = L._load_target(spec, "float32", "cpu", None, None, None)
t2 = time.perf_counter()
print(json.dumps({"imports_s": t1 - t0, "load_s": t2 - t1}))
"""


def timed_load(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", f"MODE={mode!r}\n" + LOAD], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(out_path: str) -> None:
    result = {"what": __doc__.strip().splitlines()[0], "machine": "this 2-core CPU machine"}
    result["load_without_once"] = timed_load("plain")
    result["load_with_once"] = timed_load("once")
    print(result, flush=True)

    import torch

    from draftling.config import load_config
    from draftling.data.prompts import load_conversations
    from draftling.data.regen import regenerate
    from draftling.data.sources import find_shared_prompts
    from draftling.target import load_target

    cfg = load_config("quickstart_cpu", [])
    target = load_target(cfg.target, dtype=cfg.dtype, device="cpu", aux_layer_ids=cfg.aux_layer_ids)
    convs = load_conversations(find_shared_prompts() / "sharegpt.jsonl")[:64]
    rc = cfg.data.regen
    rc.batch_size, rc.max_new_tokens = 64, 4
    runs = {}
    for budget in (0, 4096):
        rc.prefill_chunk_tokens = budget
        t0 = time.perf_counter()
        rows = list(
            regenerate(target, convs, rc, max_prompt_tokens=cfg.data.max_tokens, progress=False, keep_states=True)
        )
        runs[budget] = (time.perf_counter() - t0, rows)
    (t_one, rows_one), (t_chunk, rows_chunk) = runs[0], runs[4096]
    same_tokens = all(a["messages"] == b["messages"] for a, b in zip(rows_one, rows_chunk))
    max_state_diff = max(float((a["_states"][1] - b["_states"][1]).abs().max()) for a, b in zip(rows_one, rows_chunk))
    result["prefill"] = {
        "prompts": len(rows_one),
        "max_new_tokens": rc.max_new_tokens,
        "prompt_tokens": sum(r["provenance"]["prompt_tokens"] for r in rows_one),
        "one_forward_s": t_one,
        "chunks_of_4096_tokens_s": t_chunk,
        "same_replies": same_tokens,
        "max_abs_aux_state_diff": max_state_diff,
        "torch_threads": torch.get_num_threads(),
    }
    print(result, flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
