"""lab/benches/train_bench.py end to end on a tiny shape on the CPU (peaks are null there)."""

import json
import math

import pytest
import torch

from draftling.train.memory import DraftShape
from lab.benches import train_bench
from lab.benches.train_bench import ABLATIONS, MemoryBench, Settings, all_on_config, guarded, run_bench

TINY = DraftShape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=300, draft_vocab=64)
KEYS = (
    "date",
    "gpu",
    "torch",
    "peak_gib_36b_shape",
    "ablation",
    "seq_scaling",
    "tok_s_default",
    "tok_s_eager",
    "speedup_vs_eager",
    "plan_estimate_gib",
    "time_split",
    "memory_shape",
    "memory_config",
    "throughput_config",
    "caveats",
)


def tiny_settings(**changes) -> Settings:
    base = dict(
        shape=TINY,
        seq=32,
        seq_scaling=(16, 32),
        warmup=1,
        measured=1,
        tp_seq=24,
        tp_batch=2,
        tp_draft_vocab=64,
        tp_warmup=1,
        tp_measured=1,
        aux_dtype=torch.float32,
    )
    base.update(changes)
    return Settings(**base)


def test_bench_runs_end_to_end_and_writes_the_contract(tmp_path, tiny_target, one_thread):
    out = tmp_path / "train-bench.json"
    results = run_bench(out, tiny_settings(), torch.device("cpu"), target=tiny_target)
    on_disk = json.loads(out.read_text())
    for key in KEYS:
        assert key in results and key in on_disk, key
    assert on_disk["peak_gib_36b_shape"] is None  # no CUDA: no peak
    assert on_disk["plan_estimate_gib"] > 0
    assert math.isfinite(on_disk["all_on"]["loss"])
    # Every ablation is present: measured (a finite loss and its own plan estimate) or an error.
    assert set(on_disk["ablation"]) == set(ABLATIONS)
    for name, entry in on_disk["ablation"].items():
        assert ("error" in entry) != ("loss" in entry), name
        if "loss" in entry:
            assert math.isfinite(entry["loss"]) and entry["plan_estimate_gib"] > 0
    ablation = on_disk["ablation"]
    assert ablation["optimizer_offload_off"]["options"]["optimizer_offload"] is False
    assert ablation["optimizer_offload_off"]["options"]["draft_dtype"] == "float32"
    assert ablation["optimizer_offload_off"]["steps"] == 2  # one more, so AdamW's moments exist in a step
    assert ablation["loss_chunking_off"]["options"]["loss_chunk_tokens"] == 0
    assert ablation["grad_checkpoint_off"]["options"]["grad_checkpoint"] is False
    assert ablation["embedding_on_device"]["options"]["embedding_on_host"] is False
    assert ablation["build_order_off"]["options"]["build_on_cpu"] is False
    assert on_disk["all_on"]["options"]["optimizer_offload"] is True
    assert on_disk["all_on"]["options"]["draft_dtype"] == "bfloat16"
    # Sequence scaling: every length, the headline run reused for its own length.
    assert list(on_disk["seq_scaling"]) == ["16", "32"]
    assert on_disk["seq_scaling"]["32"] == on_disk["all_on"]
    assert on_disk["seq_scaling"]["16"]["plan_estimate_gib"] < on_disk["seq_scaling"]["32"]["plan_estimate_gib"]
    # Throughput: both paths measured, split in three parts that add up to the synced step;
    # tokens/s from the same batches back to back.
    assert on_disk["tok_s_default"] > 0 and on_disk["tok_s_eager"] > 0
    assert on_disk["speedup_vs_eager"] == pytest.approx(on_disk["tok_s_default"] / on_disk["tok_s_eager"], rel=1e-2)
    for path in ("default", "eager"):
        split = on_disk["time_split"][path]
        tp = on_disk["throughput"][path]
        assert tp["tok_s"] == pytest.approx(tp["tokens_per_step"] / tp["step_s"], rel=1e-2)
        step = tp["step_s_with_phase_syncs"]
        parts = {"teacher_prefill_s", "draft_fwd_bwd_s", "optimizer_s"}
        assert set(split) == parts | {"draft_forward_s"}
        assert sum(split[k] for k in parts) == pytest.approx(step, rel=1e-2)
        assert 0 < split["draft_forward_s"] < split["draft_fwd_bwd_s"]
        assert on_disk["throughput"][path]["valid_fraction_step0"] > 0.5
    assert on_disk["throughput"]["eager"]["memory_options"]["attention"] == "sdpa"
    assert on_disk["throughput"]["eager"]["memory_options"]["compile"] is False
    assert on_disk["throughput"]["eager"]["memory_options"]["autocast"] is None
    assert on_disk["throughput"]["eager_bf16"]["memory_options"]["autocast"] == "bfloat16"
    profiled = on_disk["throughput"]["default"]["profile"]
    assert profiled["wall_s"] > 0 and len(profiled["top_ops"]) > 0
    assert any("not run on CUDA" in c for c in on_disk["caveats"])


def test_a_failed_run_is_recorded_and_memory_freed():
    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    def broken():
        raise ValueError("bad shape")

    assert guarded(torch.device("cpu"), oom) == {
        "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    }
    err = guarded(torch.device("cpu"), broken)["error"]
    assert err.startswith("ValueError: bad shape") and "test_train_bench.py" in err
    assert guarded(torch.device("cpu"), lambda x: {"ok": x}, 3) == {"ok": 3}


def test_results_are_written_after_each_run(tmp_path, tiny_target, monkeypatch, one_thread):
    """A bench cut off mid-way (here: interrupted on its third memory run) leaves the runs it
    finished on disk."""
    calls = []
    real_run = MemoryBench.run

    def run(self, name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # not a run failure: it stops the bench
        return real_run(self, name, *args, **kwargs)

    monkeypatch.setattr(MemoryBench, "run", run)
    out = tmp_path / "cut.json"
    with pytest.raises(KeyboardInterrupt):
        run_bench(
            out,
            tiny_settings(ablations=("loss_chunking_off", "grad_checkpoint_off")),
            torch.device("cpu"),
            target=None,
            phases=("memory", "throughput", "ablation"),
        )
    on_disk = json.loads(out.read_text())
    assert on_disk["all_on"]["plan_estimate_gib"] > 0
    assert list(on_disk["ablation"]) == ["loss_chunking_off"]
    assert any("no --target" in c for c in on_disk["caveats"])


def test_all_on_config_turns_every_feature_on():
    tc = all_on_config(7)
    assert tc.optimizer_offload is True and tc.embedding_on_host is True and tc.grad_checkpoint is True
    assert tc.loss_chunk_tokens > 0 and tc.attention == "auto" and tc.compile == "auto"
    for name, spec in ABLATIONS.items():
        changed = all_on_config(7, **spec.get("train", {}))
        assert changed != tc or spec.get("build_on_device") or spec.get("fsdp"), name


def test_main_rejects_unknown_phases(tmp_path):
    with pytest.raises(SystemExit):
        train_bench.main(["--out", str(tmp_path / "x.json"), "--phases", "memory,nonsense"])
