"""Why decoding accepts less than validation predicts: for the prompts a quickstart bench ran,
compare the bench's per-depth acceptance with the teacher-forced TTT metrics on the same prompts'
regenerated replies, and count the reply positions whose greedy token is outside the draft vocab
(the TTT metrics leave those out; decoding always rejects them). Writes OUT.json.

    python lab/experiments/bench_vs_teacher_forced.py QUICKSTART_DIR OUT.json
"""

import json
import sys
from pathlib import Path

from draftling.config import load_config
from draftling.data.tokenized import load_tokenized
from draftling.draft.store import load_draft
from draftling.io import write_json
from draftling.target import load_target
from draftling.train.batches import evaluate
from draftling.train.dataset import collate
from draftling.train.teacher import teacher_forward


def main(run: Path, out: Path) -> dict:
    cfg = load_config(str(run / "config.yaml"), [])
    target = load_target(cfg.target, dtype="float32", device="cpu", aux_layer_ids=cfg.aux_layer_ids)
    draft = load_draft(run / "run" / "draft", "cpu")
    bench = json.loads((run / "bench.json").read_text())
    ids = [p["id"] for p in bench["per_prompt"]]
    rows = [r for r in load_tokenized(run / "data" / "val.jsonl") if r.id in ids]
    cfg.train.batch_size = 1
    forced = evaluate(draft, target, rows, cfg, "cpu", len(rows))
    reply, in_vocab = 0, 0
    for r in rows:
        batch = collate([r], target.tokenizer.pad_token_id)
        teacher = teacher_forward(target, batch["input_ids"], batch["attention_mask"], draft.t2d)
        label_is_reply = batch["loss_mask"].bool()[0, 2:]  # step 0 at t predicts x_{t+2}
        reply += int(label_is_reply.sum())
        in_vocab += int((label_is_reply & teacher.in_draft[0, 1:-1]).sum())
    chain = bench["configs"][0]
    result = {
        "run": str(run),
        "bench_prompts": ids,
        "decoding_tau": chain["tau"],
        "decoding_accept_rate_by_depth": chain["accept_rate_by_depth"],
        "teacher_forced_acc": forced["acc"],
        "teacher_forced_cond_acc": forced["cond_acc"],
        "teacher_forced_sim_tau": forced["sim_tau"],
        "reply_positions": reply,
        "greedy_token_in_draft_vocab": in_vocab,
        "in_vocab_share": round(in_vocab / max(reply, 1), 4),
        "step0_acc_over_all_reply_positions": round(forced["acc"][0] * in_vocab / max(reply, 1), 4),
        "note": "teacher-forced metrics are averaged over positions; decoding's per-depth rates are "
        "averaged over rounds, which start more often where the draft fails",
    }
    write_json(out, result)
    return result


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2])), indent=1))
