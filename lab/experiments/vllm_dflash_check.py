"""vLLM (the CPU build) serving a draftling dflash export: its tokens against vLLM without
speculation, and vLLM's own acceptance counters (per draft position), on the prompts of a
draftling data file. Run with the vLLM venv's python (scripts/test_vllm.sh builds one):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python lab/experiments/vllm_dflash_check.py \\
        TARGET_DIR EXPORT_DIR DATA/val.jsonl N OUT.json

TARGET_DIR: a plain HF checkpoint of the target (for the default GGUF, the one `serve-check`
writes under ~/.cache/draftling/plain-targets/). The drafts per round are the export's own
(block size - 1). Greedy, 96 new tokens, float32, eager."""

import json
import sys
import time


def run(target: str, draft: str | None, prompts: list, k: int):
    from vllm import LLM, SamplingParams

    spec = {"model": draft, "method": "dflash", "num_speculative_tokens": k} if draft else None
    llm = LLM(
        model=target,
        speculative_config=spec,
        enforce_eager=True,
        max_model_len=2048,
        dtype="float32",
        disable_log_stats=False,
        seed=0,
    )
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=96))
    wall = time.perf_counter() - t0
    counters = {}
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            counters[m.name] = list(m.values) if hasattr(m, "values") else m.value
    return [list(o.outputs[0].token_ids) for o in outs], counters, wall


def main() -> None:
    target, draft, path, n, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    from draftling.bench.simple import sample_by_source

    # The prompts `draftling bench --num-prompts N` picks (by source), not the file's first N:
    # val.jsonl is sorted by length, so its head is the shortest, mostly chat, prompts.
    rows = [json.loads(line) for line in open(path) if line.strip()]
    rows = [r for _, _, r in sample_by_source([(r["id"], r["source"], r) for r in rows], n)]
    # The prompt is what precedes the first trained (reply) token.
    prompts = [{"prompt_token_ids": r["input_ids"][: r["loss_mask"].index(1)]} for r in rows]
    k = json.load(open(f"{draft}/config.json"))["block_size"] - 1
    spec_tokens, counters, spec_s = run(target, draft, prompts, k)
    plain_tokens, _, plain_s = run(target, None, prompts, k)
    drafts = counters.get("vllm:spec_decode_num_drafts", 0) or 1
    per_pos = counters.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
    result = {
        "prompts": len(prompts),
        "identical_to_plain": sum(a == b for a, b in zip(spec_tokens, plain_tokens)),
        "tau": 1 + counters.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts,
        "accept_rate_by_position": [a / drafts for a in per_pos],
        "counters": counters,
        "spec_s": spec_s,
        "plain_s": plain_s,
    }
    print(json.dumps(result))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":  # vLLM's workers import this module again
    main()
