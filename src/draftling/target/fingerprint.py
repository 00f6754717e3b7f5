"""The target checkpoint's fingerprint: what a head was trained against, recorded in an export
and compared by `draftling check`.

What each field guarantees when it matches:

- ``config``: a hash of the architecture fields in CONFIG_FIELDS (sizes, layer and head counts,
  context length, tied embeddings): the hidden states the head reads have the same shape.
- ``rope``: the RoPE parameters as the serving engines read them (theta, the scaling type and its
  factors, per layer type where a model has several; ``rope_parameters``, else the legacy
  ``rope_scaling`` and ``rope_theta``): positions rotate the same way.
- ``tokenizer``: a hash of the vocabulary and the chat template: the same ids mean the same text.
- ``weights`` (optional, ``--weight-fingerprint``): a sha256 over a fixed sample of every weight
  tensor (WEIGHT_SAMPLE elements from its start, its end and evenly spaced between, rounded to
  bfloat16, so the dtype the target loads in does not change it). A retrained or fine-tuned
  checkpoint changes essentially every element, so it changes this hash; a change confined to
  elements outside the sample would not. A GGUF of the same checkpoint dequantizes to other
  values, and a quantized load (bitsandbytes) holds packed values: both read as other weights.

Without ``weights`` the fingerprint does NOT tell a retrained checkpoint of the same
architecture, RoPE and tokenizer from the one the head was trained on."""

from __future__ import annotations

import hashlib
import json

import torch

from draftling.errors import DraftlingError

CONFIG_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
)
WEIGHT_SAMPLE = 64  # elements from a tensor's start, its end, and evenly spaced between
HASHED = ("config", "tokenizer", "weights")  # compared as hashes; ``rope`` is compared as read


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_hash(config) -> str:
    # rope_theta stays a field (None under transformers 5): exports that recorded this hash still match.
    return _digest({k: getattr(config, k, None) for k in CONFIG_FIELDS})


def tokenizer_hash(tokenizer) -> str:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return _digest({"vocab": sorted(vocab.items()), "chat_template": getattr(tokenizer, "chat_template", None)})


def _rope_entry(params: dict, theta) -> dict:
    """One RoPE parameter set: the type under either key ("rope_type", legacy "type"), theta, and
    every other scalar or list (factor, low/high_freq_factor, original_max_position_embeddings,
    beta_fast/slow, mrope_section, ...), numbers as floats so 1e4 and 10000 read the same."""
    out = {
        "rope_type": params.get("rope_type") or params.get("type") or "default",
        "rope_theta": params.get("rope_theta", theta),
    }
    for k, v in params.items():
        if k not in ("rope_type", "type", "rope_theta") and isinstance(v, (int, float, str, list, type(None))):
            out[k] = v
    return {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in out.items()}


def rope_params(config) -> dict:
    """The target's RoPE as vLLM and SGLang read it: ``rope_parameters`` (transformers 5; per layer
    type where it maps layer types to sets), else ``rope_scaling``, with ``rope_theta`` from the
    set or, where the set has none, the config's attribute (None under transformers 5)."""
    theta = getattr(config, "rope_theta", None)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # {layer type: set}
        return {layer: _rope_entry(p, theta) for layer, p in sorted(params.items())}
    return _rope_entry(dict(params), theta)


def _sample(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n <= 3 * WEIGHT_SAMPLE:
        return flat.to("cpu", torch.bfloat16)
    idx = torch.linspace(0, n - 1, WEIGHT_SAMPLE, device=flat.device).long()
    parts = (flat[:WEIGHT_SAMPLE], flat[idx], flat[-WEIGHT_SAMPLE:])
    return torch.cat([p.to("cpu", torch.bfloat16) for p in parts])


@torch.no_grad()
def weight_hash(model) -> str:
    """sha256 over each named weight tensor's name, shape and sample (see the module docstring),
    in name order; a tied tensor counts once."""
    h = hashlib.sha256()
    for name, t in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if t.device.type == "meta":
            raise DraftlingError(
                f"weight fingerprint: {name} is offloaded (device meta); load the target "
                "without a device map that offloads it"
            )
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(_sample(t).view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint(config, tokenizer=None, model=None) -> dict:
    """``model`` given: also the weight fingerprint."""
    out = {"config": config_hash(config), "rope": rope_params(config)}
    if tokenizer is not None:
        out["tokenizer"] = tokenizer_hash(tokenizer)
    if model is not None:
        out["weights"] = weight_hash(model)
    return out


def describe(fp: dict) -> str:
    """What a recorded fingerprint holds, for a model card."""
    parts = [f"config `{fp.get('config', '?')}`", f"tokenizer `{fp.get('tokenizer', '?')}`"]
    if "rope" in fp:
        parts.append(f"RoPE `{json.dumps(fp['rope'], sort_keys=True)}`")
    parts.append(
        f"weights `{fp['weights']}` (sha256 of a fixed sample of every weight tensor)"
        if "weights" in fp
        else "no weight fingerprint (`release --weight-fingerprint` adds one)"
    )
    return ", ".join(parts)
