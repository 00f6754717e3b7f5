"""The quickstart target (SmolLM2-135M, fp32 from the GGUF) against the same model with torch's
dynamic int8 quantization of every nn.Linear, on the CPU: one prefill of 64 x 100 tokens and ten
batch-64 decode steps after it (HF forward with its cache), and how far the int8 model's last
hidden states and greedy tokens drift from fp32 on that batch.

    python lab/experiments/int8_dynamic_cpu.py OUT.json
"""

import json
import platform
import sys
import time

import torch

from draftling.config import load_config
from draftling.target import load_target


def timed(model, x):
    with torch.no_grad():
        pkv = model(x, use_cache=True).past_key_values  # warm-up; its cache serves the steps
        t0 = time.perf_counter()
        out = model(x, output_hidden_states=True)
        prefill = time.perf_counter() - t0
        nxt = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(10):
            o = model(nxt, past_key_values=pkv, use_cache=True)
            pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
        step = (time.perf_counter() - t0) / 10
    return prefill, step, out


cfg = load_config("quickstart_cpu", [])
target = load_target(cfg.target, dtype="float32", device="cpu", aux_layer_ids=cfg.aux_layer_ids)
x = torch.randint(0, target.model.config.vocab_size, (64, 100), generator=torch.Generator().manual_seed(0))
fp_prefill, fp_step, fp_out = timed(target.model, x)
int8 = torch.ao.quantization.quantize_dynamic(target.model, {torch.nn.Linear}, dtype=torch.qint8)
q_prefill, q_step, q_out = timed(int8, x)
h_fp, h_q = fp_out.hidden_states[-2], q_out.hidden_states[-2]
res = {
    "what": "SmolLM2-135M fp32 vs torch dynamic int8 (nn.Linear), CPU, HF forward",
    "date": time.strftime("%Y-%m-%d"),
    "cpu": platform.processor() or platform.machine(),
    "threads": torch.get_num_threads(),
    "batch": 64,
    "prompt_tokens": 100,
    "fp32": {
        "prefill_s": round(fp_prefill, 2),
        "prefill_tok_s": round(6400 / fp_prefill, 1),
        "decode_step_s": round(fp_step, 3),
        "decode_tok_s": round(64 / fp_step, 1),
    },
    "int8_dynamic": {
        "prefill_s": round(q_prefill, 2),
        "prefill_tok_s": round(6400 / q_prefill, 1),
        "decode_step_s": round(q_step, 3),
        "decode_tok_s": round(64 / q_step, 1),
    },
    "drift": {
        "relative_l2_of_layer_L-1_states": round(float((h_q - h_fp).norm() / h_fp.norm()), 4),
        "greedy_next_token_agreement": round(
            float((q_out.logits.argmax(-1) == fp_out.logits.argmax(-1)).float().mean()), 4
        ),
    },
    "note": "random token ids, one run; the int8 model's activation scales are per batch, so its "
    "outputs also depend on what else is in the batch",
}
print(json.dumps(res, indent=1))
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
