"""The data-side sections: data (with data.regen), vocab and draft."""

from __future__ import annotations

from dataclasses import dataclass

from draftling.config.fields import AT_LEAST_ONE, AUTO, NON_NEGATIVE, POSITIVE, Auto, key, validate
from draftling.errors import ConfigError

SPLIT_KEYS = ("auto", "id", "task", "source")  # data.split_key (see data/split.py)


@dataclass
class RegenConfig:
    max_new_tokens: int = key(512, bounds=AT_LEAST_ONE, help="Most new tokens per regenerated reply.")
    temperature: float = key(0.0, bounds=NON_NEGATIVE, help="0 = greedy")
    top_p: float = key(
        1.0,
        bounds=("a number in (0, 1]", lambda v: 0 < v <= 1),
        help=("Nucleus sampling mass of the replies (1 = off)."),
    )
    batch_size: int = key(16, bounds=AT_LEAST_ONE, help="Prompts regenerated at once.")
    seed: int = key(0, help="Seed of sampled replies (sampled reply k of a prompt: seed + k).")
    prefill_chunk_tokens: int | Auto = key(
        AUTO,
        bounds=("an integer >= 0 (0 = off) or auto", lambda v: v >= 0),
        help=(
            "Prefill long prompts in pieces of about this many tokens (rows x columns) per forward. On the CPU a whole "
            "batch of long prompts at once is memory-bound in its elementwise ops: a batch of 53 prompts (7121 tokens) "
            "took 63 s in one forward and 38 s in pieces of 4096, same replies "
            "(lab/experiments/gguf_load_and_chunked_prefill.py). auto = 4096 on the CPU, off elsewhere; 0 = off."
        ),
    )
    dtype: str | None = key(
        None,
        help=(
            "dtype of the model that writes the TRAINING replies (and their kept states): null = the target's own; "
            '"bfloat16_if_fast" = bf16 where this device multiplies bf16 faster than fp32 (CUDA; a CPU with '
            "AVX512-BF16 or AMX, by a timed probe, see hardware.py), else the target's own; or a dtype name. Validation "
            "replies always come from the target's own dtype, so its metrics score the target as it is served."
        ),
    )
    server_url: str | None = key(
        None,
        flag="--server",
        help=(
            "Regenerate through an OpenAI-compatible server (vLLM / SGLang `serve`) instead of the local target, e.g. "
            '"http://localhost:8000". Then only the target\'s tokenizer is loaded.'
        ),
    )
    server_model: str | None = key(
        None, flag="--server-model", help="The model name the server serves; null = the only one its /v1/models lists."
    )
    concurrency: int = key(16, bounds=AT_LEAST_ONE, help="requests in flight; the server batches them")
    api_key_env: str = key("OPENAI_API_KEY", help="env var holding the key (the key is never written)")
    request_timeout_s: float = key(600.0, bounds=POSITIVE, help="Seconds before a server request is given up.")
    max_retries: int = key(5, bounds=NON_NEGATIVE, help="on connection errors, HTTP 429 and 5xx")
    engine: str = key(
        "auto",
        choices=("auto", "on", "off"),
        help=(
            "Write replies (greedy or sampled) with the batched plain engine (engine/generate.py) instead of HF generate: "
            "data.regen.batch_size engine rows, finished rows refilled. auto = on with CUDA, without kept teacher "
            "states, for an architecture the engine serves; on = the same but refused (with the reason) where it cannot;"
            " off = HF generate."
        ),
    )
    samples_per_prompt: int = key(
        1,
        bounds=AT_LEAST_ONE,
        help=(
            "Replies per TRAINING prompt: the first at `temperature` (greedy by default), each further one sampled at "
            "`sample_temperature` (top_p as set; seed + k), its temperature in the reply's provenance; more of the "
            "target's own distribution per prompt. Validation keeps one. The sampled passes take the same writer as the "
            "first (data.regen.engine)."
        ),
    )
    sample_temperature: float = key(
        0.8, bounds=POSITIVE, help=("Temperature of the further replies samples_per_prompt adds.")
    )

    def __post_init__(self):
        validate("data.regen", self)


@dataclass
class DataConfig:
    prompts: list[str] = key(
        factory=lambda: [
            "shared:sharegpt.jsonl",
            "shared:instruct.jsonl",
            "shared:code_mbpp.jsonl",
            "shared:math_gsm8k_train.jsonl",
            "shared:summarize.jsonl",
        ],
        flag="--prompts",
        help=(
            "Prompt specs (data/sources.py): a jsonl file (project schema, ShareGPT or OpenAI messages), "
            '"starter:NAME" (shipped with the package: chat, code, math), "set:NAME" (a shipped prompt set, e.g. set:v1), '
            '"shared:NAME" (the development corpus), '
            '"hf:NAME[:CONFIG][@SPLIT]" or a save_to_disk folder (the `datasets` extra).'
        ),
    )
    max_prompts_per_file: int = key(0, bounds=("an integer >= 0 (0 = all)", lambda v: v >= 0), help="0 = all")
    max_prompts_by_file: dict[str, int] = key(
        factory=dict,
        help=(
            "Per-file caps that replace max_prompts_per_file for the files they name (keys as listed in ``prompts``), "
            'e.g. to keep a large file from dominating the mix: {"shared:x.jsonl": 3000}.'
        ),
    )
    exclude: list[str] = key(
        factory=list,
        help=(
            'Prompt files whose conversations must not be trained on, e.g. "set:v1" (the release bench\'s prompts): a '
            "conversation is dropped if its id matches or any of its user turns repeats one of theirs, so the bench "
            "stays out of distribution."
        ),
    )
    exclude_ids: list[str] = key(
        factory=list,
        flag="--exclude-ids",
        help=(
            "Files of conversation ids never to train on (`data --exclude-ids FILE`), e.g. the tasks of a serving replay"
            " set: one id per line ('#' comments allowed) or a jsonl with \"id\"."
        ),
    )
    rollouts: bool = key(
        False,
        help=(
            "Agent rollouts: every assistant turn of a multi-turn conversation becomes a prompt of its own, its original"
            " prefix as it is (user turns, tool results, earlier replies) and the target's reply; only that reply is a "
            "loss token. The split stays by the conversation's task."
        ),
    )
    rollout_max_turns: int = key(
        0,
        bounds=NON_NEGATIVE,
        help=(
            "With rollouts: at most this many of a conversation's assistant turns (0 = all), a seeded sample of those "
            "whose prefix fits data.max_tokens - data.regen.max_new_tokens; prefixes grow with the turn, so all turns of"
            " a long trajectory cost quadratically in its length."
        ),
    )
    val_fraction: float = key(
        0.05,
        bounds=("a number in [0, 1)", lambda v: 0 <= v < 1),
        help=("Share of the conversations held out for validation (split by split_key)."),
    )
    split_key: str = key(
        "auto",
        choices=SPLIT_KEYS,
        help=(
            '"id": each conversation is its own task; "task": a record\'s `task` field, or NAME-TASK for ids NAME-'
            'TASK-TRIAL (tau-bench\'s trials of one task stay on one side); "source": per file; "auto": task when any'
            " record carries a task identity, else id (data/split.py resolve_split_key; the data summary names the key "
            "chosen and why)."
        ),
    )
    drop_tool_calls: bool = key(False, help="Drop conversations that carry tool calls.")
    min_tokens: int = key(8, bounds=NON_NEGATIVE, help="drop conversations shorter than this (in target tokens)")
    max_tokens: int = key(2048, bounds=AT_LEAST_ONE, help="truncate longer ones")
    seed: int = key(0, help="Seed of the prompt sampling and the train/val split.")
    regen: RegenConfig = key(factory=RegenConfig)
    keep_teacher_states: bool = key(
        False,
        help=(
            "Keep the target's aux and final states from local regeneration (data/states.py), so training skips its "
            "teacher forward on those tokens. Costs 4*H values per token on disk (SmolLM2-135M in fp32: 9 KB); worth it "
            "where the teacher forward is dear (CPU)."
        ),
    )

    def __post_init__(self):
        validate("data", self)
        if self.min_tokens > self.max_tokens:
            raise ConfigError(f"data.min_tokens={self.min_tokens} is above data.max_tokens={self.max_tokens}")
        for spec, cap in self.max_prompts_by_file.items():
            if cap < 0:
                raise ConfigError(f"data.max_prompts_by_file[{spec!r}]={cap}: expected an integer >= 0 (0 = all)")
        unknown = sorted(set(self.max_prompts_by_file) - set(self.prompts))
        if unknown:
            raise ConfigError(f"data.max_prompts_by_file: {unknown} not in data.prompts {self.prompts}")

    def prompt_cap(self, spec: str) -> int:
        """How many prompts to sample from the file ``spec`` (0 = all)."""
        return self.max_prompts_by_file.get(spec, self.max_prompts_per_file)


@dataclass
class VocabConfig:
    size: int = key(
        32000, bounds=AT_LEAST_ONE, flag="--size", help=("Draft vocab size: the N most frequent loss-masked tokens.")
    )
    prompt_weight: float = key(
        0.0,
        bounds=NON_NEGATIVE,
        flag="--prompt-weight",
        help=(
            "Rank tokens by their share of the reply tokens plus this weight times their share of the prompt text in the"
            " prompt files (every prompt but validation's; counted by `data`). 0 = replies only. A few hundred replies "
            "miss tokens that replies copy from their prompts, which the target often predicts with high confidence."
        ),
    )

    def __post_init__(self):
        validate("vocab", self)


@dataclass
class DraftConfig:
    init_from_target: bool = key(
        False,
        help=(
            "Copy the target's final norm and head rows for the draft vocab into the head. Off by default: on SmolLM2 it"
            " started confidently wrong and learned slower than a fresh head."
        ),
    )
    intermediate_size: int | None = key(
        None,
        help=(
            "The draft layer's MLP width; null = the target's intermediate_size (the EAGLE-3 shape). A narrower MLP "
            "trains faster and overfits less when there is little data (the CPU profile)."
        ),
    )
    init_from: str | None = key(
        None,
        flag="--init-from",
        help=(
            "Start from this head instead of a new one (`train --init-from DIR`: a draftling run, draft or checkpoint, "
            "an SGLang/EAGLE export or a speculators export). It keeps its own vocab map unless rebuild_vocab "
            "(train/warmstart.py)."
        ),
    )
    rebuild_vocab: bool = key(
        False,
        flag="--rebuild-vocab",
        help=(
            "With init_from: use the data's vocab map instead of the head's own; the head rows of tokens that enter are "
            "re-initialised."
        ),
    )
    window: int = key(
        0,
        bounds=(
            "an integer >= 0 (0 = full attention)",
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        ),
        help=(
            "Sliding-window attention: each draft query sees the context keys of its last `window` positions (its own "
            "included), so the draft's cost stays flat in context length; 0 = full causal attention. Kept in the draft's"
            " config (sliding_window), which training, the engine and the exports read."
        ),
    )
    fc_norm: bool = key(
        False,
        help=(
            "EAGLE-3.1: an RMS norm on each target aux state before the fc layer (speculators --fc-norm; vLLM reads it "
            "from the head's config). Exclusive with norm_before_fc."
        ),
    )
    norm_before_fc: bool = key(
        False,
        help="One RMS norm on the concatenated aux states before the fc layer (speculators/vLLM norm_before_fc).",
    )
    norm_output: bool = key(
        False,
        help=(
            "EAGLE-3.1: feed the normed output back to the next draft step instead of the pre-norm one, so the state "
            "keeps one scale over deep drafts (speculators --norm-output; vLLM reads it from the head's config)."
        ),
    )

    method: str = key(
        "eagle3",
        choices=("eagle3", "dflash"),
        help=(
            "The head type: eagle3 (one layer drafting a token a step) or dflash (a block-parallel drafter: one pass "
            "proposes train.ttt_steps tokens, a block of ttt_steps + 1 with its anchor; draft/block.py). dflash trains, "
            "decodes in the batched engine from one drafting pass per round, verified as its chain or as a tree of its "
            "drafts (bench, bench --release, --concurrency; greedy or sampled), select, warm starts (--init-from keeps "
            "its block and layers), plan, and exports in speculators' dflash layout."
        ),
    )
    layers: int = key(1, bounds=AT_LEAST_ONE, help="Decoder layers of a dflash head (an eagle3 head has one).")
    block_causal: bool = key(
        False,
        help=(
            "dflash: a block slot sees only the earlier slots of its block instead of all of them (the published "
            "design); the export tells vLLM which (sliding_window_non_causal)."
        ),
    )
    mask_token_id: int | None = key(
        None,
        help=(
            "The token whose embedding fills a dflash block's unknown slots; null = the tokenizer's mask token, else "
            "its pad, else its eos (as speculators picks it)."
        ),
    )

    def __post_init__(self):
        validate("draft", self)
        if self.method == "eagle3" and self.block_causal:
            raise ConfigError("draft.block_causal: a dflash option (draft.method=dflash)")
        if self.method == "eagle3" and self.layers != 1:
            raise ConfigError(
                f"draft.layers={self.layers}: an eagle3 head has one layer (draft.method=dflash for more)"
            )
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError("draft.fc_norm and draft.norm_before_fc are exclusive: set one of them")
