"""Count the operations that make the host wait for the device on CUDA, on the CPU.

On the CPU nothing waits, but the same calls are there: a scalar read (``.item()``,
``bool``/``float``/``int`` of a tensor), ``.tolist()``/``.cpu()``/``.numpy()``, and ops whose
output size depends on the data (``nonzero``, boolean indexing, ``bincount``, ``unique``...).
``HostReads`` records each one with the op's name while it is active; ``paused()`` leaves out
a stretch that runs on host tensors by design (collating a batch from Python lists).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Ops whose output shape depends on tensor values: CUDA must read back a count first.
DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten.bincount.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten._local_scalar_dense.default,
}
PYTHON_READS = ("tolist", "cpu", "numpy")


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class HostReads(TorchDispatchMode):
    def __init__(self, ignore=()):
        super().__init__()
        self.calls: list[str] = []
        self.counting = True
        self.ignore = list(ignore)  # host tensors whose scalar reads wait for nothing
        self._saved: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting and not any(args and args[0] is t for t in self.ignore):
            if func in DATA_DEPENDENT:
                self.calls.append(str(func.overloadpacket.__name__))
            elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and _bool_index(args):
                self.calls.append(f"{func.overloadpacket.__name__}[bool]")
            elif func is aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is None:
                self.calls.append("repeat_interleave")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in PYTHON_READS:
            original = self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def _counted(self, name, original):
        def read(tensor, *args, **kwargs):
            if self.counting:
                self.calls.append(name)
            with self.paused():  # .tolist() of a CUDA tensor is one read, not one per element
                return original(tensor, *args, **kwargs)

        return read

    @contextlib.contextmanager
    def paused(self):
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before
