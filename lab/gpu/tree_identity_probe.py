"""Which engine setting makes speculative trees differ from plain greedy on the GPU?

The Gemma 3 270M release bench (2026-12-03) found chain output identical to plain on 56/56
prompts and tree output on 0/56. On the CPU, eager, fp32 and bf16, padded or not, trees equal
plain. This decodes with an imperfect oracle draft (tests/helpers.py's ``oracle_draft`` on a
target whose embeddings are scaled up: partial acceptance, branches beside the first) under each
engine mode, and records per mode and tree whether the tokens equal plain's and where they first
differ. Writes OUT/tree-identity.json.

    python3 lab/gpu/tree_identity_probe.py --target gemma-3-270m-q4_k_m.gguf --out DIR [--scale 12] [--new 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "tests")]
from test_engine import AUX, TREES, oracle_draft  # noqa: E402

from draftling.engine import DraftRunner, build_target, greedy_generate, speculative_generate  # noqa: E402

MODES = {
    "eager": {},
    "graphs": {"cuda_graphs": True},
    "compile": {"compile": True},
    "compile+graphs": {"compile": True, "cuda_graphs": True},
}


def load(path: str, dtype, device, scale: float):
    p = Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    return model.to(device)


def oracle_runner(model, size: int, **engine) -> DraftRunner:
    """tests/helpers.py's oracle draft for ``model`` (4 heads: Gemma's own shape cannot be
    copied), as a runner with the engine options ``engine``."""
    hidden = model.config.hidden_size
    draft = oracle_draft(model, num_key_value_heads=4, num_attention_heads=4, head_dim=hidden // 4)
    return DraftRunner(draft.to(model.device, model.dtype), model.get_input_embeddings(), size, **engine)


def probe(model, mode: str, ids, new: int, size: int) -> list[dict]:
    target = build_target(model, AUX, size, query_pad=16, attention="exact", **MODES[mode])
    plain = greedy_generate(target, ids, new)[0].tolist()
    runner = oracle_runner(model, size, **MODES[mode])
    rows = []
    for tree in TREES:
        for device_rounds in (False, True):
            out, st = speculative_generate(target, runner, ids, new, *tree, device_rounds=device_rounds)
            out = out[0].tolist()
            first = next((i for i, (a, b) in enumerate(zip(out, plain)) if a != b), None)
            rows.append(
                {
                    "mode": mode,
                    "tree": "-".join(map(str, tree)),
                    "device_rounds": device_rounds,
                    "identical": out == plain,
                    "first_difference": first,
                    "tau": round(sum(st.accept_lengths) / len(st.accept_lengths), 3),
                    "compactions": st.compactions,
                    "graphs": target.cuda_graphs,
                    "compiled": target.compile,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="a GGUF file (Gemma 3 270M here)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", type=float, default=12.0, help="embedding scale: 12 gives tau about 2 on Gemma 3")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--modes", default="eager,graphs,compile+graphs")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ids = torch.randint(0, 20000, (1, 13), generator=torch.Generator().manual_seed(1)).to(dev)
    rows, t0 = [], time.time()
    for dt in args.dtypes.split(","):
        model = load(args.target, getattr(torch, dt), dev, args.scale)
        for mode in args.modes.split(","):
            rows += [{**r, "dtype": dt} for r in probe(model, mode, ids, args.new, 13 + args.new + 40)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree-identity.json").write_text(
        json.dumps(
            {
                "target": Path(args.target).name,
                "scale": args.scale,
                "new_tokens": args.new,
                "seconds": time.time() - t0,
                "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
