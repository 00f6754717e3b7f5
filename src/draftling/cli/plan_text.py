"""`draftling plan`'s text: train/memory_fit.py's ``plan_run`` as the table and verdict it prints."""

from __future__ import annotations

from draftling.train.memory import GIB
from draftling.train.memory_fit import TeacherSplit


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f}"


def format_plan(plan: dict, target_name: str, max_batch: int | None = None) -> str:
    est, opts, shape = plan["estimate"], plan["options"], plan["shape"]
    on = {True: "on", False: "off"}
    q = plan["quantization"] or plan["teacher_dtype"]
    lines = [
        f"target {target_name}: {plan['teacher_params'] / 1e6:.1f}M params ({q}), hidden {shape.hidden}, "
        f"vocab {shape.vocab}",
        f"draft: {est['num_params'] / 1e6:.1f}M params ({opts.draft_dtype}), draft vocab {shape.draft_vocab}; "
        f"batch {plan['batch']} x seq {plan['seq']}",
        f"options: optimizer_offload {on[opts.optimizer_offload]}, grad_checkpoint {on[opts.grad_checkpoint]}, "
        f"attention {opts.attention}, loss_chunk_tokens {opts.loss_chunk_tokens}, compile {on[opts.compile]}, "
        f"embedding_on_host {on[opts.embedding_on_host]}; memory policy: {plan['policy']}",
        "",
        f"  {'GiB':>43}",
    ]
    lines += _estimate_table(plan)
    lines += _verdict_lines(plan)
    if max_batch == 0:
        lines.append(f"no batch size fits at seq {plan['seq']}")
    elif max_batch is not None:
        lines.append(f"largest batch size that fits at seq {plan['seq']}: {max_batch}")
    return "\n".join(lines)


def _estimate_table(plan: dict) -> list[str]:
    """The estimate's rows in GiB, its total against the GPU's memory, phases and host state."""
    est = plan["estimate"]
    lines: list[str] = []
    rows = [
        ("teacher weights", est["teacher_weights"]),
        ("draft params", est["draft_params"]),
        ("draft grads", est["draft_grads"]),
        ("optimizer state (device)", est["optimizer_state"]),
        ("embedding (device, beyond the teacher)", est["embedding"]),
        ("teacher outputs", est["teacher_outputs"]),
        ("activations", est["activations"]),
        ("transient", est["transient"]),
    ]
    for name, value in rows:
        lines.append(f"  {name:<38}{_gib(value)}")
    lines += [
        f"  {'total (peak: ' + est['peak_phase'].replace('_', ' ') + ')':<38}{_gib(est['total'])}",
        f"  {'reserve (CUDA context, fragmentation)':<38}{_gib(plan['reserve'])}",
        f"  {'GPU memory':<38}{_gib(plan['gpu_bytes'])}",
        f"  {'headroom':<38}{_gib(plan['headroom'])}",
    ]
    lines.append(
        "  phases (GiB): " + ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in est["phases"].items())
    )
    over = "the block loss" if "loss_forward" in est["phases"] else "all TTT steps"  # a dflash head's phase
    lines.append(f"  activations saved for backward over {over}: {est['activations_saved'] / GIB:.2f} GiB")
    host = est["host"]["optimizer"] + est["host"]["embedding"]
    if host:
        lines.append(f"  (host RAM for offloaded state: {host / GIB:.2f} GiB)")
    if plan["split"]:
        lines.append(split_line(plan["split"]))
    lines.append("")
    return lines


def _verdict_lines(plan: dict) -> list[str]:
    """Whether it fits, and with a split teacher that does not, what would."""
    est = plan["estimate"]
    lines: list[str] = []
    need = (est["total"] + plan["reserve"]) / GIB
    if plan["fits"]:
        lines.append(
            f"fits: {need:.2f} GiB needed of {plan['gpu_bytes'] / GIB:.2f} GiB "
            f"({plan['headroom'] / GIB:.2f} GiB headroom)"
        )
    else:
        lines.append(
            f"does NOT fit: {need:.2f} GiB needed of {plan['gpu_bytes'] / GIB:.2f} GiB "
            f"(short by {-plan['headroom'] / GIB:.2f} GiB)"
        )
    split = plan["split"]
    if (
        split
        and split.source in ("auto", "balanced")
        and not plan["fits"]
        and split.on_training_device > -plan["headroom"]
    ):
        cap = (split.on_training_device + plan["headroom"]) / GIB
        lines.append(
            f"to fit, keep at most ~{cap:.1f} GiB of the teacher on cuda:{split.training_device}: "
            f"max_memory={{{split.training_device}: {cap:.1f}GiB, cpu: ...}}"
        )
    return lines


def split_line(split: TeacherSplit) -> str:
    """The teacher's share per device, and what streams through the training GPU."""

    def name(device) -> str:
        return f"cuda:{device}" if isinstance(device, int) else device

    parts = ", ".join(f"{name(d)} {b / GIB:.2f}" for d, b in sorted(split.by_device.items(), key=lambda x: str(x[0])))
    line = (
        f"  teacher weights by device_map {split.source} (GiB): {parts}; cuda:{split.training_device} holds its share"
    )
    if split.streamed:
        line += f", and streams offloaded modules through, up to {split.streamed / GIB:.2f} GiB at a time (transient)"
    return line
