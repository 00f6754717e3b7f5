"""Chain walk against the engine: the chain tau that validation's walk (train.ttt.chain_walk,
validation's `chain_tau`) computes from the draft's teacher-forced predictions on each
sequence, set beside the tau that `draftling bench` measured on the same prompts. If the
engine and training agree, the two match prompt by prompt; a gap points at the engine or
at the features it feeds the draft.

    python lab/experiments/chain_walk.py --config quickstart_cpu --draft RUN/draft \
        --data RUN/../data/val.jsonl [--bench ALLVAL_BENCH.json] [--steps 3] --out walk.json
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

from draftling.config import load_config
from draftling.data.tokenized import load_tokenized
from draftling.draft.store import load_draft
from draftling.io import write_json
from draftling.target import load_target
from draftling.train.teacher import teacher_forward
from draftling.train.ttt import ttt_unroll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="quickstart_cpu")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--data", required=True, help="a prepared (tokenized) jsonl, e.g. data/val.jsonl")
    ap.add_argument("--bench", help="a `draftling bench` results JSON over the same prompts")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    cfg = load_config(args.config)
    target = load_target(cfg.target, dtype=cfg.dtype, device="cpu", aux_layer_ids=cfg.aux_layer_ids)
    draft = load_draft(args.draft, device="cpu", dtype=torch.float32)
    examples = load_tokenized(args.data)
    rows = []
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex.input_ids])
            loss_mask = torch.tensor([ex.loss_mask])
            attn = torch.ones_like(ids)
            if not any(ex.loss_mask):
                continue
            teacher = teacher_forward(target, ids, attn, draft.t2d)
            _, counts = ttt_unroll(draft, target.input_embeddings(), teacher, ids, loss_mask, attn, args.steps)
            rounds, accepted = counts.walk_rounds, counts.walk_accepted
            rows.append(
                {
                    "id": ex.id,
                    "source": ex.source,
                    "rounds": rounds,
                    "accepted": accepted,
                    "walk_tau": (rounds + accepted) / max(rounds, 1),
                }
            )
    rounds = sum(r["rounds"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    result = {
        "config": args.config,
        "draft": args.draft,
        "data": args.data,
        "steps": args.steps,
        "sequences": len(rows),
        "walk_tau": (rounds + accepted) / max(rounds, 1),
        "per_sequence": rows,
    }
    if args.bench:
        bench = json.loads(Path(args.bench).read_text())
        name = bench["configs"][0]["name"]
        measured = {p["id"]: p[name]["tau"] for p in bench["per_prompt"]}
        pairs = [(r["walk_tau"], measured[r["id"]]) for r in rows if r["id"] in measured]
        result["bench"] = {
            "file": args.bench,
            "config": name,
            "tau": bench["configs"][0]["tau"],
            "prompts_matched": len(pairs),
            "mean_walk_minus_bench_per_prompt": statistics.fmean(w - b for w, b in pairs) if pairs else None,
        }
    write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "per_sequence"}, indent=1))


if __name__ == "__main__":
    main()
