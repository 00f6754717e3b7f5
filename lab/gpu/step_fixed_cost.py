"""The fixed cost of a training step, before and after padding batch lengths and removing the
step's host reads (issue 27): a two-point fit step_s = fixed + per_seq * n per mode.

    python lab/gpu/step_fixed_cost.py --target GGUF --out DIR   # on a GPU (step_fixed_cost.sh)
    python lab/gpu/step_fixed_cost.py --smoke --out DIR         # the same on the CPU, tiny

Each point is the trainer's own step (a run as ``trainer.build_run`` builds it, the machinery of
lab/benches/train_bench.py) with the online teacher, ``lab/configs/gpu_smollm2.yaml``'s settings and
synthetic sequences of chat-like lengths (each step a new length, as length-grouped batches of
real data have), stepped back to back with one sync at the end. Per-step batch sizes (16 and 32
sequences, or --batches), each in two modes (or --modes):

- after: the code as it is: train.pad_to_multiple auto (flex's block size under flex), and no
  read from the device inside a step; the counts are read per log line (never here);
- before: train.pad_to_multiple=1, and the reads the step made before put back where it made
  them: pageable batch copies, the head's boolean draft-vocab index, the unroll's exact row
  counts, a read per TTT step (its valid count), the counts and tokens at the unroll's end and
  the loss after the step.

Writes DIR/step-fixed-cost.json ({date, gpu, fixed_cost_s_before, fixed_cost_s_after, points,
...}) and DIR/manifest.json (commit, command, config, machine, date).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import sys
import time
import types
from pathlib import Path

import torch

_ROOT = str(Path(__file__).resolve().parents[2])  # this checkout, for lab.benches
if _ROOT not in sys.path:
    sys.path.append(_ROOT)
GPU_RECIPE = "lab/configs/gpu_smollm2.yaml"  # the GPU recipe, from the checkout

from draftling.bench.manifest import device_name, write_manifest
from draftling.config import RunConfig, load_config
from draftling.data.tokenized import TokenizedExample
from draftling.dynamo import allow_recompiles
from draftling.io import write_json
from draftling.timing import sync
from draftling.train import attention, trainer, ttt
from draftling.train import batches as batches_mod
from draftling.train import teacher as teacher_mod
from draftling.train.distributed import DistContext
from draftling.train.inputs import RunInputs
from lab.benches.ddp_scaling import line_fit
from lab.benches.train_bench import synthetic_vocab

MODES = ("before", "after")


@dataclasses.dataclass
class Settings:
    batches: tuple[int, int] = (16, 32)  # sequences per step: the two points of the fit
    min_len: int = 96  # the gpu_smollm2 data: sequences of 16..1024+ tokens, about 490 on average
    max_len: int = 900
    jitter: int = 48  # rows of a batch are up to this much shorter than its longest
    prompt_share: float = 0.4  # leading tokens without a loss, as a chat prompt
    warmup: int = 8
    measured: int = 20
    overrides: tuple[str, ...] = ()  # config overrides over lab/configs/gpu_smollm2.yaml
    after_pad: int | str = "auto"  # train.pad_to_multiple after: auto or a multiple


def smoke_settings() -> Settings:
    return Settings(
        batches=(2, 4),
        min_len=20,
        max_len=90,
        jitter=6,
        warmup=2,
        measured=3,
        overrides=("device=cpu", "draft.intermediate_size=128", "train.ttt_steps=3", "vocab.size=64"),
        after_pad=16,
    )


def lengths_for(s: Settings, steps: int, batch: int, seed: int = 0) -> list[list[int]]:
    """Per step, the rows' lengths: a new longest length each step, the rest a little shorter.
    The same longest lengths at either batch size."""
    g = torch.Generator().manual_seed(seed)
    longest = torch.randint(s.min_len, s.max_len + 1, (steps,), generator=g).tolist()
    return [[n] + [n - int(x) for x in torch.randint(0, s.jitter + 1, (batch - 1,), generator=g)] for n in longest]


def make_examples(s: Settings, lengths: list[list[int]], vocab_size: int) -> list[TokenizedExample]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for n in (n for step in lengths for n in step):
        prompt = int(n * s.prompt_share)
        rows.append(
            TokenizedExample(
                str(len(rows)),
                "synthetic",
                torch.randint(2, vocab_size, (n,), generator=g).tolist(),
                [0] * prompt + [1] * (n - prompt),
            )
        )
    return rows


@contextlib.contextmanager
def old_reads():
    """The host reads of the step as it was before, each where it was (see the module doc)."""
    saved = (
        batches_mod.to_device,
        teacher_mod.draft_token_ids,
        batches_mod.host_batch,
        ttt._StepLoss.chunked,
        ttt.ttt_unroll,
    )
    chunked, unroll, host_batch = ttt._StepLoss.chunked, ttt.ttt_unroll, batches_mod.host_batch

    def chunked_with_read(self, j, hidden):
        out = chunked(self, j, hidden)
        out[1].item()  # was torch.tensor(n_valid, device=...), from a host count
        return out

    def unroll_with_reads(*args, **kwargs):
        loss, counts = unroll(*args, **kwargs)
        counts.rows()  # the counts were read at the unroll's end
        int(args[5].sum())  # and the tokens from the attention mask
        return loss, counts

    batches_mod.to_device = lambda tensor, dev: tensor.to(dev)  # a pageable copy waits for the queue
    teacher_mod.draft_token_ids = lambda t2d: t2d.nonzero().squeeze(1)  # was weight[t2d]
    batches_mod.host_batch = lambda *a: (host_batch(*a)[0], None)  # no bounds: the unroll reads its row counts
    ttt._StepLoss.chunked, ttt.ttt_unroll = chunked_with_read, unroll_with_reads
    try:
        yield
    finally:
        (
            batches_mod.to_device,
            teacher_mod.draft_token_ids,
            batches_mod.host_batch,
            ttt._StepLoss.chunked,
            ttt.ttt_unroll,
        ) = saved


def build(target, vocab, cfg: RunConfig, examples, batch: int, pad: int | str):
    tc = dataclasses.replace(
        cfg.train,
        batch_size=batch,
        pad_to_multiple=pad,
        group_by_length=False,
        max_steps=0,
        teacher_cache_gb=0.0,
        max_minutes=0.0,
    )
    cfg = dataclasses.replace(cfg, train=tc)
    inputs = RunInputs(examples, [], vocab, None, None)
    torch.manual_seed(0)
    return trainer.build_run(cfg, target, inputs, None, None, DistContext(), say=lambda line: None)


def time_point(target, vocab, cfg: RunConfig, s: Settings, mode: str, batch: int) -> dict:
    """Mean seconds of the measured steps, back to back with one sync at the end."""
    device = target.device
    lengths = lengths_for(s, s.warmup + s.measured, batch)
    examples = make_examples(s, lengths, target.config.vocab_size)
    run = build(target, vocab, cfg, examples, batch, 1 if mode == "before" else s.after_pad)
    keys = [list(range(i * batch, (i + 1) * batch)) for i in range(len(lengths))]
    attention._BLOCK_MASKS.clear()  # each point starts as a run does: no masks yet
    with old_reads() if mode == "before" else contextlib.nullcontext():
        for k in keys[: s.warmup]:
            run.train_step(k)
        sync(device)
        t0 = time.perf_counter()
        for k in keys[s.warmup :]:
            loss = run.train_step(k)[0]
            if mode == "before":
                loss.item()  # the loop read the loss after every step
        sync(device)
        step_s = (time.perf_counter() - t0) / s.measured
    tokens = sum(sum(step) for step in lengths[s.warmup :]) / s.measured
    pad = batches_mod.batch_multiple(run.source)
    out = {
        "mode": mode,
        "batch": batch,
        "step_s": round(step_s, 5),
        "tok_s": round(tokens / step_s, 1),
        "tokens_per_step": round(tokens, 1),
        "measured_steps": s.measured,
        "warmup_steps": s.warmup,
        "pad_to_multiple": pad,
        "attention": run.unroll.attention,
        "block_masks_built": len(attention._BLOCK_MASKS),
    }
    print(
        f"[step-fixed-cost] {mode} batch {batch}: {step_s:.4f} s/step, {out['tok_s']:.0f} tok/s, pad {pad}", flush=True
    )
    del run
    return out


def fit(points: list[dict], mode: str) -> tuple[float, float]:
    """(fixed s, s per sequence): the least-squares line through the mode's points."""
    return line_fit([(p["batch"], p["step_s"]) for p in points if p["mode"] == mode])


def tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftling.target.load import wrap_target

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=1)
    return wrap_target(LlamaForCausalLM(config).eval(), tokenizer, name="tiny-random-llama")


def load(args):
    device = torch.device("cpu" if args.smoke else (args.device or "cuda"))
    if args.smoke:
        return tiny_target(), device
    from draftling.target import load_target

    return load_target(args.target, dtype="bfloat16", device=str(device)), device


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for step-fixed-cost.json and manifest.json")
    p.add_argument("--target", help="the teacher (the SmolLM2 GGUF); not with --smoke")
    p.add_argument("--smoke", action="store_true", help="a tiny random target on the CPU, a few steps")
    p.add_argument("--device", default=None, help="default: cuda")
    p.add_argument("--measured", type=int, default=None, help="measured steps per point")
    p.add_argument(
        "--batches",
        default=None,
        help="sequences per step, comma-separated, two or more (default 16,32): e.g. 32,64,128 "
        "for how training tok/s scales with the batch",
    )
    p.add_argument("--modes", default=",".join(MODES), help="before, after or both (default both)")
    args = p.parse_args(argv)
    modes = tuple(m for m in MODES if m in args.modes.split(","))
    if not modes or len(modes) != len(args.modes.split(",")):
        p.error(f"--modes {args.modes}: expected a comma-separated subset of {','.join(MODES)}")
    if not args.smoke and not args.target:
        p.error("--target is needed (or --smoke)")
    s = smoke_settings() if args.smoke else Settings()
    if args.measured:
        s.measured = args.measured
    if args.batches:
        s.batches = tuple(int(b) for b in args.batches.split(","))
        if len(s.batches) < 2:
            p.error("--batches: two or more sizes, for the fit")
    torch.backends.cuda.matmul.allow_tf32 = True  # as trainer.train sets it
    allow_recompiles(64)  # each batch length is new: compiled graphs must stay compiled
    target, device = load(args)
    cfg = load_config(str(Path(_ROOT) / GPU_RECIPE), list(s.overrides))
    probe = [torch.randint(2, target.config.vocab_size, (4, s.max_len), generator=torch.Generator().manual_seed(2))]
    vocab = synthetic_vocab(target, probe, cfg.vocab.size, device)
    started, points = time.perf_counter(), []
    for mode in modes:
        for batch in s.batches:
            points.append(time_point(target, vocab, cfg, s, mode, batch))
    results = {"date": datetime.date.today().isoformat(), "gpu": device_name(device)}
    for mode in modes:
        fixed, per_seq = fit(points, mode)
        results[f"fixed_cost_s_{mode}"], results[f"per_seq_s_{mode}"] = round(fixed, 5), round(per_seq, 6)
    results.update(
        points=points,
        settings=dataclasses.asdict(s),
        wall_s=round(time.perf_counter() - started, 1),
        caveats=[
            "synthetic token ids; each step a new longest length in [min_len, max_len]",
            "before = pad 1 plus the old step's host reads put back where it made them "
            "(lab/gpu/step_fixed_cost.py old_reads), not the old commit itself",
            "one run per point; the fit has no error estimate",
        ],
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "step-fixed-cost.json", results)
    write_manifest(
        out,
        None,
        {
            "settings": dataclasses.asdict(s),
            "config": GPU_RECIPE,
            "target": args.target or "tiny random Llama (--smoke)",
        },
        device,
        results["date"],
        what="step-fixed-cost",
        files=["step-fixed-cost.json"],
    )
    print(
        "[step-fixed-cost] fixed cost per step: "
        + ", ".join(f"{m} {results[f'fixed_cost_s_{m}']:.4f} s" for m in modes),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
