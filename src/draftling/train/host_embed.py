"""The target's frozen embedding table kept in host RAM.

For a large-vocabulary target the table is a sizeable block of device memory (e.g.
128k x 4096 bf16 = 1 GiB) of which a batch reads a few thousand rows. ``HostEmbedding``
keeps the table on the CPU and, once per batch, looks up the distinct ids of that batch
and moves only those rows to the device. Every TTT step's shifted ids are a subset of the
batch's ``input_ids`` plus the fill id 0 (see ``shift_left``), so the unroll's per-step
lookups are served from those rows on the device.

It pays off where the target itself is not resident on the device (offline teacher
data); in the online trainer the target keeps its own copy for the teacher forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class HostEmbedding:
    def __init__(self, weight: torch.Tensor, device: torch.device | str, pin: bool | None = None):
        self.device = torch.device(device)
        weight = weight.detach().to("cpu")
        if pin is None:
            pin = self.device.type == "cuda" and torch.cuda.is_available()
        self.weight = weight.pin_memory() if pin else weight
        self.pinned = pin

    @classmethod
    def from_module(cls, module: torch.nn.Module, device) -> HostEmbedding:
        return cls(module.weight, device)

    def for_batch(self, input_ids: torch.Tensor, fill_id: int = 0):
        """One host lookup for the batch; returns ``lookup(ids)`` for any ids drawn from
        ``input_ids`` or ``fill_id``."""
        ids = torch.cat([input_ids.reshape(-1).cpu(), torch.tensor([fill_id])])
        uniq = torch.unique(ids)  # sorted
        rows = self.weight[uniq]
        if self.pinned:
            rows = rows.pin_memory()
        rows = rows.to(self.device, non_blocking=True)
        uniq_dev = uniq.to(self.device, non_blocking=True)

        def lookup(x: torch.Tensor) -> torch.Tensor:
            return F.embedding(torch.searchsorted(uniq_dev, x.to(self.device)), rows)

        return lookup

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.for_batch(ids)(ids)
