"""Regeneration speed, prototype: batched greedy decoding over draftling's own static KV cache
(the engine's attention halves, matmul attention, per-row masks for left padding) against
`regenerate` (HF generate), on the first 64 sharegpt prompts of <= 288 tokens, 96-token replies,
the quickstart profile's target settings. Prints reply tokens/s for both and how many replies
came out identical. A measurement aid, not a pipeline stage.

    python lab/experiments/regen_own_cache_proto.py 32
"""

import sys
import time

import torch

from draftling.config import load_config
from draftling.data.prompts import load_conversations
from draftling.data.regen import regenerate, render_prompt_ids
from draftling.data.sources import find_shared_prompts
from draftling.engine.target_model import attention_inputs, attention_outputs
from draftling.target import load_target

torch.set_num_threads(2)
cfg = load_config("quickstart_cpu", [])
t = load_target(cfg.target, dtype="float32", device="cpu", aux_layer_ids=cfg.aux_layer_ids)
convs = load_conversations(find_shared_prompts() / "sharegpt.jsonl")[:64]
NEW = 96
tok = t.tokenizer
prompts = [render_prompt_ids(tok, c) for c in convs]
prompts = sorted([p for p in prompts if len(p) <= 288], key=len)
eos = set(t.stop_token_ids())
model = t.model
layers = model.model.layers
nkv, hd = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads


@torch.no_grad()
def own(batch):
    B, P = len(batch), max(map(len, batch))
    S = P + NEW
    ids = torch.full((B, P), tok.pad_token_id)
    pad = torch.tensor([P - len(p) for p in batch])
    for i, p in enumerate(batch):
        ids[i, P - len(p) :] = torch.tensor(p)
    K = torch.zeros(len(layers), B, nkv, S, hd)
    V = torch.zeros_like(K)
    cols = torch.arange(S)

    def step(x_ids, slots):
        pos = (slots[None] - pad[:, None]).clamp(min=0)
        # A pad query sees only itself: a row with no visible slot would turn into NaN, and its
        # NaN K/V would reach real rows through 0 * NaN in probs @ V.
        mask = (cols[None, None] <= slots[None, :, None]) & (
            (cols[None, None] >= pad[:, None, None]) | (cols[None, None] == slots[None, :, None])
        )  # [B,q,S]
        mask = mask[:, None, None]  # [B,1,1,q,S]
        # only the columns written so far
        n = int(slots[-1]) + 1
        x = model.model.embed_tokens(x_ids)
        cos, sin = model.model.rotary_emb(x, pos)
        for i, layer in enumerate(layers):
            qs, ks, vs = attention_inputs(layer, x, cos, sin)
            K[i].index_copy_(2, slots, ks)
            V[i].index_copy_(2, slots, vs)
            x = attention_outputs(layer, x, qs, K[i][:, :, :n], V[i][:, :, :n], mask[..., :n], "matmul")
        return model.lm_head(model.model.norm(x[:, -1]))

    logits = step(ids, torch.arange(P))
    out = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    nxt = logits.argmax(-1)
    for s in range(NEW):
        for i in range(B):
            if not done[i]:
                out[i].append(int(nxt[i]))
                if int(nxt[i]) in eos:
                    done[i] = True
        if done.all() or s == NEW - 1:
            break
        logits = step(nxt[:, None], torch.tensor([P + s]))
        nxt = logits.argmax(-1)
    return out


bs = int(sys.argv[1]) if len(sys.argv) > 1 else 32
t0 = time.perf_counter()
outs = []
for i in range(0, len(prompts), bs):
    outs += own(prompts[i : i + bs])
dt = time.perf_counter() - t0
ntok = sum(len(o) for o in outs)
print("own", bs, "prompts", len(prompts), "s", round(dt, 1), "tok/s", round(ntok / dt, 1), flush=True)
rc = cfg.data.regen
rc.batch_size = bs
t0 = time.perf_counter()
rows = list(regenerate(t, convs, rc, max_prompt_tokens=288, progress=False))
dt = time.perf_counter() - t0
toks = sum(r["provenance"]["reply_tokens"] for r in rows)
print("hf", bs, "prompts", len(rows), "s", round(dt, 1), "tok/s", round(toks / dt, 1), flush=True)
# compare texts
hf = {r["id"]: r for r in rows}
# order: prompts sorted by len; map back via ids
same = 0
ids_sorted = sorted(
    [(len(render_prompt_ids(tok, c)), k, c.id) for k, c in enumerate(convs) if len(render_prompt_ids(tok, c)) <= 288]
)
for (_len, _k, cid), o in zip(ids_sorted, outs):
    cut = o
    for j, x in enumerate(o):
        if x in eos:
            cut = o[:j]
            break
    same += tok.decode(cut, skip_special_tokens=True) == hf[cid]["messages"][-1]["content"]
print("identical replies", same, "/", len(outs))
