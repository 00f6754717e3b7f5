"""Build the starter prompt corpus that ships inside the package (src/draftling/data/starter/).

Only sources whose data license allows redistribution (see ATTRIBUTION.md written beside the
files): GSM8K (MIT), MBPP (CC-BY-4.0), self-instruct (Apache-2.0) and the OpenAssistant
evaluation prompts (Apache-2.0). Alpaca (CC BY-NC upstream) and ShareGPT (unclear) are left
out. Prompts that share a user turn with the release bench's prompt set v1 are dropped, so
that bench stays out of distribution for a head trained on the starter corpus.

    python3 scripts/make_starter_corpus.py [--shared ../shared/data/prompts]

The output is deterministic: the same input gives byte-identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

from draftling.data.prompts import load_conversations
from draftling.data.sources import find_shared_prompts, prompt_sets_dir, starter_dir

# name -> (shared file, sources kept, how many at most: 0 = all)
PLAN = {
    "chat": ("instruct.jsonl", {"oasst", "self-instruct"}, 0),
    "code": ("code_mbpp.jsonl", {"mbpp"}, 0),
    "math": ("math_gsm8k_train.jsonl", {"gsm8k-train"}, 3000),
}
SEED = 0


def user_texts(conv) -> set[str]:
    return {m["content"].strip() for m in conv.messages if m["role"] == "user"}


def record(conv) -> dict:
    out = {"id": conv.id, "source": conv.source, "category": conv.category, "messages": conv.messages}
    if conv.tools:
        out["tools"] = conv.tools
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", type=Path, default=None, help="the shared prompt folder")
    args = ap.parse_args()
    shared = args.shared or find_shared_prompts()
    if shared is None:
        raise SystemExit("cannot find shared/data/prompts; pass --shared")
    bench_texts = set().union(*map(user_texts, load_conversations(prompt_sets_dir() / "v1.jsonl")))
    out_dir = starter_dir()
    for name, (file, sources, cap) in PLAN.items():
        convs = [
            c for c in load_conversations(shared / file) if c.source in sources and not (user_texts(c) & bench_texts)
        ]
        if cap and len(convs) > cap:
            convs = sorted(random.Random(SEED).sample(convs, cap), key=lambda c: convs.index(c))
        text = "".join(json.dumps(record(c), ensure_ascii=False) + "\n" for c in convs)
        path = out_dir / f"{name}.jsonl"
        path.write_text(text, encoding="utf-8")
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        counts = {s: sum(c.source == s for c in convs) for s in sorted(sources)}
        print(f"starter:{name}: {len(convs)} prompts {counts}, {len(text) / 1e6:.2f} MB, sha256 {digest}")


if __name__ == "__main__":
    main()
