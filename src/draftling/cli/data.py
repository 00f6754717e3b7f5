"""`draftling data`: prompts -> regenerated, tokenized, split data."""

from __future__ import annotations

from pathlib import Path

from draftling.cli.common import (
    DATA_FLAGS,
    EPILOG_OVERRIDES,
    TARGET_FLAGS,
    add_common,
    add_device_map_flag,
    add_key_flag,
    run_config,
)


def add_parser(sub) -> None:
    """`draftling data`: prompts -> regenerated, tokenized, split data."""
    p = sub.add_parser(
        "data",
        help="regenerate replies with the target, tokenize, split train/val",
        description="Read prompt files (project schema, ShareGPT or OpenAI messages), "
        "regenerate the assistant replies with the target itself, tokenize them with the "
        "target's chat template (loss on assistant tokens only) and split train/val by "
        "task id. Writes replies.jsonl, train.jsonl, val.jsonl and summary.json to --out, and "
        "prompt_token_counts.safetensors (the prompt files' token counts, validation's tasks left "
        "out, for `draftling vocab --prompt-weight`). "
        "With data.keep_teacher_states=true it also keeps the target's aux and final states "
        "from regeneration (teacher_states_{train,val}.safetensors), which `train` then uses "
        "instead of running the target over the same tokens again.",
        epilog=EPILOG_OVERRIDES,
    )
    add_common(p)
    add_device_map_flag(p)
    p.add_argument("--out", required=True, help="output data directory")
    add_key_flag(p, "prompts", action="append", metavar="SPEC", note="Repeat for several; they replace the list.")
    add_key_flag(p, "chat_template")
    add_key_flag(p, "exclude_ids", action="append", metavar="FILE", note="Repeatable.")
    add_key_flag(
        p,
        "server",
        metavar="URL",
        note="Its key comes from $OPENAI_API_KEY (data.regen.api_key_env), data.regen.concurrency requests at once.",
    )
    add_key_flag(p, "server_model", metavar="NAME")


def run(args) -> None:
    cfg = run_config(args, (*TARGET_FLAGS, *DATA_FLAGS))
    from draftling.data.prepare import check_data_dir, prepare_data
    from draftling.data.sources import check_prompt_files

    check_prompt_files(cfg)
    check_data_dir(Path(args.out))  # before the target loads
    if cfg.data.regen.server_url:
        from draftling.target.load import load_target_tokenizer

        # The server generates; the weights would only cost memory and load time here.
        target = load_target_tokenizer(cfg.target, cfg.chat_template)
    else:
        from draftling.target import load_target_from_config

        target = load_target_from_config(cfg)
    from draftling.engine.replies import reply_engine_for

    prepare_data(cfg, target, args.out, replies=reply_engine_for(cfg.data, target))
