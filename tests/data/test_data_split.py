import random

import pytest

from draftling.data.prompts import Conversation
from draftling.data.split import split_by_task, split_task_id
from draftling.errors import DataError


def conv(cid, source="src"):
    return Conversation(id=cid, source=source, category="c", messages=[{"role": "user", "content": cid}])


def ids(convs):
    return {c.id for c in convs}


FAKE = [conv(f"task-{i}", source=f"s{i % 7}") for i in range(1000)]


def test_sides_are_disjoint_and_complete():
    train, val = split_by_task(FAKE, 0.2)
    assert ids(train).isdisjoint(ids(val))
    assert ids(train) | ids(val) == ids(FAKE)
    assert len(train) + len(val) == len(FAKE)


def test_duplicate_ids_stay_together():
    convs = FAKE + [conv(c.id) for c in FAKE[:300]]  # several records of the same task
    train, val = split_by_task(convs, 0.3)
    assert ids(train).isdisjoint(ids(val))
    assert len(train) + len(val) == len(convs)


def test_stable_under_shuffle():
    train, val = split_by_task(FAKE, 0.1, seed=3)
    shuffled = FAKE[:]
    random.Random(0).shuffle(shuffled)
    train2, val2 = split_by_task(shuffled, 0.1, seed=3)
    assert ids(train2) == ids(train) and ids(val2) == ids(val)
    # A subset keeps each id on the same side.
    _, val_sub = split_by_task(shuffled[:400], 0.1, seed=3)
    assert ids(val_sub) == ids(val) & ids(shuffled[:400])


def test_seed_changes_split():
    assert ids(split_by_task(FAKE, 0.1, seed=0)[1]) != ids(split_by_task(FAKE, 0.1, seed=1)[1])


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.25, 0.5])
def test_fraction_roughly_respected(fraction):
    _, val = split_by_task(FAKE, fraction)
    assert abs(len(val) / len(FAKE) - fraction) <= 0.05


def test_zero_fraction_puts_all_in_train():
    train, val = split_by_task(FAKE, 0.0)
    assert len(train) == len(FAKE) and val == []


def test_key_source_keeps_sources_together():
    train, val = split_by_task(FAKE, 0.3, key="source")
    train_sources = {c.source for c in train}
    val_sources = {c.source for c in val}
    assert train_sources.isdisjoint(val_sources)
    assert train_sources and val_sources
    assert len(train) + len(val) == len(FAKE)


def test_tiny_fraction_still_gets_one_group():
    convs = [conv("a"), conv("b"), conv("c")]
    train, val = split_by_task(convs, 0.001)
    assert len(val) == 1 and len(train) == 2
    # The group moved is the same whatever the input order.
    assert ids(split_by_task(convs[::-1], 0.001)[1]) == ids(val)


def test_train_never_emptied_with_two_groups():
    convs = [conv("a"), conv("b")]
    for seed in range(50):
        train, val = split_by_task(convs, 0.99, seed=seed)
        assert len(train) == 1 and len(val) == 1


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5])
def test_bad_fraction(fraction):
    with pytest.raises(DataError, match="val_fraction"):
        split_by_task(FAKE, fraction)


def test_bad_key():
    with pytest.raises(DataError, match="split key"):
        split_by_task(FAKE, 0.1, key="category")


def test_split_task_id_is_full_id():
    assert split_task_id("gsm8k-train-12") == "gsm8k-train-12"


def test_task_key_keeps_every_trial_of_a_task_on_one_side():
    from draftling.data.prompts import Conversation
    from draftling.data.split import task_identity

    def conv(cid, **meta):
        return Conversation(cid, "s", "agent", [{"role": "user", "content": cid}], meta=meta)

    assert task_identity(conv("tau-airline-7-31")) == "tau-airline-7"
    assert task_identity(conv("gsm8k-train-12")) == "gsm8k-train-12"  # one number: the id is the task
    assert task_identity(conv("run-3-9", task="booking")) == "booking"  # a record's own field wins
    trials = [conv(f"tau-airline-{task}-{4 * task + k}") for task in range(20) for k in range(4)]
    train, val = split_by_task(trials, 0.3, key="task")
    sides = {}
    for side, convs in (("train", train), ("val", val)):
        for c in convs:
            sides.setdefault(task_identity(c), set()).add(side)
    assert val and train and all(len(s) == 1 for s in sides.values())
    by_id = split_by_task(trials, 0.3, key="id")[1]  # the id key splits a task's trials apart
    assert any(len({c.id for c in by_id if task_identity(c) == t}) not in (0, 4) for t in sides)


def trial(task: int, n: int, **meta):
    return Conversation(
        id=f"tau-airline-{task}-{n}",
        source="airline",
        category="agent",
        messages=[{"role": "user", "content": f"{task} {n}"}],
        meta=meta,
    )


def test_the_default_key_keeps_every_trial_of_a_task_on_one_side():
    """Rollouts with tau-bench ids: by default (auto -> task) no task straddles the split."""
    from draftling.config import DataConfig
    from draftling.data.split import resolve_split_key, task_identity

    trials = [trial(t, n) for t in range(40) for n in range(4)]
    key = DataConfig().split_key
    assert resolve_split_key(trials, key)[0] == "task"
    train, val = split_by_task(trials, 0.3, key=key)
    assert val and {task_identity(c) for c in train}.isdisjoint({task_identity(c) for c in val})


def test_auto_keys_by_id_without_a_task_identity_and_set_keys_stay():
    from draftling.data.split import resolve_split_key

    assert resolve_split_key(FAKE, "auto") == (
        "id",
        "auto: no record carries a task identity (a task field or NAME-TASK-TRIAL ids)",
    )
    tagged = FAKE[:3] + [Conversation("q", "s", "c", [{"role": "user", "content": "x"}], meta={"task": "t1"})]
    key, why = resolve_split_key(tagged, "auto")
    assert key == "task" and why.startswith("auto: 1 of 4 records carry a task identity")
    assert resolve_split_key([trial(0, 0)], "id") == ("id", "data.split_key as set")
    assert split_by_task(FAKE, 0.2, key="auto") == split_by_task(FAKE, 0.2, key="id")


@pytest.mark.parametrize("key", ["auto", "id", "task"])
def test_prompt_counts_leave_out_the_conversations_of_validation_rollout_turns(key, monkeypatch):
    """Validation holds rollout turns (ids CONV#turnN); the vocab's prompt counts must leave out
    the conversations they came from, as the split put them, not count them as training's."""
    from draftling.data.prepare import pool_prompt_counts
    from draftling.data.prompts import rollout_turns

    pool = [trial(t, n) for t in range(6) for n in range(2)]
    for c in pool:
        c.messages.append({"role": "assistant", "content": "ok"})
    train, val = split_by_task(pool, 0.4, key=key)
    turns = [t for c in val for t in rollout_turns(c)]
    assert turns and all("#turn" in t.id for t in turns)
    counted = []
    monkeypatch.setattr("draftling.data.prepare.count_prompt_tokens", lambda tok, convs, n: counted.extend(convs))
    _, kept = pool_prompt_counts([0] * 8, pool, turns, key)  # a "tokenizer" of 8 tokens: only len() is read
    assert {c.id for c in counted} == {c.id for c in train} and kept == len(train)
