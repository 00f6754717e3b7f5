"""`draftling export`: read a trained draft and write a serving format."""

from __future__ import annotations

from pathlib import Path

from draftling.draft.store import load_draft
from draftling.errors import DraftlingError
from draftling.export.conventions import is_default_aux_layer_ids
from draftling.export.formats import export_sglang, export_speculators
from draftling.io import check_output_dir


def export_draft(draft_dir, out, fmt: str = "sglang", with_embedding: bool = False,
                 target=None, dtype: str = "bfloat16", overwrite: bool = False) -> Path:
    """Export a draftling draft directory. ``target`` is a loaded Target (needed for the
    embedding) or None. ``out`` must be new, empty, or (with ``overwrite``) an earlier export,
    whose own files are then replaced; anything else there is refused before any work."""
    check_output_dir(out, "export", overwrite)
    draft = load_draft(draft_dir)
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
        return export_sglang(draft, out, include_embedding=with_embedding, embedding=embedding,
                             trained_on_default_layers=default, dtype=dtype, target_config=target_config)
    if fmt == "speculators":
        name = target.spec.name if target is not None else getattr(cfg, "_name_or_path", "") or "unknown"
        archs = list(getattr(target.config, "architectures", None) or []) if target is not None else []
        return export_speculators(draft, out, verifier_name_or_path=name, verifier_architectures=archs,
                                  include_embedding=with_embedding, embedding=embedding, dtype=dtype,
                                  target_config=target_config)
    raise DraftlingError(f"--format {fmt}: expected sglang or speculators")


def export_from_cli(args, cfg) -> None:
    """`draftling export`'s flags; ``cfg``: the run config naming the target, loaded only when
    --with-embedding or --target asks for it."""
    check_output_dir(args.out, "export", args.overwrite)  # before the target loads
    target = None
    if args.with_embedding or args.target:
        from draftling.target import load_target_from_config

        target = load_target_from_config(cfg)
    out = export_draft(args.draft, args.out, args.format, args.with_embedding, target, args.export_dtype,
                       args.overwrite)
    print(f"exported {args.format} format to {out}")
