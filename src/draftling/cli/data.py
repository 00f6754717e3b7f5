"""`draftling data`: prompts -> regenerated, tokenized, split data."""

from __future__ import annotations

from pathlib import Path

from draftling.cli.common import DATA_FLAGS, EPILOG_OVERRIDES, TARGET_FLAGS, add_common, add_device_map_flag, run_config


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
    p.add_argument(
        "--prompts",
        action="append",
        metavar="SPEC",
        help="prompts: a jsonl file (project, ShareGPT or OpenAI-messages shape), starter:chat, "
        "starter:code or starter:math (shipped), hf:NAME[:CONFIG][@SPLIT] or a save_to_disk "
        "folder (needs pip install 'draftling[hf]'), set:v1, or shared:NAME (the development "
        "corpus); repeat for several (overrides data.prompts)",
    )
    p.add_argument("--chat-template", help="jinja file to use when the target has no chat template")
    p.add_argument(
        "--exclude-ids",
        action="append",
        metavar="FILE",
        help="never train on these conversation "
        'ids (one per line, or a jsonl with "id"), e.g. a serving replay set; repeatable '
        "(data.exclude_ids)",
    )
    p.add_argument(
        "--server",
        metavar="URL",
        help="regenerate through an OpenAI-compatible server "
        "(vLLM / SGLang `serve`, e.g. http://localhost:8000) instead of loading the target's "
        "weights; only its tokenizer is loaded, for the chat template and loss masks. Key "
        "from $OPENAI_API_KEY (data.regen.api_key_env), data.regen.concurrency requests at once",
    )
    p.add_argument(
        "--server-model", metavar="NAME", help="model name the server serves (default: the only one /v1/models lists)"
    )


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
