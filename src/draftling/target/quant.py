"""On-the-fly quantization of the target at load time (``RunConfig.quantization``).

A quantized teacher only has to produce aux hidden states and logits, so weight-only
quantization that transformers applies in ``from_pretrained`` is enough. Each method needs an
optional package, installed with draftling's extra of the same name (``pip install
'draftling[bnb]'``); none is imported unless asked for. docs/teachers.md records what was tried
and where.
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
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return None
    return weight


def has_plain_weights(model: torch.nn.Module) -> bool:
    """Whether the first decoder layer's linear layers hold ordinary float weights (a GGUF
    target, dequantized on load, does; an on-the-fly quantized one does not)."""
    from draftling.target.aux import decoder_layers

    linears = [m for m in decoder_layers(model)[0].modules() if isinstance(m, torch.nn.Linear)]
    return bool(linears) and all(plain_weight(m) is not None for m in linears)
