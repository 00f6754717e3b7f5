"""lab/gpu/scale.py's ``peer`` section (issue 47 item 4): draftling and speculators 0.9.0 side by
side on the same GPU in one run: the same data (the 135M recipe's replies: `draftling data` of
lab/configs/gpu_smollm2.yaml, ``--data``), the same head shape (one layer, the recipe's MLP
width, its 32k draft vocab maps given to both), the same TTT depth and the same number of steps.

- draftling: the trainer's own run (trainer.build_run, TrainRun.train_step), teacher resident.
- speculators: its documented offline path, hidden states saved first. Its datagen saves them
  through a vLLM server (``speculators generate-offline-data``); there is no vLLM on the GPU
  machine, so the same states (the three aux layers [2, L/2, L-3] and the last layer's output
  before the final norm, as vLLM's hook gives them) are written here by the target's forward,
  in its file format (hidden_states/hs_<i>.safetensors: token_ids, hidden_states [T, 4, H]),
  beside the Arrow dataset ``prepare-data`` writes (input_ids, loss_mask, seq_len). Then
  ``speculators train`` itself runs (lab/gpu/scale_spec_launch.py, in ``--spec-python``).
- one evaluator: draftling's validation (train.batches.evaluate) over the same validation rows
  for both heads (speculators' checkpoint read by export.formats.load_any_draft).

tok/s: sequence tokens per second of training steps after the first tenth (compiles); for
speculators its own per-step profile (tokens_per_s, synchronised marks). Peak memory: each
process's torch.cuda.max_memory_allocated; draftling's includes its resident teacher.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from scale import GIB, NoTokenizer, error_line, free, log, model_config, peak_gib, random_model

_ROOT = Path(__file__).resolve().parents[2]
RECIPE = _ROOT / "lab/configs/gpu_smollm2.yaml"
LAUNCH = Path(__file__).resolve().parent / "scale_spec_launch.py"


def peer_config(s, device, batch: int, steps: int):
    from draftling.config import load_config

    over = [f"train.batch_size={batch}", f"train.max_steps={steps}", f"train.warmup_steps={max(1, steps // 10)}"]
    over += ["train.smoke_every=0", "train.stop_on_convergence=false", "train.max_val_batches=8"]
    if s.dry:
        over += ["dtype=float32", "device=cpu", "vocab.size=256", "draft.intermediate_size=256"]
    return load_config(str(RECIPE), over)


def toy_inputs(s, device, work: Path):
    """The dry run's stand-ins: a tiny random Llama (saved for speculators) and random rows with
    a loss on their second half."""
    from draftling.data.tokenized import TokenizedExample
    from draftling.draft.vocab import build_vocab, token_counts
    from draftling.target.load import wrap_target

    cfg, _ = model_config("llama", {"tie_word_embeddings": True, "rms_norm_eps": 1e-5}, toy=True)
    model = random_model(cfg, device, torch.float32)
    verifier = work / "verifier"
    model.save_pretrained(verifier)
    toy_tokenizer(cfg.vocab_size).save_pretrained(verifier)  # speculators reads the verifier's tokenizer
    target = wrap_target(model, NoTokenizer(int(cfg.pad_token_id)), name="random-llama-toy")
    g = torch.Generator().manual_seed(5)
    rows = []
    for i in range(20):
        n = int(torch.randint(40, 64, (1,), generator=g))
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
        rows.append(TokenizedExample(str(i), "toy", ids, [0] * (n // 2) + [1] * (n - n // 2)))
    train, val = rows[:16], rows[16:]
    vocab = build_vocab(token_counts([(r.input_ids, r.loss_mask) for r in train], cfg.vocab_size), 256, "toy")
    return target, verifier, train, val, vocab, "toy: random ids, loss on the second half"


def toy_tokenizer(size: int):
    """A word-level tokenizer over ``size`` made-up tokens (t0, t1, ...): the toy verifier's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", pad_token="t1", eos_token="t2")


def recipe_inputs(args, device):
    from draftling.data.tokenized import load_tokenized
    from draftling.draft.vocab import load_vocab
    from draftling.target import load_target
    from draftling.target.load import plain_checkpoint_dir

    target = load_target(args.target, dtype="bfloat16", device=str(device))
    data = Path(args.data)
    train, val = load_tokenized(data / "train.jsonl"), load_tokenized(data / "val.jsonl")
    vocab = load_vocab(data / "vocab.safetensors")
    return target, plain_checkpoint_dir(target.spec), train, val, vocab, f"`draftling data` of {RECIPE.name}: {data}"


def train_draftling(cfg, target, train, vocab, steps: int, folder: Path) -> dict:
    from draftling.draft.store import save_draft
    from draftling.timing import sync
    from draftling.train.distributed import DistContext
    from draftling.train.inputs import RunInputs
    from draftling.train.trainer import build_run

    device = target.device
    free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    run = build_run(cfg, target, RunInputs(train, [], vocab, None, None), None, None, DistContext(), say=log)
    warm, tokens, t0, t_all = max(1, steps // 10), 0, 0.0, time.perf_counter()
    for i in range(steps):
        if i == warm:
            sync(device)
            t0 = time.perf_counter()
        _, _, n = run.train_step()
        tokens += int(n) if i >= warm else 0
    sync(device)
    seconds = time.perf_counter() - t0
    folder.mkdir(parents=True, exist_ok=True)
    save_draft(run.draft, folder)
    out = {
        "steps": steps,
        "batch": cfg.train.batch_size,
        "tok_s": tokens / seconds,
        "timed_steps": steps - warm,
        "tokens_per_step": tokens / max(1, steps - warm),
        "wall_s": time.perf_counter() - t_all,
        "peak_gib": peak_gib(device),
        "memory_policy": run.memory_policy,
    }
    del run
    free(device)
    return out


def save_hidden_states(target, rows, folder: Path) -> float:
    """hs_<i>.safetensors per row, as speculators' offline datagen writes them (see the module doc)."""
    from safetensors.torch import save_file

    from draftling.target.aux import recording_aux_states

    folder.mkdir(parents=True, exist_ok=True)
    ids_layers = list(target.aux_layer_ids) + [target.num_layers]
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, r in enumerate(rows):
            ids = torch.tensor([r.input_ids], device=target.device)
            with recording_aux_states(target.model, ids_layers) as calls:
                target.model.model(input_ids=ids)
            hs = torch.stack([calls[k][-1][0] for k in ids_layers], dim=1).to(torch.bfloat16)
            save_file(
                {"token_ids": ids[0].cpu(), "hidden_states": hs.cpu().contiguous()}, str(folder / f"hs_{i}.safetensors")
            )
    return time.perf_counter() - t0


def head_config(target, cfg) -> dict:
    """The draft decoder speculators builds (--draft-config): one Llama layer of draftling's head shape."""
    c = target.config
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings")
    out = {k: getattr(c, k) for k in keys} | {"model_type": "llama", "num_hidden_layers": 1, "vocab_size": c.vocab_size}
    out["head_dim"] = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    out["intermediate_size"] = cfg.draft.intermediate_size or c.intermediate_size
    out["rope_parameters"] = getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    return out


def spec_args(target, cfg, vocab, work: Path, steps: int, seq_len: int, verifier: Path) -> list[str]:
    import numpy as np

    np.save(work / "d2t.npy", vocab.d2t.numpy())
    np.save(work / "t2d.npy", vocab.t2d.numpy())
    (work / "draft_config.json").write_text(json.dumps(head_config(target, cfg)))
    flags = {
        "verifier-name-or-path": verifier,
        "data-path": work / "data",
        "speculator-type": "eagle3",
        "draft-config": work / "draft_config.json",
        "d2t-path": work / "d2t.npy",
        "t2d-path": work / "t2d.npy",
        "draft-vocab-size": vocab.size,
        "ttt-steps": cfg.train.ttt_steps,
        "lr": cfg.train.lr,
        "max-steps": steps,
        "epochs": 1000,
        "total-seq-len": seq_len,
        "scheduler-type": "cosine",
        "scheduler-warmup-steps": max(1, steps // 10),
        "on-missing": "raise",
        "num-workers": 2,
        "prefetch-factor": 2,
        "log-freq": 1,
        "save-path": work / "ckpt",
        "log-dir": work / "logs",
    }
    return [f"--{k}={v}" for k, v in flags.items()]


def run_spec(python: str, work: Path, what: list[str], timeout: int) -> None:
    """The launcher under ``python``; a failure raises with the last lines it printed."""
    env = dict(os.environ, PYTHONPATH=os.environ.get("SPEC_PYTHONPATH", os.environ.get("PYTHONPATH", "")))
    env["_TYPER_STANDARD_TRACEBACK"] = "1"  # plain tracebacks: the reason is read from them
    with open(work / "spec_log.txt", "a") as logf:
        rc = subprocess.run(
            [python, str(LAUNCH), *what], stdout=logf, stderr=subprocess.STDOUT, env=env, timeout=timeout
        ).returncode
    if rc != 0:
        raise RuntimeError(f"speculators {what[0]} exited {rc}: {failure((work / 'spec_log.txt').read_text())}")


def failure(text: str) -> str:
    """The exception a traceback ends with, and the deepest speculators/hs_connectors line that raised it."""
    lines = text.strip().splitlines()
    error = next(
        (x.strip() for x in reversed(lines) if re.match(r"^[\w.]+(Error|Exception|Exit)\b", x.strip())),
        lines[-1] if lines else "",
    )
    frames = [i for i, x in enumerate(lines) if re.search(r'File ".*(speculators|hs_connectors)/', x)]
    if not frames:
        return error[:600]
    i = frames[-1]
    where = re.sub(r".*site-packages/", "", lines[i].strip()).replace('File "', "").replace('", line ', ":")
    code = lines[i + 1].strip() if i + 1 < len(lines) else ""
    return f"{error[:500]} (raised under {where}: {code[:160]})"


def train_speculators(python, target, cfg, vocab, train, val, steps, seq_len, verifier, work: Path) -> dict:
    """The training rows, then the validation rows (speculators splits the dataset by
    --train-data-ratio, which must leave a validation part)."""
    work.mkdir(parents=True, exist_ok=True)
    both = list(train) + list(val)
    out: dict = {"hidden_states_s": save_hidden_states(target, both, work / "data" / "hidden_states")}
    rows = work / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": r.input_ids, "loss_mask": r.loss_mask}) + "\n" for r in both))
    run_spec(python, work, ["dataset", str(rows), str(work / "data")], 600)
    metrics, t0 = work / "metrics.jsonl", time.perf_counter()
    args = spec_args(target, cfg, vocab, work, steps, seq_len, verifier)
    args.append(f"--train-data-ratio={(len(train) + 0.5) / len(both)}")  # int(n x ratio) = the training rows
    if target.device.type == "cpu":  # the dry run: no FlexAttention backward, no Triton on the CPU
        args += ["--draft-attn-impl=sdpa", "--loss-implementation=eager"]
    try:
        run_spec(python, work, ["train", str(metrics)] + args, 1200)
    finally:
        out["wall_s"] = time.perf_counter() - t0
        out.update(read_spec_metrics(metrics, steps))
    out["head"] = str(newest_head(work / "ckpt"))
    return out


def read_spec_metrics(path: Path, steps: int) -> dict:
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    prof = [r for r in recs if isinstance(r.get("profile"), dict)]
    timed = [r["profile"]["tokens_per_s"] for r in prof if r.get("global_step", 0) >= max(1, steps // 10)]
    peak = [r["peak_bytes"] for r in recs if "peak_bytes" in r]
    return {
        "steps_logged": len(prof),
        "tok_s": statistics.median(timed) if timed else None,
        "peak_gib": round(peak[-1] / GIB, 3) if peak else None,
    }


def newest_head(folder: Path) -> Path:
    heads = sorted((p.parent for p in folder.rglob("config.json")), key=lambda p: p.stat().st_mtime)
    if not heads:
        raise RuntimeError(f"speculators wrote no checkpoint under {folder}")
    return heads[-1]


def evaluate_head(path, target, val, cfg) -> dict:
    from draftling.export.formats import load_any_draft
    from draftling.train.batches import evaluate

    draft = load_any_draft(path, target.device, torch.float32 if target.device.type == "cpu" else torch.bfloat16)
    m = evaluate(draft, target, val, cfg, target.device, cfg.train.max_val_batches)
    return {
        k: float(v) if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool) else v
        for k, v in m.items()
    }


def section_peer(s, device, args) -> dict:
    steps = args.peer_steps or (3 if s.dry else 400)
    batch = 2 if s.dry else 16
    work = Path(args.out) / "peer"
    work.mkdir(parents=True, exist_ok=True)
    if s.dry or not args.data:
        target, verifier, train, val, vocab, data = toy_inputs(s, device, work)
    else:
        target, verifier, train, val, vocab, data = recipe_inputs(args, device)
    cfg = peer_config(s, device, batch, steps)
    mean_len = statistics.fmean(len(r.input_ids) for r in train)
    seq_len = max(64, int(batch * mean_len) // 64 * 64)  # speculators packs about one draftling batch a step
    out: dict = {
        "data": data,
        "train_rows": len(train),
        "val_rows": len(val),
        "steps": steps,
        "spec_total_seq_len": seq_len,
    }
    results, heads = {}, {}
    try:
        results["draftling"] = train_draftling(cfg, target, train, vocab, steps, work / "draftling_head")
        heads["draftling"] = work / "draftling_head"
    except Exception as e:  # noqa: BLE001 - recorded; speculators still runs
        results["draftling"] = {"error": error_line(e)}
    python = args.spec_python or sys.executable
    try:
        results["speculators"] = train_speculators(
            python, target, cfg, vocab, train, val, steps, seq_len, verifier, work / "spec"
        )
        heads["speculators"] = Path(results["speculators"]["head"])
    except Exception as e:  # noqa: BLE001 - why speculators could not run is the result
        results["speculators"] = {"error": error_line(e)}
    out["val_acc"] = {}
    for name, head in heads.items():
        try:
            out["val_acc"][name] = evaluate_head(head, target, val, cfg)
        except Exception as e:  # noqa: BLE001
            out["val_acc"][name] = {"error": error_line(e)}
    for name in ("draftling", "speculators"):
        out[f"{name}_tok_s"] = results[name].get("tok_s")
        out[f"{name}_peak_gib"] = results[name].get("peak_gib")
    out["runs"] = results
    out["speculators_python"] = python
    return out
