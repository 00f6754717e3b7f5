"""Hold out whole tasks of an agent workload for serving-speed selection (lab/gpu/adapt_airline.sh).

Writes, into --out:
  ids.txt        every conversation id of the held-out tasks: `draftling data --exclude-ids`
                 keeps them out of training and validation
  prompts.jsonl  --turns assistant turns per held-out conversation (a seeded sample of those whose
                 prefix fits --max-prompt-tokens, drawn as `data.rollout_max_turns` draws), each its original prefix as a prompt-set record
                 (workload = --workload): `draftling select --prompts`
  heldout.json   what was held out and how

Tasks are grouped as `data.split_key=task` groups them (data/split.py task_identity), so no
trial of a held-out task reaches training.
"""

import argparse
import json
from pathlib import Path

from draftling.config import DataConfig
from draftling.data.prepare import rollout_prompts
from draftling.data.sources import load_prompt_spec
from draftling.data.split import split_by_task, task_identity
from draftling.io import write_json, write_jsonl, write_text
from draftling.target.load import load_target_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="prompt spec, e.g. shared:agent_tau_airline.jsonl")
    ap.add_argument("--target", default=None, help="its tokenizer measures the prefixes (default: embedded SmolLM2)")
    ap.add_argument("--fraction", type=float, default=0.2, help="share of tasks held out")
    ap.add_argument("--turns", type=int, default=1, help="prompts per held-out conversation")
    ap.add_argument("--max-prompt-tokens", type=int, default=7900)
    ap.add_argument("--workload", default="agent_airline")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    tok = load_target_tokenizer(args.target).tokenizer
    convs = load_prompt_spec(args.prompts)
    _, held = split_by_task(convs, args.fraction, seed=args.seed, key="task")
    # The turns as `draftling data` samples them (data.rollout_max_turns, seeded by data.seed).
    turns = rollout_prompts(
        tok, held, DataConfig(rollout_max_turns=args.turns, seed=args.seed), {"prompt_limit": args.max_prompt_tokens}
    )
    records = [
        {
            "id": t.id,
            "workload": args.workload,
            "source": t.source,
            "messages": t.messages,
            **({"tools": t.tools} if t.tools else {}),
        }
        for t in turns
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "ids.txt", "".join(f"{c.id}\n" for c in held))
    write_jsonl(out / "prompts.jsonl", records)
    tasks = sorted({task_identity(c) for c in held})
    write_json(
        out / "heldout.json",
        {
            "prompts": args.prompts,
            "fraction": args.fraction,
            "seed": args.seed,
            "tasks": tasks,
            "conversations": len(held),
            "prompt_records": len(records),
            "max_prompt_tokens": args.max_prompt_tokens,
        },
    )
    print(json.dumps({"tasks": len(tasks), "conversations": len(held), "prompts": len(records)}))


if __name__ == "__main__":
    main()
