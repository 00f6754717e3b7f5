"""data.regen.dtype and train.compute_dtype=bfloat16_if_fast: replies from a bf16 copy equal a
bf16 target's own, the kept states stay in the target's dtype, validation is written by the
target as served, and the probe's answer decides "if fast" both ways."""

import json

import pytest
import torch

import draftling.hardware as hardware
from draftling.cli import main
from draftling.config import RegenConfig, TrainConfig
from draftling.data.prompts import load_conversations
from draftling.data.regen import regenerate
from draftling.errors import ConfigError
from draftling.hardware import BF16_IF_FAST, resolve_fast_dtype
from draftling.target import load_target
from draftling.train.settings import memory_options


def write_sea_prompts(path, n):
    rows = [
        {
            "id": f"p{i}",
            "source": "test",
            "category": "chat",
            "messages": [{"role": "user", "content": "Tell me about the sea. " * (1 + i % 3)}],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_resolve_fast_dtype(monkeypatch):
    assert resolve_fast_dtype(None, "cpu", torch.float32, "f") is torch.float32
    assert resolve_fast_dtype("bfloat16", "cpu", torch.float32, "f") is torch.bfloat16
    monkeypatch.setattr(hardware, "bf16_matmul_is_faster", lambda device_type: True)
    assert resolve_fast_dtype(BF16_IF_FAST, "cpu", torch.float32, "f") is torch.bfloat16
    monkeypatch.setattr(hardware, "bf16_matmul_is_faster", lambda device_type: False)
    assert resolve_fast_dtype(BF16_IF_FAST, "cpu", torch.float32, "f") is torch.float32
    with pytest.raises(ConfigError, match=r"data\.regen\.dtype='bf17'"):
        resolve_fast_dtype("bf17", "cpu", torch.float32, "data.regen.dtype")
    with pytest.raises(ConfigError, match=r"data\.regen\.dtype='int8'"):
        resolve_fast_dtype("int8", "cpu", torch.float32, "data.regen.dtype")


@pytest.mark.parametrize("bf16_s, fp32_s, faster", [(1.0, 2.5, True), (1.0, 1.2, False), (4.0, 1.0, False)])
def test_the_probe_wants_a_clear_bf16_win(monkeypatch, bf16_s, fp32_s, faster):
    # Timings as on a CPU with AVX512-BF16 (2.5x), one where bf16 barely wins, and one that
    # emulates it (the Xeon's 4x slower).
    hardware.bf16_matmul_is_faster.cache_clear()
    monkeypatch.setattr(
        hardware, "_cpu_matmul_seconds", lambda dtypes: [bf16_s if d == torch.bfloat16 else fp32_s for d in dtypes]
    )
    try:
        assert hardware.bf16_matmul_is_faster("cpu") is faster
        assert hardware.bf16_matmul_is_faster("cuda") is True
    finally:
        hardware.bf16_matmul_is_faster.cache_clear()


def test_train_compute_dtype_if_fast_follows_the_probe(monkeypatch):
    tc = TrainConfig(compute_dtype=BF16_IF_FAST)
    monkeypatch.setattr("draftling.train.settings.bf16_matmul_is_faster", lambda device_type: True)
    assert memory_options(tc, "cpu")["autocast"] == "bfloat16"
    monkeypatch.setattr("draftling.train.settings.bf16_matmul_is_faster", lambda device_type: False)
    assert memory_options(tc, "cpu")["autocast"] is None
    with pytest.raises(ConfigError, match="train.compute_dtype='bf16'"):
        memory_options(TrainConfig(compute_dtype="bf16"), "cpu")


def test_bf16_copy_writes_a_bf16_targets_replies_and_keeps_fp32_states(tiny_target_dir, tmp_path):
    target = load_target(str(tiny_target_dir), device="cpu")
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    convs = load_conversations(write_sea_prompts(tmp_path / "p.jsonl", 4))
    copy = list(
        regenerate(
            target,
            convs,
            RegenConfig(max_new_tokens=8, batch_size=4, dtype="bfloat16"),
            progress=False,
            keep_states=True,
        )
    )
    # Reference: the same target loaded in bf16, regenerating in its own dtype.
    bf16_target = load_target(str(tiny_target_dir), device="cpu", dtype="bfloat16")
    own = list(
        regenerate(bf16_target, convs, RegenConfig(max_new_tokens=8, batch_size=4), progress=False, keep_states=True)
    )
    for a, b in zip(copy, own):
        assert a["id"] == b["id"] and a["messages"] == b["messages"]
        assert a["provenance"]["dtype"] == b["provenance"]["dtype"] == "bfloat16"
        ids_a, aux_a, final_a = a["_states"]
        ids_b, aux_b, final_b = b["_states"]
        assert ids_a == ids_b
        assert aux_a.dtype == final_a.dtype == torch.float32  # the target's own dtype
        # Within bf16 rounding (a bf16 load and a cast copy need not round every op alike).
        for mine, ref in ((aux_a, aux_b.float()), (final_a, final_b.float())):
            assert (mine - ref).norm() < 1e-2 * ref.norm()
    # The target itself was not cast.
    assert target.model.dtype == torch.float32
    assert all(torch.equal(v, before[k]) for k, v in target.model.state_dict().items())


def test_data_stage_writes_validation_with_the_target_as_served(tiny_target_dir, tmp_path):
    data = tmp_path / "data"
    assert (
        main(
            [
                "data",
                "--target",
                str(tiny_target_dir),
                "--device",
                "cpu",
                "--out",
                str(data),
                "--prompts",
                str(write_sea_prompts(tmp_path / "p.jsonl", 12)),
                "data.regen.max_new_tokens=6",
                "data.regen.batch_size=8",
                "data.val_fraction=0.25",
                "data.min_tokens=4",
                "data.keep_teacher_states=true",
                "data.regen.dtype=bfloat16",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (data / "replies.jsonl").read_text().splitlines()]
    dtypes = {split: {r["provenance"]["dtype"] for r in records if r["split"] == split} for split in ("train", "val")}
    assert dtypes == {"train": {"bfloat16"}, "val": {"float32"}}
    # Validation's replies are the fp32 target's, exactly.
    target = load_target(str(tiny_target_dir), device="cpu")
    val = [r for r in records if r["split"] == "val"]
    convs = [c for c in load_conversations(tmp_path / "p.jsonl") if c.id in {r["id"] for r in val}]
    fp32 = {
        r["id"]: r["messages"]
        for r in regenerate(target, convs, RegenConfig(max_new_tokens=6, batch_size=8), progress=False)
    }
    assert {r["id"]: r["messages"] for r in val} == fp32


def test_a_target_that_cannot_be_cast_is_refused(tiny_target_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("draftling.data.regen.has_plain_weights", lambda model: False)
    target = load_target(str(tiny_target_dir), device="cpu")
    convs = load_conversations(write_sea_prompts(tmp_path / "p.jsonl", 2))
    with pytest.raises(ConfigError, match=r"data\.regen\.dtype=bfloat16: .* is quantized"):
        list(regenerate(target, convs, RegenConfig(max_new_tokens=4, dtype="bfloat16"), progress=False))


def test_a_bad_regen_dtype_fails_before_any_output(tiny_target_dir, tmp_path, capsys):
    data = tmp_path / "data"
    assert (
        main(
            [
                "data",
                "--target",
                str(tiny_target_dir),
                "--device",
                "cpu",
                "--out",
                str(data),
                "--prompts",
                str(write_sea_prompts(tmp_path / "p.jsonl", 4)),
                "data.regen.dtype=int8",
            ]
        )
        != 0
    )
    assert "data.regen.dtype='int8'" in capsys.readouterr().err
    assert not data.exists() or not any(data.iterdir())


def test_the_cpu_weight_layout_env_skips_the_timing_and_a_pin_beats_it(monkeypatch):
    monkeypatch.setattr(hardware, "_PINNED_LAYOUT", {})
    monkeypatch.setattr(hardware, "_time_column_major", lambda dtype: pytest.fail("timed"))
    monkeypatch.setenv(hardware.LAYOUT_ENV, "column")
    assert hardware.column_major_linear_is_faster(torch.float32) is True
    monkeypatch.setenv(hardware.LAYOUT_ENV, "row")
    assert hardware.column_major_linear_is_faster(torch.bfloat16) is False
    hardware.pin_column_major(torch.float32, True)  # a resumed run's journal wins over the env
    assert hardware.column_major_linear_is_faster(torch.float32) is True
    monkeypatch.setenv(hardware.LAYOUT_ENV, "diagonal")
    with pytest.raises(ConfigError, match="DRAFTLING_CPU_WEIGHT_LAYOUT='diagonal'"):
        hardware.column_major_linear_is_faster(torch.bfloat16)
