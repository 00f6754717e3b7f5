"""Release bench: results contract, reports, plots, BENCHMARKS.md section, prompt set v1, CLI.

Tiny random fp32 Llama on CPU, pre-tokenized prompts (no tokenizer or chat template needed).
"""

import json
import types
from pathlib import Path

import pytest

from draftling.bench import release, release_options
from draftling.config import RELEASE_CONFIGS
from draftling.data import prompt_sets
from draftling.errors import ConfigError, DataError
from tests.helpers import WORKLOADS, tiny_bench_target, tiny_draft_dir, token_prompt_set
from tests.helpers import ToyChatTokenizer as _ToyTokenizer

SHARED_PROMPTS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "prompts"
V1_WORKLOADS = ("prose", "code", "repetitive", "chat", "math", "summarize", "tool")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("release")
    target = tiny_bench_target()
    draft = tiny_draft_dir(target, tmp / "draft")
    ps = token_prompt_set(tmp / "set.jsonl")
    out = tmp / "results"
    results = release.run_release_bench(
        target,
        draft,
        prompt_set=ps,
        max_new_tokens=12,
        baselines=("engine_plain", "hf_eager"),
        baseline_prompts_per_workload=1,
        out_dir=out,
        tag="test",
        command="pytest",
        quiet=True,
    )
    stem = release_options.release_stem(out, results["date"], results["gpu"], "test")
    return types.SimpleNamespace(results=results, stem=stem, target=target, draft=draft, ps=ps, tmp=tmp)


def test_json_contract(bench_run):
    r = bench_run.results
    on_disk = json.loads(Path(f"{bench_run.stem}.json").read_text())
    assert on_disk == json.loads(json.dumps(r))
    assert set(on_disk) == {
        "date",
        "gpu",
        "engine",
        "target",
        "draft",
        "prompt_set",
        "baselines",
        "baseline_details",
        "configs",
        "sampled",
        "caveats",
        "command",
        "dtype",
    }
    # Sampled decoding at 0.7 and 1.0, per workload, for every config (lossless: rates only).
    assert list(r["sampled"]) == ["0.7", "1.0"]
    for configs in r["sampled"].values():
        assert list(configs) == [c["name"] for c in r["configs"]]
        for c in configs.values():
            assert set(c["per_workload"]) == set(WORKLOADS) and c["mean_speedup"] > 0
            assert all(1.0 <= v["tau"] <= 5.0 and v["tok_s"] > 0 for v in c["per_workload"].values())
    assert bench_run.stem.name == f"{r['date']}-cpu-test"
    assert r["gpu"] == "cpu" and r["dtype"] == "float32" and r["command"] == "pytest"
    assert set(r["baselines"]) == set(release_options.BASELINES) == set(r["baseline_details"])
    assert r["baselines"]["engine_plain"] > 0 and r["baselines"]["hf_eager"] > 0
    for skipped in ("hf_static", "hf_prompt_lookup"):
        assert r["baselines"][skipped] is None and r["baseline_details"][skipped] is None
        assert any(c.startswith(f"{skipped}: not run") for c in r["caveats"])
    d = r["baseline_details"]
    assert d["engine_plain"]["n"] == 6 and d["hf_eager"]["n"] == 3  # 1 per workload
    assert any("hf_eager: n = 3 prompts (1 per workload)" in c for c in r["caveats"])
    assert any("stopped naturally" in c for c in r["caveats"])
    # fp32 on CPU: HF's own greedy decode and the engine agree token for token.
    assert d["hf_eager"]["identical_to_engine_plain"] == 1.0

    assert [c["name"] for c in r["configs"]] == list(RELEASE_CONFIGS)
    keys = {
        "name",
        "steps",
        "topk",
        "draft_tokens",
        "per_workload",
        "mean_speedup",
        "mean_tau",
        "identical_fraction",
        "accept_rate_by_depth",
        "cost",
        "round_split_ms",
    }
    for c in r["configs"]:
        assert set(c) == keys
        assert c["round_split_ms"] is None  # measured on CUDA only unless asked for
        assert c["identical_fraction"] == 1.0
        assert set(c["per_workload"]) == set(WORKLOADS)
        for v in c["per_workload"].values():
            assert set(v) == {"tau", "tok_s", "speedup"}
            assert v["tau"] >= 1.0 and v["tok_s"] > 0 and v["speedup"] > 0
        assert len(c["accept_rate_by_depth"]) == c["steps"]
        assert all(0 <= a <= 1 for a in c["accept_rate_by_depth"])
        assert c["accept_rate_by_depth"] == sorted(c["accept_rate_by_depth"], reverse=True)
        cost = c["cost"]
        assert {"free_speedup", "drafting_share"} <= set(cost)
        assert cost["free_speedup"] == pytest.approx(c["mean_tau"] * cost["plain_step_ms"] / cost["verify_step_ms"])
        assert cost["drafting_share"] == pytest.approx(1 - c["mean_speedup"] / cost["free_speedup"])
    assert r["prompt_set"]["workloads"] == {w: 2 for w in WORKLOADS}


def test_markdown_and_plots(bench_run):
    md = Path(f"{bench_run.stem}.md").read_text()
    rows = [l for l in md.splitlines() if l.startswith("| ")]
    for w in WORKLOADS:
        row = next(l for l in rows if l.startswith(f"| {w} |"))
        assert row.count("x (") == len(RELEASE_CONFIGS)
    assert any(l.startswith("| **mean** |") for l in rows)
    for section in ("## Baselines", "## Acceptance rate by depth", "## Cost account", "## Caveats"):
        assert section in md
    assert "| hf_static | not run |" in md
    for suffix in ("-grid.png", "-tau-vs-speedup.png"):
        png = Path(f"{bench_run.stem}{suffix}")
        assert png.is_file() and png.stat().st_size > 1000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    per_prompt = Path(f"{bench_run.stem}-per-prompt.jsonl").read_text().splitlines()
    assert len(per_prompt) == 6


def test_update_benchmarks_md(bench_run, tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    js = Path(f"{bench_run.stem}.json")
    release.update_benchmarks_md(js, md)  # creates the file
    first = md.read_text()
    assert release.MARK_START in first and release.MARK_END in first and "x (" in first
    md.write_text(
        "# Benchmarks\n\nintro kept\n\n"
        + release.MARK_START
        + "\nstale table\n"
        + release.MARK_END
        + "\n\n## Older results\n\nkept too\n"
    )
    release.update_benchmarks_md(js, md)
    text = md.read_text()
    assert "stale table" not in text
    assert text.startswith("# Benchmarks\n\nintro kept\n\n")
    assert text.endswith("## Older results\n\nkept too\n")
    assert text.count(release.MARK_START) == 1 and text.count(release.MARK_END) == 1
    results = bench_run.results
    for needle in ("pytest", results["date"], "cpu", "n = 6", "chain-3-1-4", "| prose | 2 |"):
        assert needle in text
    # a file without markers gets the section appended
    other = tmp_path / "other.md"
    other.write_text("# Mine\n")
    release.update_benchmarks_md(js, other)
    assert other.read_text().startswith("# Mine\n") and release.MARK_END in other.read_text()


def test_run_folder_and_manifest(bench_run):
    from draftling.bench.manifest import code_commit, machine_slug

    r, folder = bench_run.results, bench_run.stem.parent
    assert folder.name == f"{r['date']}-release-{code_commit()}-{machine_slug('cpu')}-test"
    m = json.loads((folder / "manifest.json").read_text())
    assert {"commit", "command", "config", "machine", "date"} <= set(m)
    assert m["command"] == "pytest" and m["date"] == r["date"] and m["commit"] == code_commit()
    assert m["config"]["baselines"] == ["engine_plain", "hf_eager"] and m["config"]["engine"]["query_pad"] == 0
    assert m["files"] == sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
    # The same date, commit, machine and tag again: refused before any work.
    with pytest.raises(ConfigError, match="results of this date, machine and tag exist"):
        release.run_release_bench(
            bench_run.target, bench_run.draft, prompt_set=bench_run.ps, out_dir=folder.parent, tag="test", quiet=True
        )


def test_release_options_are_config_keys_checked_on_load():
    from draftling.config import load_config

    bench = load_config(
        None,
        [
            "bench.query_pad=8",
            "bench.engine_compile=off",
            "bench.baselines=[hf_eager]",
            "bench.sampled_temperatures=[]",
        ],
    ).bench
    opts = release_options.ReleaseOptions.from_config(bench, overwrite=True)
    assert opts.sampled_temperatures == ()
    assert release_options.ReleaseOptions.from_config(load_config(None, []).bench).sampled_temperatures == (0.7, 1.0)
    assert opts.engine.query_pad == 8 and opts.engine.compile is False and opts.engine.attention == "auto"
    assert opts.baselines == ("hf_eager",) and opts.hf_runs == ["hf_eager"] and opts.overwrite
    for bad, match in (
        ("bench.attention=fast", "bench.attention='fast'"),
        ("bench.engine_compile=maybe", "expected true/false"),
        ("bench.baselines=[hf_nope]", "unknown baselines"),
        ("bench.query_pad=-1", "bench.query_pad=-1"),
        ("bench.sampled_temperatures=[0]", "bench.sampled_temperatures="),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, [bad])


def test_all_four_baselines(bench_run, tmp_path):
    r = release.run_release_bench(
        bench_run.target,
        bench_run.draft,
        prompt_set=bench_run.ps,
        configs=["chain-2-1-3", "tree-2-2-4"],
        max_new_tokens=6,
        baseline_prompts_per_workload=1,
        out_dir=tmp_path,
        command="x",
        quiet=True,
        round_timing=True,
        sampled_temperatures=(),
    )
    assert all(r["baselines"][b] > 0 for b in release_options.BASELINES)
    assert r["sampled"] == {}  # greedy only: no sampled decodes ran
    for b in release_options.BASELINES[1:]:
        assert r["baseline_details"][b]["identical_to_engine_plain"] == 1.0
    assert not any("not run" in c for c in r["caveats"])
    # The per-round phase split (wall-clock marks on CPU), pooled over 2 prompts per workload.
    for c in r["configs"]:
        split = c["round_split_ms"]
        assert set(split) == {*release.ROUND_PHASES, "total", "rounds", "prompts"}
        assert split["prompts"] == 2 * len(WORKLOADS) and split["rounds"] >= split["prompts"]
        assert all(split[p] > 0 for p in release.ROUND_PHASES)
        assert split["total"] == pytest.approx(sum(split[p] for p in release.ROUND_PHASES))
    assert any(n.startswith("round split:") for n in r["caveats"])
    md = next(tmp_path.glob("*/*.md")).read_text()  # in the run's folder
    assert "## Round split" in md and "| tree-2-2-4 |" in md


def test_padded_engine_and_unpadded_reference(bench_run, tmp_path):
    """query_pad on: plain decoding runs padded (the identity reference) and unpadded; the
    speedup reference is the faster one, and both speeds are reported."""
    r = release.run_release_bench(
        bench_run.target,
        bench_run.draft,
        prompt_set=bench_run.ps,
        configs=["chain-2-1-3", "tree-2-2-4"],
        max_new_tokens=8,
        baselines=("engine_plain",),
        out_dir=tmp_path,
        command="x",
        quiet=True,
        query_pad=4,
        attention="exact",
    )
    plain = r["baseline_details"]["engine_plain"]
    assert plain["engine"]["query_pad"] == 4 and plain["engine"]["attention"] == "exact"
    assert plain["padded_tok_s"] > 0 and plain["unpadded_tok_s"] > 0
    faster = max(plain["padded_tok_s"], plain["unpadded_tok_s"])
    assert r["baselines"]["engine_plain"] == pytest.approx(faster)
    assert plain["speedup_reference"] == (
        "engine_plain_unpadded" if plain["unpadded_tok_s"] > plain["padded_tok_s"] else "engine_plain"
    )
    # fp32 on the CPU: padding changes no token.
    assert plain["unpadded_identical_to_padded"] == 1.0
    assert all(c["identical_fraction"] == 1.0 for c in r["configs"])
    assert any("padded to 4 queries with exact attention" in n for n in r["caveats"])
    with pytest.raises(ConfigError, match="query_pad 2 is below"):
        release.run_release_bench(
            bench_run.target,
            bench_run.draft,
            prompt_set=bench_run.ps,
            configs=["chain-2-1-3"],
            max_new_tokens=4,
            baselines=("engine_plain",),
            out_dir=tmp_path / "other",
            quiet=True,
            query_pad=2,
        )


def test_prompt_set_sources(tmp_path):
    p = tmp_path / "mine.jsonl"
    p.write_text(
        json.dumps({"id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]})
        + "\n"
        + json.dumps({"id": "b", "input_ids": [9, 10], "workload": "code"})
        + "\n"
    )
    info, prompts = release.load_prompt_set(p, tiny_bench_target())
    assert [(q.id, q.workload, q.input_ids) for q in prompts] == [("a", "default", [5, 6]), ("b", "code", [9, 10])]
    assert info["workloads"] == {"default": 1, "code": 1} and not info["builtin"]
    name, path = prompt_sets.resolve_prompt_set("v1")
    assert name == "v1" and path.is_file()
    assert prompt_sets.resolve_prompt_set("set:v1") == (name, path)
    assert "v1" in prompt_sets.builtin_prompt_sets()
    with pytest.raises(release.DataError):
        prompt_sets.resolve_prompt_set("v999")
    p.write_text(json.dumps({"id": "a", "input_ids": [1]}) + "\n" + json.dumps({"id": "a", "input_ids": [2]}) + "\n")
    with pytest.raises(release.DataError, match="duplicate"):
        release.read_prompt_set(p)


def test_shipped_prompt_sets_are_never_edited_in_place(tmp_path, monkeypatch):
    # Every shipped set matches its published hash (read_prompt_set checks it on each read) ...
    for name in prompt_sets.builtin_prompt_sets():
        assert release.read_prompt_set(name)[0]["sha256"] == prompt_sets.PUBLISHED_PROMPT_SETS[name]
    # ... and a copy of v1 with one character changed is refused by name.
    text = (prompt_sets.prompt_sets_dir() / "v1.jsonl").read_text(encoding="utf-8")
    (tmp_path / "v1.jsonl").write_text(text.replace("e", "E", 1), encoding="utf-8")
    from draftling.data import sources

    for module in (prompt_sets, sources):
        monkeypatch.setattr(module, "prompt_sets_dir", lambda: tmp_path)
    with pytest.raises(DataError, match="v1 .*edited in place"):
        release.read_prompt_set("v1")
    (tmp_path / "v9.jsonl").write_text(text, encoding="utf-8")
    with pytest.raises(DataError, match="v9 .*no published sha256"):
        release.read_prompt_set("v9")


def test_results_name_a_prompt_set_without_the_paths_a_run_read(tmp_path):
    """A shipped set by its name, a user's file by its file name; its hash identifies it, and
    no field holds the folder it was read from."""
    info, _ = release.read_prompt_set("v1")
    assert info["name"] == "v1" and str(prompt_sets.prompt_sets_dir()) not in json.dumps(info)
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    info, _ = release.read_prompt_set(str(f))
    assert info["name"] == "mine.jsonl" and not info["builtin"] and str(tmp_path) not in json.dumps(info)


def test_v1_prompt_set():
    info, records = release.read_prompt_set("v1")
    assert info["builtin"] and len(records) == 8 * len(V1_WORKLOADS)
    counts = {w: sum(r["workload"] == w for r in records) for w in V1_WORKLOADS}
    assert counts == {w: 8 for w in V1_WORKLOADS}
    ids = [r["id"] for r in records]
    assert len(set(ids)) == len(ids)
    for r in records:
        assert r["messages"] and r["source"] and r["messages"][-1]["role"] in ("user", "tool")
    assert all(r.get("tools") for r in records if r["workload"] == "tool")
    for r in records:
        if r["workload"] == "summarize":
            assert sum(len(m["content"]) for m in r["messages"]) <= 6000
    if not SHARED_PROMPTS.is_dir():
        pytest.skip("shared prompt corpus not present")
    shared = {}
    for f in SHARED_PROMPTS.glob("*.jsonl"):
        for line in f.read_text(encoding="utf-8").split("\n"):
            if not line.strip():
                continue
            rec = json.loads(line)
            shared[rec["id"]] = rec
    for r in records:
        assert r["id"] in shared, r["id"]
        orig = shared[r["id"]]
        assert r["source"] == orig["source"] and r["messages"] == orig["messages"]


def test_cli_release(bench_run, tmp_path, monkeypatch, capsys):
    from draftling import cli

    monkeypatch.setattr("draftling.target.load_target_from_config", lambda cfg: bench_run.target)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(
        [
            "bench",
            "--release",
            "--draft",
            str(bench_run.draft),
            "--prompt-set",
            str(bench_run.ps),
            "--configs",
            "chain-2-1-3",
            "--max-new-tokens",
            "5",
            "--baselines",
            "engine_plain",
            "--results-dir",
            "res",
            "--tag",
            "cli",
            "--update-benchmarks-md",
            "BENCHMARKS.md",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    assert rc == 0
    jsons = list((tmp_path / "res").glob("*/*-cpu-cli.json"))  # in the run's folder
    assert len(jsons) == 1
    r = json.loads(jsons[0].read_text())
    assert [c["name"] for c in r["configs"]] == ["chain-2-1-3"]
    assert r["baselines"]["hf_eager"] is None
    assert release.MARK_START in (tmp_path / "BENCHMARKS.md").read_text()
    # Without --results-dir the run's folder goes in the working directory.
    assert (
        cli.main(
            [
                "bench",
                "--release",
                "--draft",
                str(bench_run.draft),
                "--prompt-set",
                str(bench_run.ps),
                "--configs",
                "chain-2-1-3",
                "--max-new-tokens",
                "5",
                "--baselines",
                "engine_plain",
                "--tag",
                "here",
                "--device",
                "cpu",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    assert len(list(tmp_path.glob("*-release-*-here/*-cpu-here.json"))) == 1
    with pytest.raises(SystemExit):  # the markdown file to update is named, never assumed
        cli.main(["bench", "--release", "--draft", str(bench_run.draft), "--update-benchmarks-md"])

    capsys.readouterr()
    assert cli.main(["bench", "--draft", str(bench_run.draft)]) == 2
    assert "--prompts" in capsys.readouterr().err
    assert cli.main(["bench", "--draft", "d", "--prompts", "p.jsonl", "--prompt-set", "v1"]) == 2
    assert "only apply with --release" in capsys.readouterr().err
    assert cli.main(["bench", "--release", "--draft", "d", "--out", "x.json"]) == 2
    assert "--out" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "bench",
                "--release",
                "--draft",
                str(bench_run.draft),
                "--prompt-set",
                str(bench_run.ps),
                "--baselines",
                "hf_nope",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    assert "unknown baselines" in capsys.readouterr().err


def test_message_records_and_dropped_tools(tmp_path):
    p = tmp_path / "msgs.jsonl"
    p.write_text(
        json.dumps(
            {
                "id": "t1",
                "source": "s",
                "workload": "tool",
                "tools": [{"name": "f"}],
                "messages": [{"role": "user", "content": "call f"}],
            }
        )
        + "\n"
        + json.dumps(
            {"id": "c1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "dropped"}]}
        )
        + "\n"
    )
    target = tiny_bench_target()
    target.tokenizer = _ToyTokenizer()
    info, prompts = release.load_prompt_set(p, target)
    assert [q.workload for q in prompts] == ["tool", "default"]
    text = "user: hi\nassistant:"  # trailing assistant turn dropped, generation prompt added
    assert prompts[1].input_ids == _ToyTokenizer()(text)["input_ids"]
    assert len(info["notes"]) == 1 and "ignores `tools`" in info["notes"][0]


def test_results_name_a_changed_checkout_dirty(tmp_path):
    """A run from a checkout whose tracked files differ from its commit does not claim that
    commit: "-dirty" is added. An untracked file does not count; outside a checkout: "unknown"."""
    import subprocess

    from draftling.bench.manifest import commit_of

    package = tmp_path / "repo" / "src" / "draftling"
    package.mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    assert commit_of(package) == "unknown"

    def git(*args):
        subprocess.run(
            ["git", "-C", str(tmp_path / "repo"), "-c", "user.name=t", "-c", "user.email=t@t", *args],
            check=True,
            capture_output=True,
        )

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "one")
    head = subprocess.run(
        ["git", "-C", str(package), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    (package / "new.py").write_text("")  # untracked
    assert commit_of(package) == head
    (package / "a.py").write_text("x = 2\n")
    assert commit_of(package) == f"{head}-dirty"
