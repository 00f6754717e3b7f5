"""Data parallelism under torchrun, with torch.distributed's own wrappers.

- ``ddp``: the draft is replicated and wrapped in DistributedDataParallel. For drafts
  that fit on one device (most of them).
- ``fsdp``: the draft is sharded with FSDP2 ``fully_shard``. The draft module holds only
  trainable parameters (the target's embedding is not part of it), so only those are
  sharded; the optimizer state is sharded with them.

Each rank takes ``keys[rank::world]`` of every global batch, and the loss of TTT step j is
divided by the global valid count over world size, so the averaged gradients equal one
process's gradients on the whole batch. Checkpoints hold full (unsharded) state in the
single-process layout, written by rank 0, so a run resumes at any world size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from draftling.train.ttt import UnrollOptions

PARALLEL_MODES = ("ddp", "fsdp")
# Never NVLink multicast (NVLS): it is off in every launch draftling makes.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device: str) -> tuple[DistContext, str]:
    """Join the torchrun process group when there is more than one process. Returns the
    context and this rank's device ("cuda" becomes "cuda:<local_rank>")."""
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistContext(), device
    for key, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(key, value)
    local_rank = int(os.environ["LOCAL_RANK"])
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_cuda else "gloo", device_id=torch.device(device) if on_cuda else None)
    return current(), device


def current() -> DistContext:
    if not (dist.is_available() and dist.is_initialized()):
        return DistContext()
    return DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def rank_share(items: list, ctx: DistContext) -> tuple[list, bool]:
    """This rank's part of a global batch: items[rank::world]. A rank left with nothing
    (a short last batch) gets the first item as a stand-in, flagged so the caller zeroes
    its loss mask: every rank must still run the collective forward and backward."""
    part = items[ctx.rank :: ctx.world_size]
    if part or not items:
        return part, False
    return items[:1], True


def all_reduce_sum(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.active:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def any_rank(flag: bool, ctx: DistContext, device) -> bool:
    """True on every rank when it is True on any (e.g. rank 0's wall-clock budget ran out)."""
    if not ctx.active:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier(ctx: DistContext) -> None:
    if ctx.active:
        dist.barrier()


class TTTObjective(torch.nn.Module):
    """The draft with the whole TTT unroll as its forward, so that DDP's and FSDP's
    forward hooks run around everything the step computes."""

    def __init__(self, draft: torch.nn.Module):
        super().__init__()
        self.draft = draft

    def forward(
        self,
        embed,
        teacher,
        input_ids,
        loss_mask,
        attention_mask,
        options: UnrollOptions,
        loss_denominators=None,
        row_bounds=None,
    ):
        from draftling.draft.block import BlockDraft
        from draftling.train.block_loss import block_unroll
        from draftling.train.ttt import ttt_unroll  # looked up per call: a script may wrap it

        unroll = block_unroll if isinstance(self.draft, BlockDraft) else ttt_unroll
        return unroll(
            self.draft,
            embed,
            teacher,
            input_ids,
            loss_mask,
            attention_mask,
            options,
            loss_denominators=loss_denominators,
            row_bounds=row_bounds,
        )


def wrap(
    draft: torch.nn.Module, ctx: DistContext, mode: str, param_dtype: torch.dtype, offload: bool
) -> torch.nn.Module:
    """The module the training step calls. At world size 1 it is the bare objective: no
    wrapper, so no gradient buckets or hooks (and nothing for frozen params)."""
    objective = TTTObjective(draft)
    if not ctx.active:
        return objective
    if mode == "ddp":
        device = next(draft.parameters()).device
        return torch.nn.parallel.DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None
        )
    return shard(objective, param_dtype, offload)


def shard(objective: TTTObjective, param_dtype: torch.dtype, offload: bool) -> TTTObjective:
    """FSDP2 over the whole objective (needs a process group, of any size): fp32 shards (the
    masters), compute in ``param_dtype``, fp32 gradient reduction; with offload the shards
    and the optimizer step live on the host."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # cast_forward_inputs off: the teacher's logits (fp32 from an fp32 teacher) must reach the
    # loss unrounded.
    fully_shard(
        objective,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False),
        offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
    )
    return objective


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The draft inside whatever ``wrap`` returned."""
    inner = module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module
    return inner.draft


def is_sharded(module: torch.nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in module.parameters())


def _param_names(draft: torch.nn.Module) -> list[str]:
    return [n for n, p in draft.named_parameters() if p.requires_grad]


def full_model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The draft's full state dict (keys as in Eagle3Draft); sharded drafts gather it on
    rank 0 only (the other ranks get an empty dict)."""
    draft = unwrap(module)
    if not is_sharded(draft):
        return draft.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    prefix = "draft."
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def full_optimizer_state(module: torch.nn.Module, optimizer) -> dict:
    """The optimizer state in the single-process layout (params numbered in the draft's
    parameter order), whatever the wrapper; for a sharded draft on rank 0 only."""
    draft = unwrap(module)
    if not is_sharded(draft):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(
        module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not state:  # with cpu_offload only rank 0 receives the full state
        return {}
    index = {f"draft.{n}": i for i, n in enumerate(_param_names(draft))}
    return {
        "state": {index[k]: v for k, v in state["state"].items()},
        "param_groups": [dict(g, params=[index[k] for k in g["params"]]) for g in state["param_groups"]],
    }


def load_optimizer_state(module: torch.nn.Module, optimizer, state: dict) -> None:
    draft = unwrap(module)
    if not is_sharded(draft):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [f"draft.{n}" for n in _param_names(draft)]
    by_name = {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in state["param_groups"]],
    }
    set_optimizer_state_dict(
        module, optimizer, by_name, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    )
