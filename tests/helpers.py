"""Builders shared by the test modules: tiny models, drafts, prompts and runs.

Test modules import these from here, never from one another (tests/test_layout.py checks it;
tests/conftest.py keeps the fixtures and the few helpers every folder uses: ``random_batch``,
``setup_data``, ``run_draftling``, ``smollm2_gguf``, ``CHECKOUT``, ``TINY_VOCAB``).

Every random test model starts from ``TINY_FIELDS``: ``tiny_config`` / ``tiny`` take the
fields a test needs changed as keyword overrides.
"""

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from draftling.config import load_config
from draftling.draft.model import Eagle3Draft, draft_config_from_target, repeat_kv
from draftling.draft.store import save_draft
from draftling.engine import CachedTarget, DraftRunner, greedy_generate
from draftling.target.aux import aux_hidden_states
from draftling.target.load import wrap_target
from draftling.train.trainer import train
from tests.conftest import CHECKOUT, TINY_VOCAB

AUX = [1, 2, 3]
V, H = TINY_VOCAB, 64
TREES = [(3, 1, 4), (3, 4, 8), (5, 8, 16)]

# ------------------------------------------------------------------- tiny random models (all)

TINY_FIELDS = dict(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
TOY_TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the stub tokenizers' ids


def tiny_config(cfg_cls=LlamaConfig, **kw):
    """``TINY_FIELDS`` with ``kw`` over them, as a ``cfg_cls`` (a config alone, no weights)."""
    return cfg_cls(**{**TINY_FIELDS, **kw})


def tiny(cls=LlamaForCausalLM, cfg_cls=LlamaConfig, seed=0, **kw):
    """A random ``cls`` of ``tiny_config(cfg_cls, **kw)``, its weights drawn after
    ``torch.manual_seed(seed)``, in eval mode. By default 4 layers."""
    torch.manual_seed(seed)
    return cls(tiny_config(cfg_cls, **kw)).eval()


def tiny_llama(layers: int = 6, seed: int = 0, **kw) -> LlamaForCausalLM:
    """The 6-layer random Llama (vocab 300, untied head) most CPU tests train and decode with;
    the ``tiny_target`` fixture wraps it."""
    return tiny(LlamaForCausalLM, LlamaConfig, seed=seed, num_hidden_layers=layers, **kw)


def saved_tiny_target(out: Path, tokenizer, seed: int = 0, **kw) -> Path:
    """``tiny()`` over ``tokenizer``'s vocabulary and special ids (``kw`` over its fields),
    saved in ``out`` with the tokenizer: a target folder the CLI and ``load_target`` read."""
    tokenizer.save_pretrained(out)
    ids = dict(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    tiny(LlamaForCausalLM, LlamaConfig, seed, **{**ids, **kw}).save_pretrained(out)
    return out


# ----------------------------------------------------------------- decode engine (tests/engine)


def sampling_target(vocab=16):
    """A tiny target over ``vocab`` tokens whose next-token probabilities are spread out (a
    wider head), not near-uniform: the sampling-law tests compare against its exact laws.
    As many K/V heads as query heads, as ``oracle_draft`` needs."""
    model = tiny(
        LlamaForCausalLM,
        LlamaConfig,
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.4)
    return model


def random_draft(model, draft_vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config_from_target(model.config, draft_vocab, AUX)).eval()
    vocab = model.config.vocab_size
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(draft_vocab), t2d)  # target_id = draft_id + d2t[draft_id]
    return draft


def perm_target(beta=0.95, perturb=30.0, seed=0):
    """A target that mostly walks two fixed token maps: logits(x) peak at nxt[x] (weight 1)
    and nxt2[x] (weight beta); scaled-up layers add context so it sometimes picks the
    second one, or neither."""
    g = torch.Generator().manual_seed(seed)
    model = tiny(LlamaForCausalLM, LlamaConfig, seed=seed, num_key_value_heads=4)
    cycle = torch.randperm(V, generator=g)
    nxt = torch.empty(V, dtype=torch.long)
    nxt[cycle] = cycle.roll(-1)  # one 300-cycle: the walk does not repeat soon
    nxt2 = torch.randperm(V, generator=g)
    with torch.no_grad():
        e = torch.randn(V, H, generator=g)
        en = e / e.pow(2).mean(-1, keepdim=True).sqrt()
        model.model.embed_tokens.weight.copy_(e)
        head = torch.zeros(V, H).index_copy(0, nxt, en) + beta * torch.zeros(V, H).index_copy(0, nxt2, en)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(perturb)
            layer.mlp.down_proj.weight.mul_(perturb)
    return model


def oracle_draft(model, gamma=4.0, draft_vocab=None, seed=0, shuffled=True, **overrides):
    """A draft that predicts the target's layer-free logits for its input token.

    fc = 0, so step 0 has h = 0. q = k = gamma*(ie + hn) makes each query attend (almost)
    only to itself; v = ie - hn and o = I give out = h + ie - h/rms(h) = ie whenever h is the
    previous step's output (rms 1). So every step outputs input_layernorm(embed(token)), and
    the head (the target's rows, in a shuffled draft vocab) ranks tokens as the target's
    embedding-only path does. Needs num_key_value_heads == num_attention_heads.
    ``shuffled=False`` orders the draft vocab by target id, as the teacher's t2d slice does.
    ``overrides``: draft config fields (heads for a target whose shape the draft cannot copy)."""
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    draft_vocab = draft_vocab or vocab
    draft = Eagle3Draft(draft_config_from_target(model.config, draft_vocab, AUX, **overrides)).eval()
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 1))[:draft_vocab]
    if not shuffled:
        ids = ids.sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(draft_vocab), t2d)
    eye = torch.eye(hidden)
    with torch.no_grad():
        draft.fc.weight.zero_()
        attn = draft.midlayer.self_attn
        attn.q_proj.weight.copy_(gamma * torch.cat([eye, eye], 1))
        attn.k_proj.weight.copy_(gamma * torch.cat([eye, eye], 1))
        attn.v_proj.weight.copy_(torch.cat([eye, -eye], 1))
        attn.o_proj.weight.copy_(eye)
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.lm_head.weight.copy_(model.lm_head.weight[ids])
    return draft


def runners(model, draft, size=160):
    target = CachedTarget.from_hf(model, AUX, size)
    return target, DraftRunner(draft, model.get_input_embeddings(), size)


def prompt(n=7, seed=1, vocab=V):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square against exact probabilities; cells expected < 5 pooled."""
    n = counts.sum()
    exp = probs.double() * n
    small = exp < 5
    obs = torch.cat([counts[~small].double(), counts[small].sum().double()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, dof))
    except ImportError:  # Wilson-Hilferty: chi2/dof is ~ normal after a cube root
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


# ------------------------------------------------------------------------------- batched engine

LENGTHS = [3, 11, 7, 20, 5, 9, 14]
SLOTS = 3


def batch_prompts(lengths=LENGTHS, vocab=V):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def batch_engines(model, draft=None, slots=SLOTS, size=160):
    target = CachedTarget.from_hf(model, AUX, size, batch_size=slots)
    runner = None if draft is None else DraftRunner(draft, model.get_input_embeddings(), size, batch_size=slots)
    return target, runner


def decode_alone(model, ps, budgets, eos=None):
    """Each request decoded alone by the batch-1 engine."""
    target = CachedTarget.from_hf(model, AUX, 160)
    return [greedy_generate(target, p[None], m, eos_ids=eos)[0].tolist() for p, m in zip(ps, budgets)]


# ------------------------------------------------------------------ release bench (tests/bench)

WORKLOADS = ("prose", "code", "math")


def tiny_bench_target():
    """``tiny()`` (4 layers) with the stub tokenizer's special ids, wrapped as a Target."""
    model = tiny(LlamaForCausalLM, LlamaConfig, **TOY_TOKEN_IDS)
    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=2, get_vocab=lambda: {})
    return wrap_target(model, tok, name="tiny-llama", aux_layer_ids=AUX)


def random_block_draft(model, block=4, seed=0):
    """A block drafter (draft.method=dflash) of ``block`` slots over the full vocabulary,
    started from the target's embeddings and head, so some of its drafts are accepted."""
    from draftling.draft.block import BlockDraft, block_config_from_target
    from draftling.draft.model import init_from_target

    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    draft = BlockDraft(block_config_from_target(model.config, vocab, AUX, block, 1, mask_token_id=0)).eval()
    draft.set_vocab(torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
    init_from_target(draft, model, draft.t2d)
    return draft


def train_block_head(model, block=4, steps=200, seed=0):
    """A block head (``random_block_draft``) trained ``steps`` steps on ``model``'s own greedy
    continuations of 64 random 4-token prompts. Returns (head in eval mode, prompts [64, 4],
    the first step's BlockLoss, the last one's)."""
    from draftling.engine.generate import greedy_generate
    from draftling.engine.target_model import CachedTarget
    from draftling.train.block_loss import block_loss, sample_anchors
    from draftling.train.teacher import teacher_forward

    draft = random_block_draft(model, block, seed).train()
    target = wrap_target(model, None, aux_layer_ids=AUX)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (64, 4), generator=g)
    engine = CachedTarget.from_hf(model, AUX, 160)
    seqs = torch.cat([ids, torch.stack([greedy_generate(engine, p, 28)[0] for p in ids])], 1)
    mask, ones = torch.ones_like(seqs), torch.ones_like(seqs)
    mask[:, :4] = 0
    batch = teacher_forward(target, seqs, ones, draft.t2d)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    first = out = None
    for _ in range(steps):
        out = block_loss(draft, model.get_input_embeddings(), seqs, mask, ones, batch, sample_anchors(mask, 12, g))
        first = first or out
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return draft.eval(), ids, first, out


def tiny_draft_dir(target, path: Path, draft_vocab=64, seed=0, method="eagle3") -> Path:
    """``random_draft`` (or ``random_block_draft`` for method dflash) for ``target``, saved in ``path``."""
    draft = (
        random_block_draft(target.model, seed=seed) if method == "dflash" else random_draft(target, draft_vocab, seed)
    )
    path.mkdir(parents=True)
    save_draft(draft, path)
    return path


def token_prompt_set(path: Path, per_workload=2, seed=0) -> Path:
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for w in WORKLOADS:
            for i in range(per_workload):
                n = int(torch.randint(4, 16, (1,), generator=g))
                ids = torch.randint(3, V, (n,), generator=g).tolist()
                f.write(json.dumps({"id": f"{w}-{i}", "workload": w, "input_ids": ids}) + "\n")
    return path


class ToyChatTokenizer:
    """Chat template stand-in: renders 'role: content' lines and ignores tools."""

    chat_template = "toy"
    name_or_path = "toy"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, tools=None):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % (V - 3) for c in text]}


# ----------------------------------------------------------------------- training (tests/train)


def spaced_vocab_draft(target_model, vocab=64, seed=1):
    torch.manual_seed(seed)
    cfg = draft_config_from_target(target_model.config, vocab, [2, 3, 4])
    draft = Eagle3Draft(cfg)
    ids = torch.arange(0, 2 * vocab, 2)  # every other target id
    t2d = torch.zeros(target_model.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(vocab), t2d)
    return draft


def cfg_for(steps, **extra):
    over = [
        f"train.max_steps={steps}",
        "train.batch_size=4",
        "train.ttt_steps=3",
        "train.log_every=1",
        "train.ckpt_every=2",
        "train.warmup_steps=2",
        "train.lr=1e-3",
        "train.keep_checkpoints=10",
    ]
    over += [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, over)


def train_run(tmp_path, target, run_name, steps, resume=False, **extra):
    return train(
        cfg_for(steps, **extra),
        target,
        tmp_path / run_name,
        tmp_path / "train.jsonl",
        tmp_path / "val.jsonl",
        tmp_path / "vocab.safetensors",
        resume=resume,
    )


def whole_and_resumed(tmp_path, target, steps: int, cut_at: int, **extra):
    """Two runs of ``steps``: "full", and "cut", whose checkpoints after ``cut_at`` and final
    head are deleted (a kill) before it resumes. Returns the two run directories."""
    import shutil

    from draftling.train.checkpoint import list_checkpoints

    train_run(tmp_path, target, "full", steps, **extra)
    train_run(tmp_path, target, "cut", steps, **extra)
    for ckpt in list_checkpoints(tmp_path / "cut"):
        if int(ckpt.name.split("_")[1]) > cut_at:
            shutil.rmtree(ckpt)
    shutil.rmtree(tmp_path / "cut" / "draft")
    train_run(tmp_path, target, "cut", steps, resume=True, **extra)
    return tmp_path / "full", tmp_path / "cut"


CLI_TRAIN = ["train.batch_size=2", "train.ttt_steps=2", "train.log_every=1", "train.ckpt_every=2"]


def cli_train(common, data, run, steps, *extra) -> int:
    """`draftling train` of a tiny head for ``steps`` (CLI_TRAIN's small batches, a checkpoint
    every 2 steps) into ``run``; its exit code."""
    from draftling.cli import main

    args = ["train", *common, "--data", str(data), "--run-dir", str(run), f"train.max_steps={steps}"]
    return main([*args, *CLI_TRAIN, *extra])


def cli_data(tmp_path, target_dir, vocab: int = 256):
    """`draftling data` (12-token replies) and `vocab` for a tiny target through the CLI: the
    data directory and the target/device arguments every later command takes."""
    from draftling.cli import main

    data, common = tmp_path / "data", ["--target", str(target_dir), "--device", "cpu"]
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    assert main(["data", *common, "--out", str(data), "--prompts", str(prompts), "data.regen.max_new_tokens=12"]) == 0
    assert main(["vocab", "--data", str(data), "--size", str(vocab), "--target", str(target_dir)]) == 0
    return data, common


# ----------------------------------------------------------------------- exports (tests/export)

VOCAB, DRAFT_VOCAB, LAYERS = V, 64, 6
DEFAULT_IDS = [2, 3, 3]  # [2, L//2, L-3] for L = 6


def tiny_export_llama() -> LlamaForCausalLM:
    """The 6-layer random Llama (vocab 300) the export tests draft for: ``tiny_llama()`` with
    Llama 3's rope theta and a 4096-token context."""
    return tiny_llama(LAYERS, max_position_embeddings=4096, rope_theta=500000.0)


def random_export_draft(target, aux_ids=DEFAULT_IDS, seed=1, **overrides):
    torch.manual_seed(seed)
    draft = Eagle3Draft(
        draft_config_from_target(target.config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=aux_ids, **overrides)
    )
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.2)  # norms too, so a swapped/missing tensor changes the logits
    ids = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
    d2t = ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(d2t, t2d)
    return draft.eval()


def causal_attend(q, k, v):
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)


@torch.no_grad()
def run_draft(draft, target, input_ids):
    _, aux = aux_hidden_states(target, draft.config.eagle_aux_hidden_state_layer_ids, input_ids=input_ids)
    embeds = target.get_input_embeddings()(input_ids)
    pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
    h = draft.fuse(aux)
    h = draft.step(embeds, h, pos, causal_attend)
    logits0 = draft.compute_logits(h)
    h = draft.step(embeds, h, pos + 1, causal_attend)  # a second step feeds its own state back
    return torch.cat([logits0, draft.compute_logits(h)], dim=-1)


# ---------------------------------------------------- commands and data (tests/cli, tests/data)


def write_prompts(path: Path, n: int = 12) -> Path:
    rows = [
        {
            "id": f"p{i}",
            "source": "test",
            "category": "chat",
            "messages": [{"role": "user", "content": f"Tell me fact number {i} about the sea."}],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_files(d):
    """Every file's bytes; a safetensors file's tensors and metadata (safetensors writes its
    metadata keys in hash-map order, so its bytes vary from run to run)."""
    from safetensors import safe_open

    out = {}
    for p in sorted(d.iterdir()):
        if p.suffix == ".safetensors":
            with safe_open(str(p), "pt") as f:
                out[p.name] = (
                    f.metadata(),
                    {k: f.get_tensor(k).view(-1).view(torch.uint8).tolist() for k in sorted(f.keys())},
                )
        else:
            out[p.name] = p.read_bytes()
    return out


# Each bad value with the culprit its one error line names (tests/cli).
_TRAIN = ["train", "--data", "no-data", "--run-dir", "run"]
BAD_VALUE_CASES = [
    (["data", "--out", "d", "data.regen.max_new_tokens=-1"], "data.regen.max_new_tokens=-1"),
    (["data", "--out", "d", "data.regen.batch_size=0"], "data.regen.batch_size=0"),
    (["data", "--out", "d", "data.max_prompts_per_file=-3"], "data.max_prompts_per_file=-3"),
    (["data", "--out", "d", "data.min_tokens=50", "data.max_tokens=20"], "data.min_tokens=50"),
    (_TRAIN + ["train.ckpt_every=0"], "train.ckpt_every=0"),
    (_TRAIN + ["train.log_every=0"], "train.log_every=0"),
    (_TRAIN + ["train.ttt_steps=0"], "train.ttt_steps=0"),
    (_TRAIN + ["train.lr=-1"], "train.lr=-1"),
    (_TRAIN + ["train.epochs=-2"], "train.epochs=-2"),
    (_TRAIN + ["train.keep_checkpoints=-1"], "train.keep_checkpoints=-1"),
    (["vocab", "--data", "no-data", "--size", "0"], "vocab.size=0"),
    (["bench", "--prompts", "p.jsonl", "--draft", "d", "--num-prompts", "0"], "bench.num_prompts=0"),
    (["bench", "--prompts", "p.jsonl", "--draft", "d", "--num-prompts", "-3"], "bench.num_prompts=-3"),
    (["bench", "--prompts", "p.jsonl", "--draft", "d", "bench.num_prompts=0"], "bench.num_prompts=0"),
    (["quickstart", "--out", "q", "wall_minutes=-5"], "wall_minutes=-5"),
]


# --------------------------------------------------------- the lab's device scripts (lab/tests)


def load_script(name, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, CHECKOUT / f"lab/gpu/{name}.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, script)  # its dataclasses look themselves up there
    spec.loader.exec_module(script)
    return script
