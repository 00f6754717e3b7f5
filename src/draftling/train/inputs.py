"""What a run reads before it touches its directory: the examples of both splits, the vocab, the
teachers (a given source, or the states kept beside each jsonl file) and a warm start."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from draftling.data.runs import check_one_run
from draftling.data.states import StoredStates, states_path
from draftling.data.tokenized import load_tokenized
from draftling.draft.vocab import hash_dataset_file, load_vocab
from draftling.errors import ConfigError
from draftling.target import Target
from draftling.train.teacher import KeptStatesTeacher, TeacherSource
from draftling.train.warmstart import InitDraft, WarmStart, warm_start


def kept_states_teacher(target: Target, jsonl_path, t2d, say) -> KeptStatesTeacher | None:
    """The teacher for the rows of ``jsonl_path`` from the states kept beside it at
    regeneration, when they match it (else None: the target runs as usual)."""
    path = states_path(Path(jsonl_path).parent, Path(jsonl_path).stem)
    if not path.is_file():
        return None
    states = StoredStates(path)
    why_not = states.matches(jsonl_path, target.aux_layer_ids)
    if why_not:
        say(f"teacher: not using {path.name} ({why_not}); the target recomputes its states")
        return None
    say(f"teacher: states kept at regeneration ({path.name}); only the output head runs")
    return KeptStatesTeacher(target, states, t2d)


@dataclasses.dataclass
class RunInputs:
    """What a run reads before it touches its directory: a bad input leaves nothing behind."""

    examples: list
    val_examples: list
    vocab: object
    teacher: TeacherSource | None  # None: the resident target is the teacher
    val_teacher: TeacherSource | None
    warm: WarmStart | None = None  # --init-from: the head training starts from, and its maps


def load_run_inputs(
    target: Target,
    train_path,
    val_path,
    vocab_path,
    teacher_source: TeacherSource | None,
    say,
    init: InitDraft | None = None,
) -> RunInputs:
    """The examples, the vocab and the teachers of both splits. A given ``teacher_source`` serves
    validation through its ``for_split("val", hash)``; without one, the states kept beside each
    jsonl file (if any) are the teacher of its split."""
    n_vocab = target.config.vocab_size
    check_one_run(*[Path(p) for p in (train_path, val_path) if p])
    examples = load_tokenized(train_path, n_vocab)
    val_examples = load_tokenized(val_path, n_vocab) if val_path and Path(val_path).exists() else []
    val_teacher = None
    if teacher_source is not None and val_examples:
        val_teacher = teacher_source.for_split("val", hash_dataset_file(val_path))
    vocab = load_vocab(vocab_path, expect_data_hash=hash_dataset_file(train_path), target_vocab_size=n_vocab)
    warm = None
    if init is not None:
        warm = warm_start(init, target, vocab, examples)
        r = warm.report
        say(
            f"init from {init.where}: "
            + (
                f"vocab map rebuilt from the data, {r['tokens_entered']} tokens entered "
                f"with the target's head rows; coverage {r['new_map_coverage']:.3f}"
                if init.rebuild_vocab
                else f"its own vocab map kept, covering {r['kept_map_coverage']:.3f} of the data's loss tokens (a map "
                f"from the data: {r['new_map_coverage']:.3f}; --rebuild-vocab switches to it)"
            )
        )
        if teacher_source is not None and not torch.equal(warm.vocab.t2d, vocab.t2d):
            raise ConfigError(
                f"--init-from {init.where}: the head keeps its own vocab map, but the teacher cache "
                "holds logits over the data's map; pass --rebuild-vocab or train online"
            )
        vocab = warm.vocab
    if teacher_source is None:
        teacher_source = kept_states_teacher(target, train_path, vocab.t2d, say)
        if teacher_source is not None and val_examples:
            val_teacher = kept_states_teacher(target, val_path, vocab.t2d, say)
    return RunInputs(examples, val_examples, vocab, teacher_source, val_teacher, warm)
