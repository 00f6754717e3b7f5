"""The starter corpus shipped in the package: the default path needs nothing else."""

import hashlib
import json

import pytest

from draftling.config import load_config
from draftling.data.prompts import load_conversations
from draftling.data.sources import check_prompt_files, resolve_prompt_path, starter_dir, starter_names
from draftling.errors import ConfigError

# Sources whose data license allows redistribution (ATTRIBUTION.md beside the files).
LICENSED = {"chat": {"oasst", "self-instruct"}, "code": {"mbpp"}, "math": {"gsm8k-train"}}


def test_starter_sets_ship_with_their_licenses_and_published_hashes():
    assert starter_names() == sorted(LICENSED)
    attribution = (starter_dir() / "ATTRIBUTION.md").read_text()
    total = 0
    for name, sources in LICENSED.items():
        path = resolve_prompt_path(f"starter:{name}")
        convs = load_conversations(path)
        assert {c.source for c in convs} == sources, name
        assert len({c.id for c in convs}) == len(convs), f"{name}: duplicate ids"
        assert all(c.messages[-1]["role"] == "user" for c in convs)
        assert hashlib.sha256(path.read_bytes()).hexdigest() in attribution, f"{name}: hash not published"
        total += path.stat().st_size
    assert total < 3e6  # a few MB at most


def test_starter_prompts_stay_out_of_the_release_bench():
    def users(convs):
        return {m["content"].strip() for c in convs for m in c.messages if m["role"] == "user"}

    bench = users(load_conversations(resolve_prompt_path("set:v1")))
    for name in LICENSED:
        assert not users(load_conversations(resolve_prompt_path(f"starter:{name}"))) & bench, name


def test_an_unknown_starter_name_lists_the_shipped_ones():
    with pytest.raises(ConfigError) as e:
        resolve_prompt_path("starter:poetry")
    assert "starter:poetry" in str(e.value)
    for name in LICENSED:
        assert f"starter:{name}" in str(e.value)


def test_the_quickstart_profile_needs_no_shared_corpus(monkeypatch, tmp_path):
    from draftling.data import sources

    monkeypatch.setattr(sources, "find_shared_prompts", lambda: None)
    monkeypatch.chdir(tmp_path)
    cfg = load_config("quickstart_cpu")
    check_prompt_files(cfg)  # raises if any spec needs ../shared
    with pytest.raises(ConfigError, match="starter:chat"):
        resolve_prompt_path("shared:sharegpt.jsonl")  # the error points at what ships


def test_prepare_samples_every_starter_file_with_a_task_disjoint_split():
    from draftling.data.prepare import load_prompt_files
    from draftling.data.split import split_by_task

    cfg = load_config("quickstart_cpu")
    pool = []
    convs, _ = load_prompt_files(cfg, pool)
    cap = cfg.data.max_prompts_per_file
    assert len(convs) == len(cfg.data.prompts) * cap and len(pool) > len(convs)
    train, val = split_by_task(convs, cfg.data.val_fraction, seed=cfg.data.seed, key=cfg.data.split_key)
    assert not {c.id for c in train} & {c.id for c in val}
    assert {c.category for c in val} >= {"code", "math"}
    assert json.dumps([c.id for c in val])  # ids are plain strings
