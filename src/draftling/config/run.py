"""The bench and extract sections, and the run config that holds every section."""

from __future__ import annotations

from dataclasses import dataclass

from draftling.config.data import DataConfig, DraftConfig, VocabConfig
from draftling.config.devices import DEVICE_MAP_MODES, device_map_value, max_memory_bytes
from draftling.config.fields import (
    AT_LEAST_ONE,
    AUTO,
    Auto,
    bounds_of,
    check_bounds,
    check_choices,
    choices_of,
    key,
    validate,
)
from draftling.config.train import TrainConfig
from draftling.errors import ConfigError

# The release bench's baselines and the decode engine's attention kinds (sdpa: SDPA with a
# boolean mask; matmul: two matmuls and a softmax in the model's dtype; exact: the same with
# float64 sums, whose logits do not depend on where in the cache a token's context sits, which
# makes tree output equal plain output in bf16). Named here, the lowest stage, so that a config
# is checked when it loads; bench/release.py and engine/options.py take them from here.
RELEASE_BASELINES = ("engine_plain", "hf_static", "hf_prompt_lookup", "hf_eager")
RELEASE_SAMPLED_TEMPERATURES = (0.7, 1.0)  # how chat is served: the sampled figures beside the greedy ones
RELEASE_CONFIGS = ("chain-3-1-4", "tree-3-4-8", "tree-5-8-16")  # the release protocol's decode configs
CONCURRENCY_LEVELS = (1, 2, 4, 8, 16, 32, 64)  # the concurrency sweep's levels unless given
ENGINE_ATTENTION = ("sdpa", "matmul", "exact")


@dataclass
class BenchConfig:
    num_prompts: int = key(
        8,
        bounds=AT_LEAST_ONE,
        flag="--num-prompts",
        help="Prompts the simple bench decodes (the first N of its prompt file).",
    )
    max_new_tokens: int = key(256, bounds=AT_LEAST_ONE, flag="--max-new-tokens", help="New tokens per completion.")
    configs: list[str] = key(
        factory=lambda: ["chain-3-1-4"],
        flag="--configs",
        help=("Decode configs steps-topk-draft_tokens, e.g. chain-3-1-4, tree-3-4-8."),
    )
    temperature: float = key(
        0.0,
        flag="--temperature",
        help=(
            "0 = greedy, where speculative output must equal plain output token for token. Above 0 both decodes sample "
            "(lossless verification), so only tau and speed are comparable."
        ),
    )
    top_k: int = key(0, flag="--top-k", help="Keep the k likeliest tokens when sampling (0 = off).")
    top_p: float = key(1.0, flag="--top-p", help="Nucleus sampling mass (1 = off).")
    seed: int = key(0, help="sampling: prompt i uses seed + i, the same for plain and every config")
    # --- The release bench (`bench --release`, bench/release.py); the simple bench ignores these.
    # Its protocol sets configs and max_new_tokens itself (the three RELEASE_CONFIGS, 256 new
    # tokens) over whatever a profile gives the simple bench; flags and overrides still win.
    prompt_set: str = key(
        "v1", flag="--prompt-set", help="The release bench's prompt set: a built-in set name (v1, ...) or a jsonl path."
    )
    baselines: list[str] = key(
        factory=lambda: list(RELEASE_BASELINES),
        flag="--baselines",
        help="The release bench's baselines, some of engine_plain, hf_static, hf_prompt_lookup, hf_eager; engine_plain "
        "always runs (the speedups need it).",
    )
    baseline_prompts_per_workload: int | None = key(
        None,
        bounds=("an integer >= 1 (null = all)", lambda v: v >= 1),
        flag="--baseline-prompts-per-workload",
        help="Run the slow HF baselines on the first N prompts of each workload only; null = all.",
    )
    results_dir: str = key(
        ".",
        flag="--results-dir",
        help=(
            "Where the release bench writes: each run a folder of its own, <date>-release-<commit>-<machine>[-<tag>], "
            'in here; "." = the working directory.'
        ),
    )
    tag: str | None = key(None, flag="--tag", help="Suffix of a release run's folder and file names.")
    engine_compile: bool | Auto = key(
        AUTO,
        flag="--engine-compile",
        help="Compile the decode engine's target and draft layers (on/off); auto = on with CUDA.",
    )
    query_pad: int | Auto = key(
        AUTO,
        bounds=("an integer >= 0 (0 = off) or auto", lambda v: v >= 0),
        flag="--query-pad",
        help=(
            "Pad every target pass to this many queries, so plain and verify passes share kernels (0 = off); auto = "
            "the largest config's draft tokens on CUDA, off on CPU."
        ),
    )
    attention: str = key(
        "auto",
        choices=("auto", *ENGINE_ATTENTION),
        flag="--attention",
        help=(
            "The decode engine's attention: sdpa, matmul (in the model's dtype), or exact (float64 sums: tree output "
            "equals plain output in bf16); auto = on CUDA exact when padded (bench.query_pad), matmul unpadded; sdpa on CPU."
        ),
    )
    round_timing: bool | Auto = key(
        AUTO, help="Also time each round's phases (on the first prompts of each workload); auto = on CUDA."
    )
    sampled_temperatures: list[float] = key(
        factory=lambda: list(RELEASE_SAMPLED_TEMPERATURES),
        help=("Also decode sampled at each of these temperatures (plain and every config); [] = greedy only."),
    )
    concurrency: list[int] | None = key(
        None,
        flag="--concurrency",
        help=(
            "The concurrency sweep (`bench --concurrency`, bench/concurrency.py): its levels, e.g. [1, 2, 4, 8, 16, 32, "
            "64]; null = no sweep. Per level and config: aggregate and per-stream tok/s, tau, the speedup over plain at that "
            "level, the cost account and the crossover where plain wins. It uses prompt_set, configs, max_new_tokens and "
            "results_dir above."
        ),
    )

    def __post_init__(self):
        check_bounds("bench", self, bounds_of(BenchConfig))
        if not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in self.sampled_temperatures
        ):
            raise ConfigError(
                f"bench.sampled_temperatures={self.sampled_temperatures!r}: expected a list of "
                "numbers > 0, e.g. [0.7, 1.0], or [] for greedy only"
            )
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"bench: temperature {self.temperature} must be >= 0, top_k {self.top_k} "
                f">= 0 and top_p {self.top_p} in (0, 1]"
            )
        check_choices("bench", self, choices_of(BenchConfig))
        if self.concurrency is not None and (
            not self.concurrency
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in self.concurrency)
        ):
            raise ConfigError(f"bench.concurrency={self.concurrency!r}: expected a list of integers >= 1, e.g. 1,2,4,8")
        unknown = [b for b in self.baselines if b not in RELEASE_BASELINES]
        if unknown:
            raise ConfigError(
                f"bench.baselines: unknown baselines {unknown}; expected some of {', '.join(RELEASE_BASELINES)}"
            )


@dataclass
class ExtractConfig:
    """`draftling extract` (train/offline.py): how the offline teacher cache is written."""

    shard_size: int = key(256, bounds=AT_LEAST_ONE, flag="--shard-size", help="Sequences per cache shard.")
    batch_size: int = key(8, bounds=AT_LEAST_ONE, flag="--batch-size", help="Sequences per teacher forward pass.")
    logits_dtype: str | None = key(
        None,
        choices=("float32", "bfloat16", "float16"),
        flag="--logits-dtype",
        help=(
            "Storage dtype of the draft-vocab logits: float32, bfloat16 or float16; null = the target's compute dtype "
            "(lossless). They dominate the cache's size."
        ),
    )

    def __post_init__(self):
        check_bounds("extract", self, bounds_of(ExtractConfig))
        check_choices("extract", self, choices_of(ExtractConfig))


@dataclass
class RunConfig:
    target: str = key(
        "smollm2-135m-instruct",
        flag="--target",
        help=(
            "The target: an HF hub id, a local model directory, a .gguf file or a built-in name "
            "(smollm2-135m-instruct or default: the embedded SmolLM2-135M-Instruct GGUF)."
        ),
    )
    dtype: str = key("float32", flag="--dtype", help="The target's dtype: float32, bfloat16 or float16.")
    device: str = key(
        "auto",
        resume="free",
        flag="--device",
        help="Where the target (and the draft) run: cpu, cuda, cuda:1, ...; auto = cuda if available.",
    )
    aux_layer_ids: list[int] | None = key(
        None,
        help=(
            "The three target layers (low, mid, high) whose states the draft reads; null = [2, L // 2, L - 3] for a "
            "target of L layers (target/aux.py)."
        ),
    )
    chat_template: str | None = key(
        None,
        flag="--chat-template",
        help=("A jinja file for a target without a chat template; null = the target's own."),
    )
    quantization: str | None = key(
        None,
        help=(
            "Quantize the target on load (bnb-4bit, bnb-8bit, quanto-int8, quanto-int4, torchao-int8); needs the "
            "matching optional extra. null = load as stored. See docs/teachers.md."
        ),
    )
    device_map: str | None = key(
        None,
        resume="free",
        flag="--device-map",
        help=(
            'Spread the target over devices with accelerate\'s big-model dispatch (target/devmap.py): "auto" or '
            '"balanced" (accelerate fills the GPUs, then host RAM, then disk), or a JSON file of module names to '
            'devices ({"model.layers.20": 1, "lm_head": "cpu"}; a GPU index, "cuda:1", "cpu" or "disk"). '
            "null = the whole target on `device`. The draft trains on `device`, which must hold the target's input "
            "embedding; aux states are gathered there."
        ),
    )
    max_memory: dict | None = key(
        None,
        resume="free",
        help=(
            "With device_map: the most of the target each device may hold, e.g. {0: 40GiB, cpu: 200GiB} (keys: a GPU "
            "index, cpu, disk), so the training device keeps room for the draft. null = accelerate's default (what each "
            "device has free)."
        ),
    )
    offload_folder: str | None = key(
        None,
        resume="free",
        help=(
            "Where disk-offloaded weights are written, in a temporary folder removed with the target; null = $TMPDIR. (A"
            " safetensors checkpoint's offloaded weights are read where they are.)"
        ),
    )
    wall_minutes: float = key(
        0.0,
        bounds=("a number >= 0 (0 = no budget)", lambda v: v >= 0),
        resume="free",
        flag="--minutes",
        help=(
            "Wall-clock budget of a whole `draftling quickstart` run, in minutes (0 = none): training stops early enough"
            " to leave room for the bench and the export, so a slower machine trains fewer steps instead of overrunning."
            " train.max_minutes still caps training alone."
        ),
    )
    data: DataConfig = key(factory=DataConfig, resume="free")
    vocab: VocabConfig = key(factory=VocabConfig)
    draft: DraftConfig = key(factory=DraftConfig)
    train: TrainConfig = key(factory=TrainConfig)
    bench: BenchConfig = key(factory=BenchConfig, resume="free")
    extract: ExtractConfig = key(factory=ExtractConfig, resume="free")

    def __post_init__(self):
        validate("", self)
        device_map_value(self.device_map)
        max_memory_bytes(self.max_memory)
        if self.max_memory is not None and self.device_map not in DEVICE_MAP_MODES:
            raise ConfigError(
                f"max_memory applies with device_map auto or balanced, not {self.device_map!r} "
                "(a FILE places every module itself)"
            )


BENCH_CHOICES = choices_of(BenchConfig)
# The storage dtypes `extract` writes the draft-vocab logits in (train/offline.py).
EXTRACT_CHOICES = choices_of(ExtractConfig)
