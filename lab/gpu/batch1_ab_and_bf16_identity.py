"""Device call: two checks behind the serving-under-load figures, in one run.

1. Batch-1 A/B: greedy_generate on all v1 prompts (256 new tokens, graphs + compiled layers,
   matmul attention, unpadded: the release bench's plain reference) with the engine before the
   batched engine (``--old-src``, a `git archive` of the commit before it) and with this tree's,
   each in its own process, one after the other on the same GPU.
2. bf16 identity: regeneration replies of the same starter prompts from HF generate (batch
   768), the batched engine at 256 rows and at 64 rows: identical fractions pairwise and the
   mean length of the common token prefix, so a low engine-vs-HF figure can be told apart from
   bf16 batch-composition effects within one implementation.

Usage: python3 lab/gpu/batch1_ab_and_bf16_identity.py --target GGUF --old-src DIR --out DIR
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

STARTER = Path(__file__).resolve().parents[2] / "src" / "draftling" / "data" / "starter"


def child(target_path: str) -> None:
    """One timing of greedy_generate, with whichever draftling PYTHONPATH names."""
    import draftling
    from draftling.bench.release import load_prompt_set
    from draftling.engine import CachedTarget, greedy_generate
    from draftling.target import load_target

    target = load_target(target_path, dtype="bfloat16", device="cuda")
    _, prompts = load_prompt_set("v1", target)
    ids = [torch.tensor([p.input_ids], device="cuda") for p in prompts]
    eng = CachedTarget.from_hf(
        target.model,
        target.aux_layer_ids,
        max(x.shape[1] for x in ids) + 272,
        cuda_graphs=True,
        compile=True,
        query_pad=0,
        attention="matmul",
    )
    eos = target.stop_token_ids()
    greedy_generate(eng, ids[0], 32, eos_ids=eos)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = [greedy_generate(eng, x, 256, eos_ids=eos)[0].tolist() for x in ids]
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "code": draftling.__file__,
                "prompts": len(ids),
                "tokens": sum(map(len, outs)),
                "seconds": s,
                "tok_s": sum(map(len, outs)) / s,
                "outputs": outs,
            }
        )
    )


def ab(target_path: str, old_src: str) -> dict:
    res = {}
    for name, src in (("before", old_src), ("after", str(Path(__file__).resolve().parents[2] / "src"))):
        env = {**os.environ, "PYTHONPATH": f"/tmp/site:{src}"}
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--target", target_path],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        res[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(name, f"{res[name]['tok_s']:.1f} tok/s", flush=True)
    same = res["before"].pop("outputs") == res["after"].pop("outputs")
    return {**res, "identical_outputs": same, "after_over_before": res["after"]["tok_s"] / res["before"]["tok_s"]}


def prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def identity(target_path: str, per_file: int) -> dict:
    from draftling.data.prompts import load_conversations
    from draftling.data.regen import render_prompt_ids
    from draftling.engine.replies import ReplyEngine
    from draftling.target import load_target

    target = load_target(target_path, dtype="bfloat16", device="cuda")
    tok, eos = target.tokenizer, target.stop_token_ids()
    convs = [c for f in ("chat", "code", "math") for c in load_conversations(STARTER / f"{f}.jsonl")[:per_file]]
    prompts = sorted((render_prompt_ids(tok, c) for c in convs), key=len)
    replies = {
        "engine_256": [r for r, _ in ReplyEngine(target.model, 256)(prompts, 256, eos)],
        "engine_64": [r for r, _ in ReplyEngine(target.model, 64)(prompts, 256, eos)],
        "hf_768": hf_replies(target, prompts, eos, 768),
    }
    out = {}
    names = list(replies)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            pairs = list(zip(replies[a], replies[b]))
            out[f"{a}_vs_{b}"] = {
                "identical_fraction": sum(x == y for x, y in pairs) / len(pairs),
                "mean_common_prefix_tokens": sum(prefix(x, y) for x, y in pairs) / len(pairs),
                "mean_reply_tokens": sum(len(x) for x, _ in pairs) / len(pairs),
            }
            print(a, b, json.dumps(out[f"{a}_vs_{b}"]), flush=True)
    return {"prompts": len(prompts), "max_new_tokens": 256, **out}


def hf_replies(target, prompts, eos, batch):
    pad = target.tokenizer.pad_token_id
    out = []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s : s + batch]
        w = max(map(len, chunk))
        ids = torch.full((len(chunk), w), pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, w - len(p) :], att[i, w - len(p) :] = torch.tensor(p), 1
        gen = target.model.generate(
            input_ids=ids.cuda(),
            attention_mask=att.cuda(),
            max_new_tokens=256,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=eos,
        )
        for row in gen[:, w:].tolist():
            cut = next((i for i, t in enumerate(row) if t in eos), len(row))
            out.append(row[:cut])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--old-src")
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--per-file", type=int, default=256)
    a = ap.parse_args()
    if a.child:
        return child(a.target)
    res = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "target": "SmolLM2-135M-Instruct",
        "dtype": "bfloat16",
        "batch1_ab": ab(a.target, a.old_src),
        "bf16_identity": identity(a.target, a.per_file),
    }
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "batch1-ab-and-bf16-identity.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
