"""Write a trained EAGLE-3 head in the formats serving engines load, and read one back.

- :func:`export_sglang`: the SGLang / EAGLE layout (``LlamaForCausalLMEagle3``), a Llama
  config.json plus one model.safetensors with ``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
  ``d2t``, ``t2d`` (and ``embed_tokens`` only on request).
- :func:`export_speculators` (export/speculators.py): the vLLM "speculators" layout
  (``Eagle3Speculator``), from the checks, tensors, layer config and writer here.
- :func:`load_sglang_export`: rebuild an :class:`Eagle3Draft` from an SGLang-layout dir (its
  vocab maps from the weights, or from ``d2t.npy`` / ``t2d.npy`` beside them).
- :func:`load_any_draft`: a draftling draft or an SGLang export, whichever the dir holds.

Aux-layer ids are translated by :mod:`draftling.export.conventions` and nowhere else.
Both writers refuse vocab maps that would serve garbage silently, and write atomically:
on any failure the destination is left untouched and no temporary directory remains.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy
import torch
from safetensors import safe_open
from transformers import LlamaConfig

from draftling.draft.block import BlockDraft
from draftling.draft.model import NORM_FLAGS, Eagle3Draft
from draftling.draft.store import CONFIG_FILE, load_draft
from draftling.errors import DraftlingError, one_line
from draftling.export.conventions import (
    check_vocab_maps,
    from_engine_aux_layer_ids,
    is_default_aux_layer_ids,
    to_engine_aux_layer_ids,
)
from draftling.export.dflash import load_dflash
from draftling.export.files import CONFIG_NAME, draft_tensors, resolve_dtype, weights_dtype_name, write_export
from draftling.target.aux import default_aux_layer_ids

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"

# Keys of a transformers config dict that mean nothing to a serving engine.
_CONFIG_NOISE = (
    "id2label",
    "label2id",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "problem_type",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "use_cache",
)
# Keys only an EAGLE-3 wrapper config carries; removed from the nested layer config.
_EAGLE_KEYS = (
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "eagle_config",
    "architectures",
    "draftling",
)


# ----------------------------------------------------------------------------------- utils


def _rope_fields(config) -> dict[str, Any]:
    """RoPE in both spellings: transformers>=5 ``rope_parameters`` and the legacy
    ``rope_theta`` / ``rope_scaling`` that engines pinned to transformers 4 read. A missing
    legacy ``rope_theta`` makes those engines fall back to 10000 without an error."""
    rp = dict(getattr(config, "rope_parameters", None) or {})
    theta = rp.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    scaling = None if rope_type == "default" else {k: v for k, v in rp.items() if k != "rope_theta"}
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": scaling}
    if rp:
        out["rope_parameters"] = rp
    return out


def llama_layer_fields(draft: Eagle3Draft, target_config=None) -> dict[str, Any]:
    """The plain Llama config of the draft's decoder layer (no EAGLE-3 keys)."""
    cfg = draft.config.to_dict()
    for k in _CONFIG_NOISE + _EAGLE_KEYS:
        cfg.pop(k, None)
    cfg.update(_rope_fields(draft.config))
    cfg["model_type"] = "llama"
    cfg["num_hidden_layers"] = 1
    cfg["tie_word_embeddings"] = False
    cfg["vocab_size"] = int(draft.config.vocab_size)
    cfg["max_position_embeddings"] = _max_positions(draft, target_config)
    return cfg


def _max_positions(draft: Eagle3Draft, target_config=None) -> int:
    """The draft's max_position_embeddings, never less than the target's (a small value
    caps long prompts: low acceptance or crashes)."""
    own = int(getattr(draft.config, "max_position_embeddings", 0) or 0)
    tgt = int(getattr(target_config, "max_position_embeddings", 0) or 0) if target_config else 0
    out = max(own, tgt)
    if out <= 0:
        raise DraftlingError("draft config has no max_position_embeddings; pass target_config")
    return out


def check_draft(draft: Eagle3Draft, target_config, include_embedding: bool, embedding: torch.Tensor | None) -> None:
    cfg = draft.config
    check_vocab_maps(draft.d2t, draft.t2d, int(cfg.draft_vocab_size), int(cfg.vocab_size))
    hidden = int(cfg.hidden_size)
    target_hidden = int(getattr(cfg, "target_hidden_size", hidden) or hidden)
    if target_config is not None:
        if int(target_config.vocab_size) != int(cfg.vocab_size):
            raise DraftlingError(
                f"draft vocab_size {cfg.vocab_size} != target vocab_size "
                f"{target_config.vocab_size}; the config must carry the TARGET vocab"
            )
        if int(target_config.hidden_size) != target_hidden:
            raise DraftlingError(
                f"draft target_hidden_size {target_hidden} != target hidden_size {target_config.hidden_size}"
            )
    if include_embedding:
        if embedding is None:
            raise DraftlingError(
                "include_embedding=True needs the target's embedding matrix "
                "(embedding=target.get_input_embeddings().weight)"
            )
        if tuple(embedding.shape) != (int(cfg.vocab_size), hidden):
            raise DraftlingError(f"embedding has shape {tuple(embedding.shape)}, expected ({cfg.vocab_size}, {hidden})")
    elif hidden != target_hidden:
        # Engines share the target's embedding only when the widths match (SGLang's set_embed
        # silently skips otherwise and serves a random embedding).
        raise DraftlingError(
            f"draft hidden_size {hidden} != target hidden size {target_hidden}: "
            "an embedding-free export cannot borrow the target's embedding; "
            "pass include_embedding=True"
        )


# ---------------------------------------------------------------------------------- SGLang


def export_sglang(
    draft: Eagle3Draft,
    out_dir: str | os.PathLike,
    *,
    include_embedding: bool = False,
    embedding: torch.Tensor | None = None,
    trained_on_default_layers: bool,
    dtype: torch.dtype | str = torch.bfloat16,
    target_config=None,
) -> Path:
    """Write ``draft`` as an SGLang / EAGLE-3 checkpoint directory and return its path.

    ``trained_on_default_layers``: the head was trained on HF hidden_states [2, L//2, L-3].
    The ids are then left out of the config and engines use their own (identical)
    defaults; otherwise they are written for SGLang in ``eagle_config`` (SGLang numbering)
    and at the top level (vLLM numbering, so vLLM can serve the same directory).
    ``dtype``: cast floating tensors to it ("keep" keeps them); d2t is int64, t2d bool.
    ``target_config``: optional target HF config; checks vocab/hidden sizes and the
    default-layer claim exactly, and raises max_position_embeddings to the target's.
    """
    check_draft(draft, target_config, include_embedding, embedding)
    ids = [int(i) for i in draft.config.eagle_aux_hidden_state_layer_ids]
    num_layers = int(target_config.num_hidden_layers) if target_config is not None else None
    if trained_on_default_layers and not is_default_aux_layer_ids(ids, num_layers):
        want = default_aux_layer_ids(num_layers) if num_layers else "[2, L//2, L-3]"
        raise DraftlingError(
            f"trained_on_default_layers=True but the head's aux layer ids are {ids}, not the "
            f"default {want}; omitting them would make engines feed the wrong layers"
        )
    dt = resolve_dtype(dtype)
    tensors = draft_tensors(
        draft, dt, layer_prefix="midlayer.", include_embedding=include_embedding, embedding=embedding
    )

    cfg = llama_layer_fields(draft, target_config)
    cfg["architectures"] = [SGLANG_ARCHITECTURE]
    cfg["draft_vocab_size"] = int(draft.config.draft_vocab_size)
    cfg["target_hidden_size"] = int(getattr(draft.config, "target_hidden_size", draft.config.hidden_size))
    eagle_config: dict[str, Any] = {"use_aux_hidden_state": True}
    if not trained_on_default_layers:
        eagle_config["eagle_aux_hidden_state_layer_ids"] = to_engine_aux_layer_ids(ids, "sglang")
        cfg["eagle_aux_hidden_state_layer_ids"] = to_engine_aux_layer_ids(ids, "vllm")
    cfg["eagle_config"] = eagle_config
    cfg["torch_dtype"] = weights_dtype_name(tensors)
    # draftling's own record (engines ignore unknown keys): lets load_sglang_export rebuild
    # the head even when the ids were omitted for the engines.
    cfg["draftling"] = {
        "aux_layer_ids": ids,
        "aux_layer_ids_convention": "hf_output_hidden_states",
        "trained_on_default_layers": bool(trained_on_default_layers),
    }
    return write_export(out_dir, cfg, tensors)


def _read_config(path: Path) -> dict[str, Any]:
    """config.json as a flat SGLang-layout dict; a speculators config (its Llama fields under
    transformer_layer_config, aux ids at the top in vLLM numbering) is flattened to that form."""
    try:
        cfg = json.loads((path / CONFIG_NAME).read_text())
    except FileNotFoundError:
        raise DraftlingError(f"{path}: no {CONFIG_NAME}; not an exported draft directory") from None
    except json.JSONDecodeError as e:
        raise DraftlingError(f"{path / CONFIG_NAME}: invalid JSON ({e})") from None
    if isinstance(cfg, dict) and cfg.get("speculators_model_type") == "eagle3":
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise DraftlingError(f"{path / CONFIG_NAME}: a speculators config without transformer_layer_config")
        top = {
            k: cfg[k]
            for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", *NORM_FLAGS)
            if k in cfg
        }
        cfg = {**{k: v for k, v in layer.items() if k != "architectures"}, **top}
    return cfg


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftlingError(f"{path}: no .safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


NPY_MAPS = ("d2t", "t2d")  # published heads sometimes ship their vocab maps as NAME.npy beside the weights


def _read_npy_maps(path: Path, tensors: dict[str, torch.Tensor], draft_vocab: int, vocab: int) -> list[str]:
    """d2t.npy / t2d.npy beside the weights, into ``tensors`` under their names, their shape and
    dtype checked (offsets are checked with the safetensors maps'). Returns the files read."""
    read = []
    for name in NPY_MAPS:
        f = path / f"{name}.npy"
        if not f.is_file():
            continue
        if name in tensors or f"model.{name}" in tensors:
            raise DraftlingError(f"{f}: {name} is also in the .safetensors weights; keep one of them")
        tensors[name] = _npy_map(f, name, draft_vocab if name == "d2t" else vocab)
        read.append(f.name)
    return read


def _npy_map(f: Path, name: str, size: int) -> torch.Tensor:
    try:
        a = numpy.load(f, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:  # pickled objects are refused as ValueError
        raise DraftlingError(f"{f}: not a readable .npy array ({one_line(e)})") from None
    if a.shape != (size,):
        raise DraftlingError(f"{f}: {name} has shape {a.shape}, expected ({size},) from config.json")
    integer = numpy.issubdtype(a.dtype, numpy.integer)
    if name == "d2t" and not integer:
        raise DraftlingError(f"{f}: d2t has dtype {a.dtype}, expected integer offsets (target = draft id + d2t)")
    if name == "t2d" and not (a.dtype == numpy.bool_ or (integer and bool(numpy.isin(a, (0, 1)).all()))):
        raise DraftlingError(f"{f}: t2d has dtype {a.dtype}, expected bool (or 0/1 integers)")
    return torch.from_numpy(a.astype(numpy.int64 if name == "d2t" else numpy.bool_))


def _aux_ids_from_config(cfg: dict[str, Any], path: Path, target_num_layers: int | None) -> list[int]:
    candidates: dict[str, list[int]] = {}
    sgl = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if sgl:
        candidates["eagle_config (SGLang numbering)"] = from_engine_aux_layer_ids(sgl, "sglang")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if top:
        candidates["top level (vLLM numbering)"] = from_engine_aux_layer_ids(top, "vllm")
    own = (cfg.get("draftling") or {}).get("aux_layer_ids")
    if own:
        candidates["draftling record"] = [int(i) for i in own]
    if candidates:
        distinct = {tuple(v) for v in candidates.values()}
        if len(distinct) > 1:
            raise DraftlingError(
                f"{path / CONFIG_NAME}: aux layer ids disagree (as HF hidden_states indices): {candidates}"
            )
        return list(distinct.pop())
    if target_num_layers is None:
        raise DraftlingError(
            f"{path / CONFIG_NAME}: no aux layer ids (the head uses the engine "
            "defaults); pass target_num_layers to rebuild them"
        )
    return default_aux_layer_ids(int(target_num_layers))


def load_sglang_export(
    path: str | os.PathLike,
    embedding: torch.Tensor | None = None,
    *,
    target_num_layers: int | None = None,
    dtype: torch.dtype | str | None = None,
) -> Eagle3Draft:
    """Rebuild an :class:`Eagle3Draft` from an SGLang-layout export directory.

    Aux-layer ids come back in draftling's numbering. When the config omits them (a head
    trained on the defaults, exported by another tool), ``target_num_layers`` supplies L.
    The embedding (the exported ``embed_tokens.weight`` if present, else ``embedding``) is
    attached as ``draft.embedding`` (a plain tensor, not a parameter; None if neither).
    ``dtype``: None keeps the stored floating dtype; the rotary tables stay float32.
    """
    path = Path(path)
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    ids = _aux_ids_from_config(cfg, path, target_num_layers)
    config = _export_config(cfg, path, ids)
    draft = Eagle3Draft(config)
    vocab, draft_vocab = int(cfg["vocab_size"]), int(config.draft_vocab_size)
    npy = _read_npy_maps(path, tensors, draft_vocab, vocab)
    sd, embed = _export_state_dict(tensors, vocab, draft_vocab, path)
    expected = set(draft.trainable_state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise DraftlingError(f"{path}: weights do not fit an EAGLE-3 head (missing {missing}, unexpected {unexpected})")
    check_vocab_maps(
        sd["d2t"],
        sd["t2d"],
        draft_vocab,
        vocab,
        where=f"{path} (vocab maps from {', '.join(npy)})" if npy else str(path),
    )
    try:
        draft.load_state_dict(sd, strict=False)
    except RuntimeError as e:
        raise DraftlingError(f"{path}: weight shapes do not match config.json ({e})") from None

    floats = {t.dtype for t in sd.values() if t.is_floating_point()}
    dt = resolve_dtype(dtype) if dtype is not None else (floats.pop() if len(floats) == 1 else None)
    if dt is not None:
        draft.cast_weights(dt)
    if embed is None:
        embed = embedding
    if embed is not None and tuple(embed.shape) != (vocab, int(config.hidden_size)):
        raise DraftlingError(f"embedding has shape {tuple(embed.shape)}, expected ({vocab}, {config.hidden_size})")
    draft.embedding = embed
    return draft


def _export_config(cfg: dict[str, Any], path: Path, ids: list[int]) -> LlamaConfig:
    """The draft's config from an SGLang-layout config.json, the EAGLE-3 keys in draftling's form."""
    fields = {k: v for k, v in cfg.items() if k not in _EAGLE_KEYS + _CONFIG_NOISE + ("transformers_version",)}
    vocab = int(cfg["vocab_size"])
    fields["draft_vocab_size"] = int(cfg.get("draft_vocab_size") or vocab)
    fields["target_hidden_size"] = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    fields["eagle_aux_hidden_state_layer_ids"] = ids
    fields["architectures"] = [SGLANG_ARCHITECTURE]
    fields["num_hidden_layers"] = 1
    fields["tie_word_embeddings"] = False
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise DraftlingError(
            f"{path / CONFIG_NAME}: num_hidden_layers={cfg['num_hidden_layers']}; "
            "draftling loads one-layer EAGLE-3 heads only"
        )
    try:
        return LlamaConfig(**fields)
    except (TypeError, ValueError) as e:
        raise DraftlingError(f"{path / CONFIG_NAME}: not a usable Llama config ({e})") from None


def _export_state_dict(
    tensors: dict[str, torch.Tensor], vocab: int, draft_vocab: int, path: Path
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(the head's state dict under draftling's names, the exported embedding or None). Vocab
    maps an export leaves out are rebuilt: an identity d2t, and t2d from d2t."""
    sd: dict[str, torch.Tensor] = {}
    embed = None
    for name, t in tensors.items():
        if name.startswith("model."):
            name = name[len("model.") :]
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0.") :]
        if name == "embed_tokens.weight":
            embed = t
            continue
        sd[name] = t
    if "d2t" not in sd:
        if draft_vocab != vocab:
            raise DraftlingError(
                f"{path}: no d2t in the weights but draft_vocab_size {draft_vocab} "
                f"< vocab_size {vocab}; the draft ids cannot be mapped"
            )
        sd["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    if "t2d" not in sd:
        if draft_vocab < vocab and not bool(sd["d2t"].any()):
            # t2d rebuilt from this d2t would agree with it whatever it is: nothing to check.
            raise DraftlingError(
                f"{path}: d2t is all zeros and there is no t2d while draft_vocab_size "
                f"{draft_vocab} < vocab_size {vocab}; the vocab maps look unset "
                f"(draft ids would map to target ids 0..{draft_vocab - 1})"
            )
        t2d = torch.zeros(vocab, dtype=torch.bool)
        targets = torch.arange(draft_vocab) + sd["d2t"].long()
        if int(targets.min()) >= 0 and int(targets.max()) < vocab:
            t2d[targets] = True
        sd["t2d"] = t2d
    sd["d2t"], sd["t2d"] = sd["d2t"].long(), sd["t2d"].bool()
    return sd, embed


def is_dflash_export(path: Path) -> bool:
    try:
        return json.loads((path / CONFIG_NAME).read_text()).get("speculators_model_type") == "dflash"
    except (OSError, ValueError, AttributeError):
        return False


def load_any_draft(path: str | os.PathLike, device, dtype) -> Eagle3Draft | BlockDraft:
    """A draftling run (its final draft/), draft dir or checkpoint dir, an SGLang export dir,
    or a speculators dflash export (what `bench` and `check` accept).

    It lives here, not beside draftling's own format in draft/store.py, because it also reads
    the SGLang layout this module writes: the draft stage must not import the export stage."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() and (path / "draft" / CONFIG_FILE).is_file():
        path = path / "draft"  # a training run: its final head
    if (path / CONFIG_FILE).is_file():
        return load_draft(path, device=device, dtype=dtype)
    if is_dflash_export(path):
        return load_dflash(path).cast_weights(dtype).to(device).eval()
    if (path / CONFIG_NAME).is_file():
        return load_sglang_export(path, dtype=dtype).to(device).eval()  # cast once, as it loads
    raise DraftlingError(f"{path}: not a draft directory (no {CONFIG_FILE} or {CONFIG_NAME})")
