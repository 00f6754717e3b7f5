"""The quickstart's timing probe: seconds of one training step of the configured draft on random
data (``measure_step_seconds``), which recipes/budget.py prices a run's time budget with."""

from __future__ import annotations

import torch

from draftling.config import RunConfig
from draftling.target import Target
from draftling.timing import timed
from draftling.train.batches import BatchSource, train_step
from draftling.train.distributed import current, wrap
from draftling.train.draft_setup import prepare_draft
from draftling.train.optim import build_optimizer
from draftling.train.teacher import TeacherBatch, TeacherSource


class RandomStates:
    """A teacher source of random aux and final states: what kept states cost (the target's
    output head only), for timing. Uncached, and the same source for every split."""

    cacheable = False

    def __init__(self, target: Target, t2d: torch.Tensor):
        self.target, self.t2d = target, t2d

    def for_split(self, split: str, data_hash: str | None = None) -> TeacherSource | None:
        return None

    def get(self, keys: list[int], lengths: list[int], device) -> TeacherBatch:
        from draftling.train.teacher import head_outputs

        h, dtype = self.target.config.hidden_size, self.target.input_embeddings().weight.dtype
        shape = (len(keys), max(lengths))
        aux = torch.randn(*shape, h * len(self.target.aux_layer_ids), device=device, dtype=dtype)
        return head_outputs(self.target, aux, torch.randn(*shape, h, device=device, dtype=dtype), self.t2d)


def measure_step_seconds(cfg: RunConfig, target: Target, seq_len: int, repeats: int = 3) -> float:
    """Seconds of one training step on this machine: ``train.batch_size`` random sequences of
    ``seq_len`` tokens through a fresh draft of the configured shape and dtypes. The teacher is
    what the run will use: with data.keep_teacher_states only the output head runs, otherwise
    the whole target. One warm-up step is not counted, and the fastest of ``repeats`` steps is
    the answer (a transient load on the machine must not make the budget refuse a run); the
    draft is thrown away and the RNG state restored."""
    from draftling.data.tokenized import TokenizedExample
    from draftling.draft.vocab import build_vocab

    rng = torch.get_rng_state()
    device, tc = target.device, cfg.train
    vocab = build_vocab(torch.ones(target.config.vocab_size), min(cfg.vocab.size, target.config.vocab_size), "probe")
    draft, offload, param_dtype = prepare_draft(cfg, target, vocab, device)
    objective = wrap(draft, current(), tc.parallel, param_dtype, offload)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer, scheduled = build_optimizer(params, tc.lr, tc.betas, tc.weight_decay, offload)
    scheduler = torch.optim.lr_scheduler.LambdaLR(scheduled, lambda _: 1.0)
    examples = [
        TokenizedExample(str(i), "probe", torch.randint(0, vocab.size, (seq_len,)).tolist(), [1] * seq_len)
        for i in range(tc.batch_size)
    ]
    teacher = RandomStates(target, vocab.t2d.to(device)) if cfg.data.keep_teacher_states else None
    source = BatchSource(cfg, target, examples, device, current(), teacher)
    keys = list(range(tc.batch_size))
    times = []
    for _ in range(repeats + 1):
        times.append(timed(lambda: train_step(objective, optimizer, scheduler, source, keys), device)[1])
    torch.set_rng_state(rng)
    return min(times[1:])
