"""How confident the target is at validation's reply positions, and how many of its argmax
tokens a draft vocab holds, by confidence bin: out-of-vocab tokens at confident positions are
acceptance the draft can never earn. Reads the kept final states (data.keep_teacher_states).

    python lab/experiments/target_confidence.py DATA_DIR OUT.json
"""

import json
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from draftling.config import load_config
from draftling.data.tokenized import load_tokenized
from draftling.draft.vocab import load_vocab
from draftling.target import load_target

BINS = ((0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.01))


@torch.no_grad()
def main(data_dir: str, out_path: str) -> None:
    data = Path(data_dir)
    cfg = load_config("quickstart_cpu", [])
    target = load_target(cfg.target, dtype="float32", device="cpu", aux_layer_ids=cfg.aux_layer_ids)
    head = target.model.get_output_embeddings().weight
    states = safe_open(str(data / "teacher_states_val.safetensors"), "pt")
    final, offsets = states.get_tensor("final"), states.get_tensor("offsets").tolist()
    vocab = load_vocab(data / "vocab.safetensors")
    probs, in_vocab = [], []
    for j, row in enumerate(load_tokenized(data / "val.jsonl")):
        mask = torch.tensor(row.loss_mask)
        at = (mask[1:] == 1).nonzero().flatten()  # the state at t predicts reply token t + 1
        p = (final[offsets[j] : offsets[j + 1]][at] @ head.T).softmax(-1).max(-1)
        probs.append(p.values)
        in_vocab.append(vocab.t2d[p.indices])
    probs, in_vocab = torch.cat(probs), torch.cat(in_vocab)
    bins = []
    for lo, hi in BINS:
        sel = (probs >= lo) & (probs < hi)
        bins.append(
            {
                "top1_prob": [lo, min(hi, 1.0)],
                "share": round(float(sel.float().mean()), 4),
                "argmax_in_draft_vocab": round(float(in_vocab[sel].float().mean()), 4),
            }
        )
    result = {
        "what": __doc__.strip().splitlines()[0],
        "date": time.strftime("%Y-%m-%d"),
        "data_dir": data_dir,
        "positions": len(probs),
        "mean_top1_prob": round(float(probs.mean()), 4),
        "bins": bins,
    }
    print(json.dumps(result, indent=1))
    Path(out_path).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
