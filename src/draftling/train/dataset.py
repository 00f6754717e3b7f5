"""Training batches over the tokenized rows of `draftling data` (read by draftling.data.tokenized).

Batches come from a seeded permutation per epoch, so the data position of a run is just
(epoch, batch index) and resuming replays exactly the same batches.
"""

from __future__ import annotations

import torch

from draftling.data.tokenized import TokenizedExample
from draftling.errors import DataError


def collate(examples: list[TokenizedExample], pad_id: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example in the batch, rounded up to a multiple of ``multiple``."""
    t = max(len(e.input_ids) for e in examples)
    t = -(-t // multiple) * multiple
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), t), dtype=torch.long)
    attn = torch.zeros((len(examples), t), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        mask[i, :n] = torch.tensor(e.loss_mask)
        attn[i, :n] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``. To a GPU through pinned memory without blocking: a copy
    from pageable memory would make the host wait for everything queued before it."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def fraction_pool(n: int, fraction: float, seed: int) -> list[int]:
    """A seeded share of range(n), sorted: the head of one permutation per seed, so a smaller
    share is always inside a larger one. All of it (in order) at 1.0."""
    if fraction >= 1.0:
        return list(range(n))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + 17)).tolist()
    return sorted(perm[: max(1, round(n * fraction))])


class EpochBatches:
    """Deterministic batches: epoch e shuffles with randperm(n, seed + e); batches never
    straddle epochs, and a partial last batch is dropped.

    ``group_by_length``: within each run of ``batch_size * GROUP_BATCHES`` shuffled examples,
    sort by length before cutting batches, then shuffle the batch order. Batches pad to their
    longest example, so random batches of chat data waste about a quarter of every forward
    on padding; grouped, about 5%. The batch order and each batch's membership stay random
    at the scale of the group."""

    GROUP_BATCHES = 16

    def __init__(
        self,
        examples: list[TokenizedExample],
        batch_size: int,
        seed: int,
        group_by_length: bool = False,
        fraction: float = 1.0,
    ):
        if batch_size < 1:
            raise DataError(f"train.batch_size must be >= 1, got {batch_size}")
        self.examples, self.batch_size, self.seed = examples, batch_size, seed
        self.group_by_length = group_by_length
        # The examples drawn from (train.data_fraction): indices stay those of ``examples``, so
        # teachers keyed by row still line up.
        self.pool = fraction_pool(len(examples), fraction, seed)
        self.batches_per_epoch = max(1, len(self.pool) // batch_size)
        self._order: dict[int, list[list[int]]] = {}

    def indices(self, epoch: int, index: int) -> list[int]:
        if epoch not in self._order:
            self._order = {epoch: self._epoch_batches(epoch)}  # one epoch at a time is enough
        return self._order[epoch][index]

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        perm = [self.pool[i] for i in torch.randperm(len(self.pool), generator=g).tolist()]
        bs, n = self.batch_size, self.batches_per_epoch
        if not self.group_by_length:
            return [perm[i * bs : (i + 1) * bs] for i in range(n)]
        used, group = perm[: n * bs], bs * self.GROUP_BATCHES
        batches = []
        for start in range(0, len(used), group):
            chunk = sorted(used[start : start + group], key=lambda i: -len(self.examples[i].input_ids))
            batches += [chunk[j : j + bs] for j in range(0, len(chunk), bs)]
        return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]

    def batch(self, epoch: int, index: int) -> list[TokenizedExample]:
        return [self.examples[i] for i in self.indices(epoch, index)]

    def position(self, step: int) -> tuple[int, int]:
        return divmod(step, self.batches_per_epoch)
