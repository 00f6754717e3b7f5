"""Before/after of a change to the host-round commit, in one run: the round split (draft, verify,
accept, commit ms) of speculative decoding on a real target through each of two source trees.

    python3 lab/gpu/commit_ab.py --target GGUF --before SRC_DIR --out DIR [--graphs-only]

Each tree runs in its own process (PYTHONPATH=SRC_DIR) on the same prompt with the same oracle
draft (tests/helpers.py's, embeddings scaled x12, as tree_identity_probe.py), bf16, CUDA
graphs (and compile unless --graphs-only), timed host rounds, then three untimed repeats for tok/s.
Writes DIR/commit-ab.json: per tree and config, the round split, tau and identity to plain.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def one(args) -> dict:
    import torch

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts" / "gpu")]
    from test_engine import AUX
    from tree_identity_probe import load, oracle_runner

    from draftling.engine import build_target, greedy_generate, speculative_generate

    dev = torch.device(args.device)
    model = load(args.target, torch.bfloat16, dev, 12.0)
    ids = torch.randint(0, 20000, (1, 13), generator=torch.Generator().manual_seed(1)).to(dev)
    opts = dict(cuda_graphs=True, compile=not args.graphs_only)
    size = 13 + args.new + 40
    target = build_target(model, AUX, size, query_pad=16, attention="exact", **opts)
    plain = greedy_generate(target, ids, args.new)[0].tolist()
    runner = oracle_runner(model, size, **opts)
    rows = {}
    for tree in ((3, 1, 4), (3, 4, 8)):
        speculative_generate(target, runner, ids, args.new, *tree, timing=True)  # captures
        out, st = speculative_generate(target, runner, ids, args.new, *tree, timing=True)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(3):
            speculative_generate(target, runner, ids, args.new, *tree, device_rounds=False)
        sync(dev)
        rows["-".join(map(str, tree))] = {
            "timing": {k: round(v, 4) for k, v in st.timing.items()},
            "identical": out[0].tolist() == plain,
            "tau": round(sum(st.accept_lengths) / len(st.accept_lengths), 3),
            "host_rounds_tok_s": round(3 * args.new / (time.perf_counter() - t0), 1),
        }
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--before", help="the source tree (a src/ folder) to compare against this one")
    ap.add_argument("--out")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--graphs-only", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu for a dry run of the flow (no graphs there)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    result = {"target": Path(args.target).name, "new_tokens": args.new, "compile": not args.graphs_only}
    for name, src in (("before", args.before), ("after", str(ROOT / "src"))):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        cmd = [
            sys.executable,
            __file__,
            "--target",
            args.target,
            "--new",
            str(args.new),
            "--device",
            args.device,
            "--one",
        ]
        cmd += ["--graphs-only"] if args.graphs_only else []
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{name}: exit {out.returncode}\n{out.stderr[-3000:]}")
        result[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(name, json.dumps(result[name]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "commit-ab.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
