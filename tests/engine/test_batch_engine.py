"""Batched engine: each request of a ragged batch decodes exactly as it would alone.

The reference is the batch-1 engine (itself checked against HF in test_engine.py): plain and
speculative (chain and trees), greedy, with prompts of different lengths that finish at
different steps and more requests than slots, so finished slots are refilled mid-run. Sampled
decoding keeps the target's law per request (the batch-1 chi-square test).
"""

import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftling.engine import process_logits
from draftling.engine.generate import batch_generate
from tests.helpers import AUX, LENGTHS, SLOTS, TREES, oracle_draft, perm_target, random_draft, sampling_target, tiny
from tests.helpers import batch_engines as engines
from tests.helpers import batch_prompts as prompts
from tests.helpers import chi2_p_value as _chi2_p_value
from tests.helpers import decode_alone as alone

pytestmark = pytest.mark.usefixtures("one_thread")


def test_batched_plain_greedy_equals_alone():
    model = tiny(LlamaForCausalLM, LlamaConfig)
    ps = prompts()
    budgets = [30, 4, 17, 30, 1, 23, 9]  # ragged: slots free at different steps
    want = alone(model, ps, budgets)
    target, _ = engines(model)
    got = batch_generate(target, ps, budgets)
    assert [r.tokens for r in got] == want
    assert all(r.stats.verify_steps == 0 and r.stats.tokens == len(r.tokens) for r in got)
    # An eos inside some replies ends those early; the others run to the budget.
    eos = want[0][12]
    want_eos = alone(model, ps, budgets, eos=eos)
    assert any(len(w) < m for w, m in zip(want_eos, budgets))
    assert [r.tokens for r in batch_generate(target, ps, budgets, eos_ids=eos)] == want_eos


@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_batched_speculative_equals_alone(kind):
    model = perm_target() if kind == "oracle" else tiny(LlamaForCausalLM, LlamaConfig)
    draft = oracle_draft(model) if kind == "oracle" else random_draft(model)
    ps = prompts()
    budgets = [40, 6, 25, 40, 2, 33, 11]
    want = alone(model, ps, budgets)
    eos = want[3][20]
    want_eos = alone(model, ps, budgets, eos=eos)
    target, runner = engines(model, draft)
    for tree in TREES:
        got = batch_generate(target, ps, budgets, draft=runner, tree=tree)
        assert [r.tokens for r in got] == want, tree
        lengths = [a for r in got for a in r.stats.accept_lengths]
        assert all(1 <= a <= tree[0] + 1 for a in lengths)
        if kind == "oracle":
            assert sum(lengths) / len(lengths) > 2.0, tree  # long paths really accepted
        got = batch_generate(target, ps, budgets, draft=runner, tree=tree, eos_ids=eos)
        assert [r.tokens for r in got] == want_eos, tree


def test_batched_engine_survives_graph_capture(as_captured):
    """As under CUDA graphs (every function's first call runs three times): batched plain and
    speculative decoding still equal each request alone."""
    model = tiny(LlamaForCausalLM, LlamaConfig)
    ps, budgets = prompts(), [30, 4, 17, 30, 1, 23, 9]
    want = alone(model, ps, budgets)
    target, runner = engines(model, random_draft(model))
    assert [r.tokens for r in batch_generate(target, ps, budgets)] == want
    for tree in TREES:
        assert [r.tokens for r in batch_generate(target, ps, budgets, draft=runner, tree=tree)] == want, tree


def test_batched_sampling_matches_target_distribution():
    """Plain and speculative sampling in a batch of 4: joint law of the first two tokens of
    each request against exact target probabilities (as test_engine's batch-1 test)."""
    vocab, n = 16, 1200
    kw = dict(temperature=1.3, top_k=12, top_p=0.95)
    model = sampling_target(vocab)
    draft = oracle_draft(model, draft_vocab=12, seed=3)
    ids = torch.randint(0, vocab, (5,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        p1 = process_logits(model(ids[None]).logits[0, -1], **kw)
        s2 = torch.cat([ids[None].expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        joint = (p1[:, None] * process_logits(model(s2).logits[:, -1], **kw)).flatten()
    target, runner = engines(model, draft, slots=4, size=24)
    for spec in (None, (2, 3, 5)):
        out = batch_generate(
            target,
            [ids] * n,
            2,
            draft=runner if spec else None,
            tree=spec,
            generator=torch.Generator().manual_seed(0),
            **kw,
        )
        counts = torch.zeros(vocab * vocab, dtype=torch.long)
        for r in out:
            a, b = r.tokens
            counts[a * vocab + b] += 1
        assert _chi2_p_value(counts, joint) > 1e-3, spec


def test_batch_engine_refuses_what_does_not_fit():
    model = tiny(LlamaForCausalLM, LlamaConfig)
    target, _ = engines(model, size=32)
    with pytest.raises(Exception, match="prompt 2 .*do not fit"):
        batch_generate(target, prompts([3, 4, 40]), 8)


def test_concurrency_sweep_contract(tmp_path):
    """The sweep's results contract, on a tiny target: every level and config (the adaptive
    engine too), greedy identity with plain decoding at each level, and the summary's best
    config per level and the adaptive engine's lowest speedup."""
    from draftling.bench.concurrency import SweepOptions, run_concurrency_sweep, summarize
    from tests.helpers import tiny_bench_target, tiny_draft_dir, token_prompt_set

    target = tiny_bench_target()
    draft = tiny_draft_dir(target, tmp_path / "draft")
    ps = token_prompt_set(tmp_path / "set.jsonl")
    opts = SweepOptions(
        levels=(1, 3),
        configs=("chain-3-1-4", "tree-3-4-8"),
        prompt_set=str(ps),
        max_new_tokens=10,
        min_requests=4,
        out_dir=tmp_path / "out",
        command="pytest",
    )
    lines: list[str] = []
    res = run_concurrency_sweep(target, draft, opts, log=lines.append)
    for key in ("date", "gpu", "target", "draft", "batch1_plain_tok_s", "concurrency_sweep", "adaptive_min_speedup"):
        assert key in res
    rows = res["concurrency_sweep"]
    assert [(r["concurrency"], r["config"]) for r in rows] == [
        (c, n) for c in (1, 3) for n in ("plain", "chain-3-1-4", "tree-3-4-8", "adaptive")
    ]
    assert [r["requests"] for r in rows] == [4] * 4 + [6] * 4  # max(4, 2 x level)
    adaptive = [r for r in rows if r["config"] == "adaptive"]
    assert res["adaptive_min_speedup"] == min(r["speedup"] for r in adaptive)
    for r in adaptive:
        assert r["identical_fraction"] == 1.0 and sum(r["policy"]["groups_by_choice"].values()) > 0
    level_lines = [line for line in lines if "concurrency " in line]
    assert len(level_lines) == 2 and all("adaptive" in line and "[groups: " in line for line in level_lines)
    for r in rows:
        assert r["aggregate_tok_s"] > 0 and r["per_stream_tok_s"] == r["aggregate_tok_s"] / r["concurrency"]
        if r["config"] not in ("plain", "adaptive"):
            assert r["identical_fraction"] == 1.0 and 1.0 <= r["tau"] <= 4.0
            assert r["cost"]["verify_q"] in (4, 8) and r["cost"]["free_speedup"] > 0
    folder = next((tmp_path / "out").iterdir())
    assert folder.name.startswith(res["date"] + "-concurrency-")
    assert {"concurrency.json", "manifest.json"} <= {p.name for p in folder.iterdir()}
    # The crossover: the lowest level from which plain wins at every level.
    fake = [
        {"concurrency": c, "config": n, "aggregate_tok_s": v}
        for c, n, v in [(1, "plain", 1), (1, "a", 2), (2, "plain", 3), (2, "a", 2), (4, "plain", 5), (4, "a", 4)]
    ]
    assert summarize(fake) == {
        "best_config_per_level": {"1": "a", "2": "plain", "4": "plain"},
        "crossover_concurrency": 2,
        "adaptive_min_speedup": None,
        "adaptive_min_full_batch_speedup": None,
    }
    # Every run filled its batch at first (requests >= rows): its full-batch stretch is measured.
    assert all(r["full_batch_tok_s"] > 0 for r in rows)
    full = [r["full_batch_speedup"] for r in adaptive]
    assert res["adaptive_min_full_batch_speedup"] == min(full)


def test_the_full_batch_stretch_ends_when_a_row_first_finds_no_request():
    """Four rows and equal budgets: all requests end together, so the stretch is the whole run
    after the first tokens; ragged budgets end it early; fewer requests than rows leave none."""
    model = tiny(LlamaForCausalLM, LlamaConfig)
    target, _ = engines(model, slots=4)
    ps = prompts()
    even = batch_generate(target, ps[:4], 12)
    seconds, tokens = even[0].stats.full_batch
    assert seconds > 0 and tokens == 4 * 12 - 4 and all(r.stats.full_batch == (seconds, tokens) for r in even)
    ragged = batch_generate(target, ps, [30, 4, 17, 30, 1, 23, 9])
    _, tokens = ragged[0].stats.full_batch
    # The stretch ends once the 7th request is in and a row frees: before the 30-token ones end.
    assert 0 < tokens < sum(len(r.tokens) for r in ragged) - 7
    assert batch_generate(target, ps[:3], 12)[0].stats.full_batch is None


def test_regeneration_through_the_engine_equals_hf_greedy(tmp_path):
    """`draftling data`'s replies through the batched plain engine equal HF generate's greedy
    replies token for token (fp32, CPU), eos cuts included; data.regen.engine decides."""
    import dataclasses

    from draftling.config import DataConfig, RegenConfig
    from draftling.data.prompts import Conversation
    from draftling.data.regen import regenerate
    from draftling.engine.replies import reply_engine_for
    from draftling.errors import ConfigError
    from tests.helpers import tiny_bench_target

    target = tiny_bench_target()
    target.tokenizer = _ToyTokenizer()
    convs = [
        Conversation(id=f"c{i}", source="t", category="chat", messages=[{"role": "user", "content": "x" * n}])
        for i, n in enumerate((3, 9, 5, 14, 7, 11, 4))
    ]
    cfg = RegenConfig(max_new_tokens=24, batch_size=3)
    first = next(iter(regenerate(target, convs, cfg, progress=False)))
    target.tokenizer.eos_token_id = int(first["messages"][-1]["content"].split()[10])  # ends some replies early
    hf = {r["id"]: r for r in regenerate(target, convs, cfg, progress=False)}
    assert any(r["provenance"]["stopped"] == "eos" for r in hf.values())  # the eos cut is exercised
    dc = DataConfig(regen=dataclasses.replace(cfg, engine="on"))
    replies = reply_engine_for(dc, target)
    got = {r["id"]: r for r in regenerate(target, convs, cfg, progress=False, replies=replies)}
    assert got == hf
    assert reply_engine_for(DataConfig(regen=cfg), target) is None  # auto: HF generate off CUDA
    with pytest.raises(ConfigError, match="kept teacher states"):
        reply_engine_for(DataConfig(regen=dataclasses.replace(cfg, engine="on"), keep_teacher_states=True), target)


def test_sampled_regeneration_through_the_engine_is_seeded_and_processed():
    """Sampled replies through the batched engine: the same seed gives the same replies, another
    seed others; a top_p that keeps only the likeliest token gives the greedy replies (the
    processed law is sampled, not the raw logits)."""
    from draftling.config import DataConfig, RegenConfig
    from draftling.data.prompts import Conversation
    from draftling.data.regen import regenerate
    from draftling.engine.replies import reply_engine_for
    from tests.helpers import tiny_bench_target

    target = tiny_bench_target()
    target.tokenizer = _ToyTokenizer()
    convs = [
        Conversation(id=f"c{i}", source="t", category="chat", messages=[{"role": "user", "content": "x" * n}])
        for i, n in enumerate((3, 9, 5, 14, 7, 11, 4))
    ]

    def texts(**fields):
        cfg = RegenConfig(max_new_tokens=16, batch_size=3, engine="on", **fields)
        replies = reply_engine_for(DataConfig(regen=cfg), target)
        return [r["messages"][-1]["content"] for r in regenerate(target, convs, cfg, progress=False, replies=replies)]

    greedy, sampled = texts(), texts(temperature=1.0)
    assert sampled == texts(temperature=1.0)
    assert sampled != greedy and sampled != texts(temperature=1.0, seed=7)
    assert texts(temperature=1.0, top_p=1e-6) == greedy


class _ToyTokenizer:
    """Characters as token ids 3.. (a tiny target needs no real tokenizer); eos is 2."""

    pad_token_id, eos_token_id, chat_template = 0, 2, "toy"

    def get_vocab(self):
        return {}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kw):
        return "".join(m["content"] for m in messages) + ("|" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + (ord(c) * 7) % 290 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_concurrency_levels_are_checked_when_the_config_loads():
    from draftling.config import load_config
    from draftling.errors import ConfigError

    assert load_config(None, ["bench.concurrency=[1, 2, 64]"]).bench.concurrency == [1, 2, 64]
    for bad in ("[0, 2]", "[]", "[1.5]"):
        with pytest.raises(ConfigError, match="bench.concurrency"):
            load_config(None, [f"bench.concurrency={bad}"])


def test_prefills_are_grouped_under_the_score_budget(monkeypatch):
    """Long prompts are prefilled a few rows at a time (their scores are materialised); the
    tokens are those of one prefill for all, which equal each request decoded alone."""
    from draftling.engine import generate as gen

    model = tiny(LlamaForCausalLM, LlamaConfig)
    ps, budgets = prompts(), [6] * len(LENGTHS)
    want = alone(model, ps, budgets)
    groups = []
    real = gen._Run._prefill
    monkeypatch.setattr(
        gen._Run, "_prefill", lambda self, rows, reqs: (groups.append(len(reqs)), real(self, rows, reqs))[1]
    )
    heads = model.config.num_attention_heads
    monkeypatch.setattr(gen, "PREFILL_SCORES", 2 * heads * 11**2)  # two rows of up to 11 tokens
    target, _ = engines(model, slots=SLOTS)
    assert [r.tokens for r in batch_generate(target, ps, budgets)] == want
    assert max(groups) == 2 and groups.count(1) >= 1  # the 20-token prompt alone, never three at once


@pytest.mark.slow  # CPU compiles
def test_compiled_rows_equal_eager_at_two_row_counts():
    """Several rows compile with dynamic shapes (engine.target_model.compile_once): plain at 2
    and 3 rows (the second count reuses the dynamic graphs), speculative at 3, the compiled
    engine's tokens equal each request alone."""
    from draftling.engine import CachedTarget, DraftRunner
    from tests.helpers import AUX

    model = perm_target()
    draft = oracle_draft(model)
    ps, budgets = prompts(), [12, 5, 9, 12, 3, 7, 10]
    want = alone(model, ps, budgets)
    for rows in (2, 3):
        target = CachedTarget.from_hf(model, AUX, 160, batch_size=rows, compile=True)
        runner = DraftRunner(draft, model.get_input_embeddings(), 160, batch_size=rows, compile=True)
        assert [r.tokens for r in batch_generate(target, ps, budgets)] == want
    got = batch_generate(target, ps, budgets, draft=runner, tree=TREES[1])
    assert [r.tokens for r in got] == want


def test_a_group_queues_steps_for_the_row_that_needs_the_most(monkeypatch):
    """Plain greedy: one host read per group of up to RUN_AHEAD steps, sized by the row that
    needs the most tokens; a row that ends inside the group drops the rest, its tokens exact."""
    from draftling.engine import generate as gen

    model = tiny(LlamaForCausalLM, LlamaConfig)
    ps, budgets = prompts()[:2], [2, 30]
    want = alone(model, ps, budgets)
    reads = []
    real = gen._Run._emit_rows
    monkeypatch.setattr(gen._Run, "_emit_rows", lambda self, tokens: (reads.append(len(tokens[0])), real(self, tokens)))
    target, _ = engines(model, slots=2)
    assert [r.tokens for r in batch_generate(target, ps, budgets)] == want
    assert reads == [8, 8, 8, 5]  # 29 tokens after the prefill's first one: not 1 step while row 0 ends


def test_a_block_drafter_runs_the_sweep_and_the_release_bench(tmp_path):
    """A dflash head through the batched engine's benches: its block chain, the release trees
    no deeper than its block and the adaptive engine at each level, and the release bench, all
    identical to plain decoding."""
    from draftling.bench import release
    from draftling.bench.concurrency import SweepOptions, run_concurrency_sweep
    from tests.helpers import tiny_bench_target, tiny_draft_dir, token_prompt_set

    target = tiny_bench_target()
    draft = tiny_draft_dir(target, tmp_path / "draft", method="dflash")
    ps = token_prompt_set(tmp_path / "set.jsonl")
    opts = SweepOptions(levels=(1, 3), prompt_set=str(ps), max_new_tokens=10, min_requests=4, out_dir=tmp_path / "out")
    rows = run_concurrency_sweep(target, draft, opts, log=lambda _: None)["concurrency_sweep"]
    assert [(r["concurrency"], r["config"]) for r in rows] == [
        (c, n) for c in (1, 3) for n in ("plain", "block-4", "tree-3-4-8", "adaptive")
    ]  # the release configs' trees no deeper than the block join its chain
    assert all(r["identical_fraction"] == 1.0 for r in rows if r["config"] != "plain")
    res = release.run_release_bench(
        target, draft, prompt_set=ps, max_new_tokens=12, out_dir=tmp_path / "rel", tag="t", quiet=True
    )
    assert [c["name"] for c in res["configs"]] == ["block-4", "tree-3-4-8"]
    assert all(c["identical_fraction"] == 1.0 for c in res["configs"])


def test_free_rows_wait_for_the_next_finish_only_when_that_costs_less_than_a_prefill():
    """The fixed part of an admission is the intercept of its measured (requests, ms): large
    where a prefill costs the same for 1 or 16 requests (launch-bound), none where it grows
    with them. Free rows wait for the next busy row to finish while their share of the time
    until then is below it; all rows free admit at once."""
    from draftling.engine.generate import Admissions

    gpu_like = Admissions()
    for k, ms in [(16, 20.0), (1, 18.5), (1, 18.5), (3, 18.8)]:
        gpu_like.record(k, ms)
    assert 18.0 < gpu_like.fixed_ms() <= 18.5
    assert not gpu_like.due(1, 16, 50.0)  # 1/16 of the batch idle for 50 ms: 3 ms lost
    assert gpu_like.due(1, 2, 50.0)  # half of it: 25 ms lost, more than a prefill
    assert gpu_like.due(4, 16, 80.0) and gpu_like.due(16, 16, 1e9)
    assert gpu_like.waits == 1
    cpu_like = Admissions()
    for k, ms in [(4, 80.0), (1, 20.0)]:
        cpu_like.record(k, ms)
    assert cpu_like.fixed_ms() == 0.0 and cpu_like.due(1, 4, 1e9)
    one_size = Admissions()
    one_size.record(1, 50.0)
    assert one_size.fixed_ms() == 0.0  # no line through one size: admit at once


@pytest.mark.parametrize("defer", [True, False])
def test_deferred_admissions_keep_every_request_exact(monkeypatch, defer):
    """With a fixed admission cost no waiting outweighs, free rows wait until every row is
    free: fewer, larger prefills, and every request's tokens those it decodes alone."""
    from draftling.engine import generate as gen

    monkeypatch.setattr(gen.Admissions, "fixed_ms", lambda self: 1e9)
    model = perm_target()
    ps, budgets = prompts(), [40, 6, 25, 40, 2, 33, 11]
    want = alone(model, ps, budgets)
    target, runner = engines(model, oracle_draft(model))
    sizes = []
    real = gen._Run._prefill
    monkeypatch.setattr(
        gen._Run, "_prefill", lambda self, rows, reqs: (sizes.append(len(reqs)), real(self, rows, reqs))[1]
    )
    for tree in (None, TREES[1]):
        sizes.clear()
        got = batch_generate(target, ps, budgets, draft=runner, tree=tree, defer_admissions=defer)
        assert [r.tokens for r in got] == want, tree
        # Waiting, the three rows refill only together: 3 + 3 + 1 requests in three prefills.
        assert (sizes == [3, 3, 1]) == defer, (tree, sizes)


def test_sampled_decoding_admits_at_once_so_a_seed_repeats(monkeypatch):
    """Sampled rows draw from one generator in row order, so a request's draws depend on the
    step it starts at: deferral would tie a seeded run's tokens to timing. Even with waiting
    forced, sampling admits as soon as a row frees, and the tokens equal deferral's off."""
    from draftling.engine import generate as gen

    monkeypatch.setattr(gen.Admissions, "fixed_ms", lambda self: 1e9)
    model = tiny(LlamaForCausalLM, LlamaConfig)
    ps, budgets = prompts(), [12, 3, 9, 12, 2, 7, 5]
    target, _ = engines(model)
    sizes = []
    real = gen._Run._prefill
    monkeypatch.setattr(
        gen._Run, "_prefill", lambda self, rows, reqs: (sizes.append(len(reqs)), real(self, rows, reqs))[1]
    )

    def run(defer):
        g = torch.Generator().manual_seed(3)
        out = batch_generate(target, ps, budgets, temperature=1.0, generator=g, defer_admissions=defer)
        return [r.tokens for r in out]

    assert run(True) == run(False)
    seen = {}
    for defer in (True, False):
        sizes.clear()
        run(defer)
        seen[defer] = list(sizes)
    assert seen[True] == seen[False] and len(seen[True]) > 3  # rows refilled as they free, never held


def _prefill_case(**engine):
    """The admissions tests' requests with the batch-1 engine's tokens for them, and a batched
    engine (target, draft runner) built with ``engine`` options."""
    from draftling.engine.draft_runner import DraftRunner
    from draftling.engine.target_model import CachedTarget

    model = perm_target()
    draft = oracle_draft(model)
    ps, budgets = prompts(), [40, 6, 25, 40, 2, 33, 11]
    target = CachedTarget.from_hf(model, AUX, 160, batch_size=SLOTS, **engine)
    runner = DraftRunner(draft, model.get_input_embeddings(), 160, batch_size=SLOTS, **engine)
    return model, draft, ps, budgets, alone(model, ps, budgets), target, runner


def test_compiled_prefill_admits_every_request_as_the_eager_one_does(monkeypatch):
    """``compile_prefill``: the target's and the draft's prefill run through layer halves
    compiled for any shape. Admissions of one prompt and of several, of every length, give each
    request the tokens the eager prefill gives it, plain and speculative, and the prefill's
    logits and the draft's proposal match the eager ones. Traced by dynamo with its dynamic
    shapes but compiled by aot_eager, not inductor: inductor's CPU kernels would add most of a
    minute to the suite, and the GPU runs them (lab/gpu/prefill_ab.py)."""
    from draftling.engine import generate as gen
    from draftling.engine import target_model
    from draftling.engine.draft_runner import draft_outputs
    from draftling.engine.target_model import attention_inputs

    compiled: dict = {}
    monkeypatch.setattr(target_model, "_COMPILED", compiled)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))

    model, draft, ps, budgets, want, target, runner = _prefill_case(compile_prefill=True)
    sizes = []
    real = gen._Run._prefill
    monkeypatch.setattr(
        gen._Run, "_prefill", lambda self, rows, reqs: (sizes.append(len(reqs)), real(self, rows, reqs))[1]
    )
    for tree in (None, TREES[1]):
        got = batch_generate(target, ps, budgets, draft=runner, tree=tree)
        assert [r.tokens for r in got] == want, tree
    assert 1 in sizes and max(sizes) > 1  # both compiled graphs served
    assert (attention_inputs, True) in compiled and (draft_outputs, True) in compiled  # they ran compiled
    eager, eager_runner = engines(model, draft)
    ids = torch.nn.utils.rnn.pad_sequence(ps[:3], batch_first=True)
    lengths, rows = torch.tensor([len(p) for p in ps[:3]]), torch.tensor([0, 2, 1])
    for a, b in zip(target.prefill_rows(rows, ids, lengths), eager.prefill_rows(rows, ids, lengths)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    t = ids.shape[1]  # the slots the prefill wrote (the rest hold the runs before)
    torch.testing.assert_close(target.k_all[..., :t, :], eager.k_all[..., :t, :], rtol=1e-4, atol=1e-4)
    aux = eager.prefill_rows(rows, ids, lengths)[1]
    for a, b in zip(runner.extend_rows(rows, ids, aux, lengths), eager_runner.extend_rows(rows, ids, aux, lengths)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_padded_prefill_admits_every_request_as_the_unpadded_one_does():
    """``prefill_graphs``: admissions' prefills padded to powers of two of prompts (the last
    repeated into its own row) and of tokens, the shape a CUDA graph replays (on the CPU the
    padding runs alone). Each request gets the tokens the unpadded prefill gives it, plain and
    speculative; the prefill's logits, aux, written K/V and the draft's proposal match; a prompt
    past the bounds prefills unpadded."""
    from draftling.engine.target_model import PREFILL_GRAPH_LEN, padded_prefill

    model, draft, ps, budgets, want, target, runner = _prefill_case(prefill_graphs=True)
    shapes = []
    for fn in (target._prefill_fn, runner._extend_rows_fn):
        fn.fn = lambda *a, real=fn.fn: (shapes.append(tuple(a[1].shape[:2])), real(*a))[1]
    for tree in (None, TREES[1]):
        got = batch_generate(target, ps, budgets, draft=runner, tree=tree)
        assert [r.tokens for r in got] == want, tree
    assert shapes and all(g & (g - 1) == 0 and t >= 16 and t & (t - 1) == 0 for g, t in shapes)
    eager, eager_runner = engines(model, draft)
    ids = torch.nn.utils.rnn.pad_sequence(ps[:3], batch_first=True)
    lengths, rows = torch.tensor([len(p) for p in ps[:3]]), torch.tensor([0, 2, 1])
    shapes.clear()
    got, ref = target.prefill_rows(rows, ids, lengths), eager.prefill_rows(rows, ids, lengths)
    assert shapes == [(4, max(16, 1 << (ids.shape[1] - 1).bit_length()))]  # 3 prompts ran as 4
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    t = ids.shape[1]
    torch.testing.assert_close(target.k_all[..., :t, :], eager.k_all[..., :t, :], rtol=1e-5, atol=1e-5)
    for a, b in zip(
        runner.extend_rows(rows, ids, ref[1], lengths), eager_runner.extend_rows(rows, ids, ref[1], lengths)
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    long = torch.zeros(1, PREFILL_GRAPH_LEN + 1, dtype=torch.long)
    assert padded_prefill(None, rows[:1], lengths[:1], long, max_len=4096) is None
    assert padded_prefill(None, rows[:1], lengths[:1], ids[:1], max_len=8) is None  # past the cache


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphed_prefill_admits_every_request_as_the_eager_one_does():
    """On CUDA, ``prefill_graphs`` replays admissions' prefills as graphs per padded shape: each
    request gets the eager engine's tokens, plain and speculative, and graphs were captured."""
    from draftling.engine.draft_runner import DraftRunner
    from draftling.engine.target_model import CachedTarget

    model = perm_target().cuda()
    draft = oracle_draft(model).cuda()
    ps, budgets = prompts(), [40, 6, 25, 40, 2, 33, 11]
    eager, eager_runner = engines(model, draft)
    target = CachedTarget.from_hf(model, AUX, 160, batch_size=SLOTS, cuda_graphs=True, prefill_graphs=True)
    emb = model.get_input_embeddings()
    runner = DraftRunner(draft, emb, 160, batch_size=SLOTS, cuda_graphs=True, prefill_graphs=True)
    for tree in (None, TREES[1]):
        want = batch_generate(eager, ps, budgets, draft=eager_runner, tree=tree)
        got = batch_generate(target, ps, budgets, draft=runner, tree=tree)
        assert [r.tokens for r in got] == [r.tokens for r in want], tree
    assert target._prefill_fn.graphs and runner._extend_rows_fn.graphs


def test_usage_accounts_for_every_batch_pass_and_admission():
    """The run's usage: every request admitted, and a row busy for exactly the passes that
    gave its request tokens: plain, one per token after the prefill's; speculative, one per
    verify round. The fraction and the share stay within [0, 1]."""
    model = perm_target()
    ps, budgets = prompts(), [30, 4, 17, 30, 1, 23, 9]
    target, runner = engines(model, oracle_draft(model))
    for tree in (None, TREES[0]):
        got = batch_generate(target, ps, budgets, draft=runner, tree=tree)
        u = got[0].stats.usage
        assert all(r.stats.usage == u for r in got)
        assert u["admitted"] == len(ps) and 1 <= u["prefills"] <= len(ps)
        per_pass = [r.stats.verify_steps if tree else len(r.tokens) - 1 for r in got]
        assert u["busy"] == sum(per_pass), tree
        assert u["busy"] <= u["passes"] * SLOTS and 0 < u["busy_row_fraction"] <= 1
        assert 0 <= u["admit_share"] <= 1 and u["admit_ms"] <= u["wall_ms"]
