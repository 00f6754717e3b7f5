"""Quickstart variant: retrain and re-bench on the replies of an earlier quickstart run (its
data/replies.jsonl), with config overrides, so a training change is compared on the same data
without regenerating it. Writes OUT_DIR/variant.json and prints it.

    python lab/experiments/quickstart_variant.py OUT_DIR EARLIER_RUN/data vocab.size=8192
"""

import json
import sys
import time
from pathlib import Path

from draftling.bench.simple import run_bench
from draftling.config import load_config
from draftling.data.prepare import tokenize_records
from draftling.draft.vocab import build_vocab_file
from draftling.io import write_json, write_jsonl
from draftling.target import load_target
from draftling.train.trainer import train


def main(out: Path, earlier_data: Path, overrides: list[str]) -> dict:
    cfg = load_config("quickstart_cpu", overrides)
    target = load_target(cfg.target, dtype=cfg.dtype, device="cpu", aux_layer_ids=cfg.aux_layer_ids)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    lines = (earlier_data / "replies.jsonl").read_text().splitlines()
    replies = [json.loads(line) for line in lines if line.strip()]
    for split in ("train", "val"):
        rows = tokenize_records(
            target, [r for r in replies if r["split"] == split], cfg.data.min_tokens, cfg.data.max_tokens
        )
        write_jsonl(data / f"{split}.jsonl", rows)
    build_vocab_file(data / "train.jsonl", target.config.vocab_size, cfg.vocab.size, data / "vocab.safetensors")
    t0 = time.perf_counter()
    result = train(cfg, target, out / "run", data / "train.jsonl", data / "val.jsonl", data / "vocab.safetensors")
    train_s = time.perf_counter() - t0
    bench = run_bench(cfg, target, out / "run" / "draft", data / "val.jsonl", out=out / "bench.json")
    chain = bench["configs"][0]
    summary = {
        "overrides": overrides,
        "earlier_data": str(earlier_data),
        "tau_chain3": chain["tau"],
        "identical_to_greedy": chain["identical_to_greedy"],
        "val": result.get("val"),
        "train_steps": result["steps"],
        "train_s": round(train_s, 1),
        "caveats": bench["caveats"],
    }
    write_json(out / "variant.json", summary)
    return summary


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])))
