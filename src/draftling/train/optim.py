"""AdamW with its fp32 master weights and moments in host RAM (``train.optimizer_offload``).

Per step: the device grads are copied into pinned CPU buffers (non-blocking), one
``torch.optim.AdamW`` steps the fp32 CPU masters, and the updated masters are copied back
into the device params (cast to their dtype). The device then holds only the params and
their grads; the 2x fp32 moments and the fp32 masters (16 bytes/param with bf16 params)
live on the host.

The inner optimizer is a real ``torch.optim.AdamW`` (``.optimizer``), so an LR scheduler
drives it directly, and ``state_dict()`` has the usual ``state``/``param_groups`` layout
plus ``master_params`` (the fp32 masters), which makes resume exact even when the device
params are in a lower precision than the masters.
"""

from __future__ import annotations

import torch

from draftling.timing import sync


class OffloadedAdamW:
    def __init__(
        self,
        params,
        lr: float,
        betas=(0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        pin: bool | None = None,
    ):
        self.params = [p for p in params]
        if pin is None:
            pin = torch.cuda.is_available() and any(p.device.type == "cuda" for p in self.params)
        self.pinned = pin
        self.masters = [self._host_buffer(p).requires_grad_(True) for p in self.params]
        self._grads = [self._host_buffer(p) for p in self.params]
        self.sync_masters_from_params()
        # fused: one multi-threaded kernel over all host masters, not a loop of small ops.
        self.optimizer = torch.optim.AdamW(
            self.masters, lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps, fused=True
        )

    def _host_buffer(self, p: torch.Tensor) -> torch.Tensor:
        return torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=self.pinned)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def _wait(self) -> None:
        for device in {p.device for p in self.params if p.device.type == "cuda"}:
            sync(device)

    @torch.no_grad()
    def sync_masters_from_params(self) -> None:
        for m, p in zip(self.masters, self.params):
            m.copy_(p.detach(), non_blocking=True)
        self._wait()

    @torch.no_grad()
    def step(self) -> None:
        for p, m, g in zip(self.params, self.masters, self._grads):
            if p.grad is None:
                m.grad = None
                continue
            g.copy_(p.grad, non_blocking=True)
            m.grad = g
        self._wait()  # the host reads the grads next
        self.optimizer.step()
        for p, m in zip(self.params, self.masters):
            # Stream-ordered before the next step's grad copies, and the masters are only
            # written after the _wait() above, so the non-blocking copy is safe.
            p.copy_(m, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        sd = self.optimizer.state_dict()
        sd["master_params"] = [m.detach().clone() for m in self.masters]
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_params", None)
        self.optimizer.load_state_dict(state_dict)
        if masters is None:
            # A checkpoint of the plain optimizer: the params just loaded are the masters.
            self.sync_masters_from_params()
        else:
            for m, saved, p in zip(self.masters, masters, self.params):
                m.copy_(saved)
                p.copy_(m)
        self._wait()


def build_optimizer(params, lr: float, betas, weight_decay: float, offload: bool):
    """Returns (optimizer, the torch optimizer an LR scheduler should wrap)."""
    if offload:
        opt = OffloadedAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
        return opt, opt.optimizer
    opt = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    return opt, opt
