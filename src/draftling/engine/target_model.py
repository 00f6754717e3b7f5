"""The target's forward pass over an own, static KV cache (gpt-fast style).

``CachedTarget`` reuses the HF modules of a Llama-family causal LM (weights shared, not
copied) but owns the KV cache: ``[layers][B, nkv, max_seq_len, d]``, written with
``index_copy_`` at caller-given slots and read whole through a boolean mask. Every tensor
shape depends only on the query length, so the same code runs eagerly, under
``torch.compile(dynamic=False)`` or inside a CUDA graph (``StaticFn``). HF's own
StaticCache broke under manual graph capture on the GPU machine, hence owning it.

The caller decides where K/V go (``cache_positions``) and what each query sees
(``attn_mask``), which is all tree verification and cache compaction need.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from draftling.errors import ConfigError, TargetError
from draftling.target.aux import decoder_layers, validate_aux_layer_ids

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedArchitecture(TargetError, NotImplementedError):
    """The target's architecture has no own-cache port in the engine."""


def _check_architecture(model, max_seq_len: int) -> None:
    cfg = model.config
    arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitecture(
            f"the decode engine supports {', '.join(SUPPORTED_MODEL_TYPES)} targets; "
            f"got {arch} (model_type {cfg.model_type!r})")
    for i, layer in enumerate(decoder_layers(model)):
        attn = getattr(layer, "self_attn", None)
        need = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if attn is None or any(m is None for m in need) or not all(
                hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
            raise UnsupportedArchitecture(f"{arch}: decoder layer {i} is not Llama-shaped")
    # A window shorter than the cache would need a banded mask; none of our targets use one.
    window = getattr(cfg, "sliding_window", None)
    sliding = cfg.model_type == "mistral" or "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
    if window is not None and sliding and window < max_seq_len:
        raise UnsupportedArchitecture(
            f"{arch}: sliding-window attention ({window}) shorter than max_seq_len {max_seq_len}")


class CachedTarget(nn.Module):
    """Own-KV-cache forward of an HF Llama/Mistral/Qwen2/Qwen3 causal LM.

    ``forward(input_ids [B,q], positions [B,q] or [q], cache_positions [q], attn_mask [q,S])``
    returns ``(logits [B,q,V], aux [B,q,3H])``; ``aux`` concatenates HF ``hidden_states[i]``
    (output of decoder layer i-1) for each aux id, in the given order.
    """

    def __init__(self, model, aux_layer_ids, max_seq_len: int, batch_size: int = 1, dtype=None,
                 compile: bool = False, cuda_graphs: bool = False):
        super().__init__()
        _check_architecture(model, max_seq_len)
        cfg = model.config
        self.config = cfg
        base = model.get_decoder()
        # Plain attribute references: the HF modules (and their tensors) are shared.
        self.embed = model.get_input_embeddings()
        self.layers = decoder_layers(model)
        self.norm = base.norm
        self.lm_head = model.get_output_embeddings()
        self.rotary_emb = base.rotary_emb  # HF's class: rope scaling comes with it
        self.aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, len(self.layers))
        self.max_seq_len = int(max_seq_len)
        attn0 = self.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.num_kv_heads = cfg.num_key_value_heads
        self.qk_norm = hasattr(attn0, "q_norm")  # Qwen3: RMSNorm per head before RoPE
        wdtype = self.embed.weight.dtype
        if dtype is not None and dtype != wdtype:
            raise ConfigError(f"CachedTarget shares the target's {wdtype} weights; convert the model "
                              f"with model.to({dtype}) instead of asking for dtype={dtype}")
        device = self.embed.weight.device
        shape = (batch_size, self.num_kv_heads, self.max_seq_len, self.head_dim)
        for i in range(len(self.layers)):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=wdtype, device=device),
                                 persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=wdtype, device=device),
                                 persistent=False)
        self.compile, self.cuda_graphs = compile, cuda_graphs
        self.fast = StaticFn(self.forward, compile=compile, cuda_graphs=cuda_graphs)
        self._gather_fn = StaticFn(self._gather_kv, compile=compile, cuda_graphs=cuda_graphs)
        self._scatter_fn = StaticFn(self._scatter_kv, compile=compile, cuda_graphs=cuda_graphs)

    @classmethod
    def from_hf(cls, model, aux_layer_ids, max_seq_len: int, dtype=None, **kwargs) -> "CachedTarget":
        return cls(model, aux_layer_ids, max_seq_len, dtype=dtype, **kwargs)

    def kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def forward(self, input_ids, positions, cache_positions, attn_mask):
        b, q = input_ids.shape
        x = self.embed(input_ids)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(b, q)
        cos, sin = self.rotary_emb(x, positions)
        want = set(self.aux_layer_ids)
        aux = {}
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            qs = attn.q_proj(h).view(b, q, -1, self.head_dim)
            ks = attn.k_proj(h).view(b, q, -1, self.head_dim)
            vs = attn.v_proj(h).view(b, q, -1, self.head_dim).transpose(1, 2)
            if self.qk_norm:
                qs, ks = attn.q_norm(qs), attn.k_norm(ks)
            qs, ks = apply_rotary_pos_emb(qs.transpose(1, 2), ks.transpose(1, 2), cos, sin)
            k_cache, v_cache = self.kv(i)
            k_cache.index_copy_(2, cache_positions, ks)
            v_cache.index_copy_(2, cache_positions, vs)
            # Whole static cache + boolean mask: shapes never depend on the context length.
            o = F.scaled_dot_product_attention(qs, k_cache, v_cache, attn_mask=attn_mask,
                                               scale=attn.scaling,
                                               enable_gqa=k_cache.shape[1] != qs.shape[1])
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, q, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i + 1 in want:
                aux[i + 1] = x
        logits = self.lm_head(self.norm(x))
        return logits, torch.cat([aux[i] for i in self.aux_layer_ids], dim=-1)

    def _caches(self) -> list[torch.Tensor]:
        return [c for i in range(len(self.layers)) for c in self.kv(i)]

    def _gather_kv(self, src):
        return (torch.stack([c.index_select(2, src) for c in self._caches()]),)

    def _scatter_kv(self, dst, rows):
        for cache, r in zip(self._caches(), rows):
            cache.index_copy_(2, dst, r)
        return ()

    @torch.no_grad()
    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy cache slots ``src`` to ``dst`` in every layer (accepted tree path -> contiguous).

        Two static functions (one graph each on a GPU), all rows read before any is written:
        src and dst overlap, so a single read-and-write function would not survive the repeat
        that graph warm-up makes; each half alone is safe to repeat."""
        rows, = self._gather_fn(src)
        self._scatter_fn(dst, rows)


def causal_mask(start, q: int, size: int, device) -> torch.Tensor:
    """[q, size] bool: query i (at slot start+i) sees slots 0..start+i (start: int or [1] tensor)."""
    return torch.arange(size, device=device)[None, :] <= (start + torch.arange(q, device=device))[:, None]


class StaticFn:
    """Run ``fn(*tensors) -> tuple of tensors`` eagerly, compiled, and/or as CUDA graphs.

    One graph per input signature (shapes and dtypes); inputs are copied into static
    buffers before replay and outputs cloned after it. ``fn`` may write to caches but must be
    safe to repeat: the warm-up calls repeat the real call's writes (so it must not read slots
    it overwrote, see ``move_kv``). ``cuda_graphs`` is a no-op for CPU tensors; ``compile``
    uses ``torch.compile(dynamic=False)`` on any device.
    """

    def __init__(self, fn, compile: bool = False, cuda_graphs: bool = False):
        self.eager = fn
        self.fn = torch.compile(fn, dynamic=False) if compile else fn
        self.cuda_graphs = cuda_graphs
        self.graphs: dict = {}
        self.pool = None  # one memory pool per StaticFn: a handle must not outlive its graphs

    @torch.no_grad()
    def __call__(self, *args):
        if not (self.cuda_graphs and args[0].is_cuda):
            return self.fn(*args)
        key = tuple((a.shape, a.dtype) for a in args)
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
        graph, static_in, static_out = self.graphs[key]
        for buf, a in zip(static_in, args):
            buf.copy_(a)
        graph.replay()
        return tuple(o.clone() for o in static_out)

    def _capture(self, args):
        static_in = [a.clone() for a in args]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up (and compile) outside the capture
                self.fn(*static_in)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = self.fn(*static_in)
        return graph, static_in, tuple(static_out)
