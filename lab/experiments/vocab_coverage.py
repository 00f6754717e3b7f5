"""Validation coverage of the draft vocab against its size and vocab.prompt_weight: the share
of validation's reply tokens that the vocab holds (the ceiling on step-0 accuracy), for a
data directory written by `draftling data` with the quickstart_cpu profile's prompt files.

The prompt counts are recounted here from the profile's prompt files less the data's
validation ids, as `draftling data` now does, so an older data directory works too.

    python lab/experiments/vocab_coverage.py DATA_DIR OUT.json
"""

import json
import sys
import time
from pathlib import Path

import torch

from draftling.config import load_config
from draftling.data.prepare import load_prompt_files, pool_prompt_counts
from draftling.data.tokenized import load_tokenized
from draftling.draft.vocab import build_vocab, prompt_weighted_rank, token_counts
from draftling.target.load import load_target_config, load_target_tokenizer

SIZES = (2048, 4096, 8192)
WEIGHTS = (0.0, 0.1, 1.0, 3.0)


def main(data_dir: str, out_path: str) -> None:
    cfg = load_config("quickstart_cpu", [])
    vocab_size = load_target_config(cfg.target).vocab_size
    tok = load_target_tokenizer(cfg.target).tokenizer
    train = load_tokenized(Path(data_dir) / "train.jsonl")
    val = load_tokenized(Path(data_dir) / "val.jsonl")
    reply = token_counts(((r.input_ids, r.loss_mask) for r in train), vocab_size)
    val_counts = token_counts(((r.input_ids, r.loss_mask) for r in val), vocab_size)
    pool: list = []
    load_prompt_files(cfg, pool)
    counts, kept = pool_prompt_counts(tok, pool, val, cfg.data.split_key)
    prompt = torch.zeros(vocab_size, dtype=torch.long)
    prompt[: len(counts)] = counts
    rows = []
    for size in SIZES:
        for weight in WEIGHTS:
            rank = prompt_weighted_rank(reply, prompt, weight) if weight else None
            vocab = build_vocab(reply, size, "coverage", rank)
            coverage = float(val_counts[vocab.t2d].sum()) / float(val_counts.sum())
            rows.append({"size": size, "prompt_weight": weight, "val_coverage": round(coverage, 4)})
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "what": __doc__.strip().splitlines()[0],
        "date": time.strftime("%Y-%m-%d"),
        "data_dir": str(data_dir),
        "train_sequences": len(train),
        "val_sequences": len(val),
        "distinct_reply_tokens": int((reply > 0).sum()),
        "prompt_conversations": kept,
        "prompt_tokens": int(prompt.sum()),
        "coverage": rows,
    }
    Path(out_path).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
