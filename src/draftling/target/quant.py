"""On-the-fly quantization of the target at load time (``RunConfig.quantization``).

A quantized teacher only has to produce aux hidden states and logits, so weight-only
quantization that transformers applies in ``from_pretrained`` is enough. Each method needs an
optional package, installed with draftling's extra of the same name (``pip install
'draftling[bnb]'``); none is imported unless asked for. docs/teachers.md records what was tried
and where.

A checkpoint saved quantized (AWQ, GPTQ, FP8, compressed-tensors, ...) names its method in its
config's ``quantization_config``; ``PREQUANTIZED`` says which packages transformers needs to load
each method, checked before any weight loads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from draftling.errors import TargetError


@dataclass(frozen=True)
class QuantMethod:
    config_class: str  # the transformers *Config class
    kwargs: dict = field(default_factory=dict)
    package: str = ""  # import name that must be present
    extra: str = ""  # draftling's optional extra that installs it
    torchao_type: str | None = None  # TorchAoConfig takes a torchao config object, built on demand
    compute_dtype_arg: str | None = None  # kwarg that receives the run's dtype


QUANT_METHODS: dict[str, QuantMethod] = {
    "bnb-4bit": QuantMethod(
        "BitsAndBytesConfig",
        {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        package="bitsandbytes",
        extra="bnb",
        compute_dtype_arg="bnb_4bit_compute_dtype",
    ),
    "bnb-8bit": QuantMethod("BitsAndBytesConfig", {"load_in_8bit": True}, package="bitsandbytes", extra="bnb"),
    "quanto-int8": QuantMethod("QuantoConfig", {"weights": "int8"}, package="optimum.quanto", extra="quanto"),
    "quanto-int4": QuantMethod("QuantoConfig", {"weights": "int4"}, package="optimum.quanto", extra="quanto"),
    "torchao-int8": QuantMethod(
        "TorchAoConfig", package="torchao", extra="torchao", torchao_type="Int8WeightOnlyConfig"
    ),
}


@dataclass(frozen=True)
class PrequantizedMethod:
    packages: tuple[str, ...]  # import names transformers needs to load the checkpoint
    extra: str  # draftling's optional extra that installs them


# Checkpoint methods (``quantization_config.quant_method``) that need a package beyond
# transformers; any other method is left to transformers to accept or refuse.
PREQUANTIZED: dict[str, PrequantizedMethod] = {
    "gptq": PrequantizedMethod(("gptqmodel", "optimum"), "gptq"),
    "awq": PrequantizedMethod(("gptqmodel",), "awq"),
    "compressed-tensors": PrequantizedMethod(("compressed_tensors",), "compressed-tensors"),
}


def checkpoint_method(config) -> str | None:
    """The quantization method a checkpoint's config names (``gptq``, ``awq``, ``fp8``, ...),
    or None for a plain checkpoint."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


def prequantized_kwargs(name: str, method: str, quantization: str | None) -> dict:
    """from_pretrained's arguments for a checkpoint saved with ``method``. Refuses, in one line,
    what cannot load it: a second quantization on top (``quantization``), a missing package.
    A compressed-tensors checkpoint is decompressed while it loads: by default it decompresses
    on the whole model's first forward, which the teacher (it calls the decoder) never runs."""
    if quantization:
        raise TargetError(
            f"quantization {quantization}: {name} is already quantized ({method} checkpoint); "
            "leave quantization unset to load it as stored"
        )
    need = PREQUANTIZED.get(method)
    missing = [p for p in need.packages if not _package_present(p)] if need else []
    if need and missing:
        raise TargetError(
            f"{name} is a {method} checkpoint: loading it needs the {', '.join(missing)} "
            f"package{'s' if len(missing) > 1 else ''}; install with: pip install 'draftling[{need.extra}]'"
        )
    if method == "compressed-tensors":
        from transformers import CompressedTensorsConfig

        return {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    return {}


def _quant_method(name: str) -> QuantMethod:
    method = QUANT_METHODS.get(name)
    if method is None:
        raise TargetError(
            f"quantization {name!r}: unknown method; expected one of "
            f"{', '.join(QUANT_METHODS)} (or null to load the target as stored)"
        )
    return method


def _package_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def quantization_config(name: str, dtype: torch.dtype):
    """The transformers quantization config for ``name``, ready for ``from_pretrained``."""
    import transformers

    method = _quant_method(name)
    if not _package_present(method.package):
        raise TargetError(
            f"quantization {name}: needs the {method.package.split('.')[0]} package; "
            f"install it with: pip install 'draftling[{method.extra}]'"
        )
    kwargs = dict(method.kwargs)
    if method.compute_dtype_arg:
        kwargs[method.compute_dtype_arg] = dtype
    config_class = getattr(transformers, method.config_class)
    if method.torchao_type:
        import torchao.quantization

        return config_class(getattr(torchao.quantization, method.torchao_type)(), **kwargs)
    return config_class(**kwargs)


def plain_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """``module.weight`` when it is an ordinary float tensor; None when it is quantized (a
    bitsandbytes ``Params4bit``, a torchao or quanto tensor subclass, an int8 buffer), in
    which case only calling the module gives correct outputs."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point:
        return None
    if weight.element_size() == 1:  # float8: stored quantized (a compressed-tensors FP8 layer)
        return None
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return None
    return weight


def has_plain_weights(model: torch.nn.Module) -> bool:
    """Whether the first decoder layer's linear layers hold ordinary float weights (a GGUF
    target, dequantized on load, does; an on-the-fly quantized one does not)."""
    from draftling.target.aux import decoder_layers

    linears = [m for m in decoder_layers(model)[0].modules() if isinstance(m, torch.nn.Linear)]
    return bool(linears) and all(plain_weight(m) is not None for m in linears)
