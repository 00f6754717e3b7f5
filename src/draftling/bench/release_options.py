"""What a release run (bench/release.py) is asked to measure and where it writes: the protocol's
defaults (config.py owns the values), ``ReleaseOptions``, and the run's folder and file stem."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from draftling.bench.manifest import code_commit, machine_slug, run_folder_name, tag_slug
from draftling.bench.simple import DecodeConfig, parse_decode_config
from draftling.config import AUTO, RELEASE_BASELINES, RELEASE_CONFIGS, RELEASE_SAMPLED_TEMPERATURES, BenchConfig
from draftling.engine import EngineOptions
from draftling.errors import ConfigError

BASELINES = RELEASE_BASELINES
_DEFAULTS = BenchConfig()  # the bench section's defaults: prompt set, new tokens, results folder
# What `bench --release` sets over a profile's simple-bench values (cli/bench.py passes these to
# load_config as the command's fixed choices; flags and KEY=VALUE overrides still win).
PROTOCOL_KEYS = {"bench.configs": list(RELEASE_CONFIGS), "bench.max_new_tokens": _DEFAULTS.max_new_tokens}

# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class ReleaseOptions:
    """What a release run measures and where it writes, checked when built.

    ``baselines``: any of BASELINES; engine_plain always runs (speedups need it), the others
    left out are null in the results, with a caveat. ``baseline_prompts_per_workload``: the
    HF baselines on the first N prompts of each workload only (they are slow); None = all.
    ``round_timing``: also measure the per-round phase split (``round_split_ms``) on the first
    ROUND_TIMING_PROMPTS (bench/release.py) prompts of each workload; "auto" = on CUDA.
    ``engine``: "auto" = the GPU settings on CUDA, plain eager on CPU; padding on (auto: to the largest config's draft
    tokens on CUDA) makes plain and verify passes share kernels, so a token's logits do not
    depend on the tree beside it, and plain decoding then also runs unpadded (auto: with the
    faster "matmul" attention on CUDA); speedups are against the faster of the two.
    ``command``: recorded in the results; None = this process's argv. Results of the same
    date, commit, machine and tag are refused before any work unless ``overwrite``."""

    prompt_set: str | Path = _DEFAULTS.prompt_set
    configs: tuple[str, ...] = RELEASE_CONFIGS
    max_new_tokens: int = _DEFAULTS.max_new_tokens
    baselines: tuple[str, ...] = BASELINES
    baseline_prompts_per_workload: int | None = None
    round_timing: bool | str = AUTO
    sampled_temperatures: tuple[float, ...] = RELEASE_SAMPLED_TEMPERATURES
    engine: EngineOptions = field(default_factory=EngineOptions.auto)
    out_dir: str | Path = _DEFAULTS.results_dir
    tag: str | None = None
    command: str | None = None
    overwrite: bool = False
    quiet: bool = False

    def __post_init__(self):
        object.__setattr__(self, "configs", _names(self.configs))
        object.__setattr__(self, "baselines", _names(self.baselines))
        if self.round_timing not in (AUTO, True, False):
            raise ConfigError(f"round_timing must be true, false or 'auto', got {self.round_timing!r}")
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise ConfigError(f"unknown baselines {unknown}; expected some of {', '.join(BASELINES)}")
        if not self.configs:
            raise ConfigError("the release bench needs at least one decode config")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.baseline_prompts_per_workload is not None and self.baseline_prompts_per_workload < 1:
            raise ConfigError("baseline_prompts_per_workload must be >= 1 (or None for all)")
        _ = self.decode_configs  # a bad config name fails here, before any work

    @property
    def decode_configs(self) -> list[DecodeConfig]:
        return [parse_decode_config(c) for c in self.configs]

    @property
    def hf_runs(self) -> list[str]:
        return [b for b in BASELINES if b in self.baselines and b != "engine_plain"]

    @classmethod
    def of(cls, options: ReleaseOptions | None = None, **fields) -> ReleaseOptions:
        """``options`` (default: the protocol) with ``fields`` replaced, EngineOptions' own
        (cuda_graphs, compile, query_pad, attention) going into ``engine``: where
        run_release_bench's keyword form becomes options."""
        options = options or cls()
        engine = {k: fields.pop(k) for k in _ENGINE_FIELDS if k in fields}
        if engine:
            fields["engine"] = EngineOptions.of(fields.get("engine", options.engine), **engine)
        return dataclasses.replace(options, **fields)

    @classmethod
    def from_config(cls, bench: BenchConfig, **fields) -> ReleaseOptions:
        """The options of a run config's bench section, with ``fields``."""
        engine = EngineOptions(
            cuda_graphs="auto", compile=bench.engine_compile, query_pad=bench.query_pad, attention=bench.attention
        )
        return cls(
            prompt_set=bench.prompt_set,
            configs=bench.configs,
            max_new_tokens=bench.max_new_tokens,
            baselines=bench.baselines,
            baseline_prompts_per_workload=bench.baseline_prompts_per_workload,
            round_timing=bench.round_timing,
            sampled_temperatures=tuple(bench.sampled_temperatures),
            engine=engine,
            out_dir=bench.results_dir,
            tag=bench.tag,
            **fields,
        )

    def record(self, engine: dict, round_timing: bool) -> dict:
        """These options resolved, as JSON values for a manifest (which has the command)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("command", "quiet")}
        return {
            **out,
            "prompt_set": str(self.prompt_set),
            "configs": list(self.configs),
            "baselines": list(self.baselines),
            "round_timing": round_timing,
            "engine": engine,
            "out_dir": str(self.out_dir),
        }


_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineOptions))


def _names(value) -> tuple[str, ...]:
    """Names from a comma string or a list (whose items may hold commas too)."""
    items = [value] if isinstance(value, str) else list(value)
    return tuple(n.strip() for item in items for n in str(item).split(",") if n.strip())


# ----------------------------------------------------------------------------- the run's folder


def release_stem(out_dir: str | Path, date: str, gpu: str, tag: str | None = None, commit: str | None = None) -> Path:
    """``<out_dir>/<date>-release-<commit>-<machine>[-<tag>]/<date>-<gpu>[-<tag>]``: the common
    stem of a run's output files, inside the run's folder (bench/manifest.py). ``commit``
    defaults to the running code's; the machine is ``gpu`` on a GPU, else this host's CPU."""
    folder = run_folder_name(date, "release", commit or code_commit(), machine_slug(gpu), tag)
    return Path(out_dir) / folder / (f"{date}-{gpu}-{tag_slug(tag)}" if tag else f"{date}-{gpu}")


def check_results_free(stem: Path, overwrite: bool) -> None:
    for d in (stem.parent.parent, stem.parent):
        if d.exists() and not d.is_dir():
            raise ConfigError(f"--results-dir {d}: is a file, not a directory")
    if stem.with_name(stem.name + ".json").exists() and not overwrite:
        raise ConfigError(
            f"{stem}.json: results of this date, machine and tag exist; pass --tag NAME to keep "
            "both, or --overwrite to replace them"
        )
