"""A target larger than one device: accelerate's big-model dispatch (``device_map``).

The target's modules are spread over GPUs, host RAM and disk; accelerate's hooks move each
module's inputs (and, for offloaded modules, its weights) to where it runs. What draftling
reads from the target is brought back to the draft's device: the aux states and the final
states (train/teacher.py), so the code downstream sees a target on one device.

The draft trains on ``device`` (the run's ``--device``), which must hold the input embedding
resident: the draft embeds its tokens with it at every step.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass

import torch

from draftling.config import device_map_value, max_memory_bytes
from draftling.errors import TargetError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """How to spread a target over devices: the run config's device_map, resolved."""

    device_map: str | dict  # "auto", "balanced", or {module name: device}
    source: str  # what the run config says (a mode or the FILE), for messages
    max_memory: dict | None = None  # {device: bytes}
    offload_folder: str | None = None  # null: $TMPDIR

    @classmethod
    def from_config(cls, cfg) -> Placement | None:
        if cfg.device_map is None:
            return None
        return cls(
            device_map_value(cfg.device_map), cfg.device_map, max_memory_bytes(cfg.max_memory), cfg.offload_folder
        )

    def load_kwargs(self, folder: tempfile.TemporaryDirectory) -> dict:
        """from_pretrained's placement arguments, disk offload into ``folder``."""
        return {"device_map": self.device_map, "max_memory": self.max_memory, "offload_folder": folder.name}

    def offload_dir(self) -> tempfile.TemporaryDirectory:
        """A temporary folder for disk-offloaded weights, removed when it is freed: the loader
        keeps it on the model (``model._draftling_offload``), so it lives as long as the model."""
        return tempfile.TemporaryDirectory(prefix="draftling-offload-", dir=self.offload_folder)


def dispatched_devices(model) -> list | None:
    """The devices a dispatched model is spread over, or None for a model on one device."""
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1 or "disk" in devices:
        return sorted(devices, key=str)
    return None


def execution_device(module: torch.nn.Module) -> torch.device | None:
    """Where ``module``'s forward runs: its accelerate hook's device, else its weights' (a
    quantized module may hold them as buffers); None for a module with neither."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    tensor = next(module.parameters(), None)
    tensor = tensor if tensor is not None else next(module.buffers(), None)
    return tensor.device if tensor is not None else None


def resident_weight(module: torch.nn.Module) -> torch.Tensor:
    """``module.weight`` with its values: an offloaded module's weight is a meta tensor between
    calls, and its values sit in its accelerate hook's weights map (host RAM or disk)."""
    weight = module.weight
    hook = getattr(module, "_hf_hook", None)
    if weight.device.type == "meta" and getattr(hook, "weights_map", None) is not None:
        return hook.weights_map["weight"]
    return weight


def same_device(a, b) -> bool:
    """``cuda`` and ``cuda:0`` are one device."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def check_placement(model, device, placement: Placement) -> None:
    """The draft embeds with the target's input embedding on ``device``: it must be resident there."""
    embed = model.get_input_embeddings()
    weight = embed.weight
    if weight.device.type == "meta" or not same_device(execution_device(embed), device):
        where = "offloaded" if weight.device.type == "meta" else f"on {execution_device(embed)}"
        raise TargetError(
            f"device_map {placement.source}: the input embedding is {where}, but the draft trains "
            f"on {device} and embeds with it; map the embedding module to {device}"
        )


def empty_model(config, dtype: torch.dtype = torch.float32):
    """The target's module tree with no weights (meta tensors): for placing it before loading."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # as loading would: a tied head is the embedding's tensor, mapped with it
    return model


def expand_device_map(model, device_map: dict, where: str) -> dict[str, int | str]:
    """{parameter name: device} for a module-level map; a TargetError names a map entry that is
    no module or parameter of ``model``, or the first parameters no entry covers."""
    names = {name for name, _ in model.named_modules()} | {name for name, _ in model.named_parameters()}
    unknown = [key for key in device_map if key and key not in names]
    if unknown:
        raise TargetError(f"device_map {where}: {unknown[0]!r} is not a module of the target ({type(model).__name__})")
    out, missing, first = {}, [], {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = max(
            (key for key in device_map if key == "" or name == key or name.startswith(key + ".")), key=len, default=None
        )
        alias = first.setdefault(id(param), name)
        if alias != name:  # a tied weight (the output head sharing the input embedding's): one tensor
            # accelerate keeps it where its first name is, except on disk, where the second name
            # is then missing from the offload index at the first forward
            here, there = (device_map[owner] if owner is not None else None), out.get(alias)
            if None not in (here, there) and here != there and "disk" in (here, there):
                raise TargetError(
                    f"device_map {where}: {name!r} is tied to {alias!r} (one tensor), but the "
                    f"map puts them on {' and '.join(sorted(map(str, (here, there))))}; "
                    "map both to one device"
                )
        elif owner is None:
            missing.append(name)
        else:
            out[name] = device_map[owner]
    if missing:
        raise TargetError(f"device_map {where}: no device for {len(missing)} parameters, e.g. {missing[0]!r}")
    return out


def infer_device_map(model, mode: str, max_memory: dict | None) -> dict:
    """accelerate's map for ``mode`` (auto, balanced: the same balanced fill) over ``max_memory``
    (None: what this machine has free), as transformers' from_pretrained infers it."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    no_split = getattr(model, "_no_split_modules", None) or []
    budget = get_balanced_memory(
        model, max_memory=dict(max_memory) if max_memory else None, no_split_module_classes=no_split
    )
    return infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split)


def dispatch_loaded(model, placement: Placement, folder: tempfile.TemporaryDirectory):
    """Dispatch a model loaded whole on the CPU (a GGUF target: transformers cannot offload its
    weights to disk on load, so it is dequantized in host RAM first)."""
    from accelerate import dispatch_model

    device_map = placement.device_map
    if isinstance(device_map, str):
        device_map = infer_device_map(model, device_map, placement.max_memory)
    else:
        expand_device_map(model, device_map, placement.source)
    return dispatch_model(model, device_map=device_map, offload_dir=folder.name)


def placement_summary(model) -> str:
    """'cpu: 4 modules, disk: 3 modules', for the load log."""
    counts: dict[str, int] = {}
    for device in (getattr(model, "hf_device_map", None) or {}).values():
        counts[str(device)] = counts.get(str(device), 0) + 1
    return ", ".join(f"{d}: {n} module{'s' if n > 1 else ''}" for d, n in sorted(counts.items()))
