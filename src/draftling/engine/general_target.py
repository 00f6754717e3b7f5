"""The engine's general path: any HF causal LM whose attention goes through transformers'
attention-function interface (``AttentionInterface``).

``GeneralCachedTarget`` runs the model's own forward (its layers, norms, MoE, MLA
projections, rotary and logit soft-capping), with one attention function registered under
``ATTN_NAME`` swapped in for the duration of a pass. Per layer (``module.layer_idx``) that
function writes the new K/V into the engine's own per-layer cache at the caller's
``cache_positions`` and attends over the whole cache through the caller's boolean mask, the
layer's sliding window (by the queries' positions) and, where the model passes them,
attention sinks (``s_aux``) and logit soft-capping (``softcap``). Per-layer buffers take each
layer's own shapes, so MLA (key head dim != value head dim) needs nothing special.

Decode passes run the whole forward as one ``torch.compile(dynamic=False)`` step (``model_step``)
and inside the engine's CUDA graphs (``StaticFn``), where the model allows them. The forward is
not ours to make graph-safe, so a warm-up pass at construction tries first: a compile that fails,
or a host sync in the forward (MoE routing that reads back a count, say; a CUDA graph cannot hold
one), turns that feature off for this target with one logged line. ``build_target`` picks the
fast Llama-family ``CachedTarget`` where it applies and this path otherwise; a model neither can
serve raises ``UnsupportedArchitecture`` naming why.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

from draftling.engine.options import EngineOptions
from draftling.engine.target_model import (
    LAYER_TYPES,
    CachedTarget,
    TargetEngine,
    UnsupportedArchitecture,
    _check_architecture,
    causal_mask,
    compile_once,
    matmul_attention,
    row_mask,
    write_kv,
)
from draftling.target.aux import decoder_layers, recording_aux_states, validate_aux_layer_ids
from draftling.target.devmap import dispatched_devices

log = logging.getLogger(__name__)

ATTN_NAME = "draftling_engine"
# Keyword arguments the attention function applies; any other it is given that is neither
# None nor a flag (a bool: output_router_logits, ...) might change the result (a position
# bias, say), so the probe refuses the model.
APPLIED = {"sliding_window", "s_aux", "softcap"}
IGNORED = {
    "dropout",
    "position_ids",
    "cache_position",
    "output_attentions",
    "use_cache",
    "is_causal",
    "return_dict",
    "output_hidden_states",
    "logits_to_keep",
}
_ACTIVE: list = []  # the engine whose pass runs now (innermost last)


def _engine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if not _ACTIVE:
        raise RuntimeError(f"attention implementation {ATTN_NAME!r} only runs inside a GeneralCachedTarget pass")
    return _ACTIVE[-1].attend(module, query, key, value, scaling, kwargs)


AttentionInterface.register(ATTN_NAME, _engine_attention)


def _check_config(model) -> None:
    """Attention patterns the attention function would not see: refused up front."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = _arch(model)
    types = set(getattr(cfg, "layer_types", None) or ())
    if types - LAYER_TYPES:
        raise UnsupportedArchitecture(
            f"{name}: layer types {sorted(types - LAYER_TYPES)} (the general engine "
            f"path serves {sorted(LAYER_TYPES)} only)"
        )
    for attr in ("attention_chunk_size", "use_bidirectional_attention"):
        if getattr(cfg, attr, None):
            raise UnsupportedArchitecture(f"{name}: {attr}={getattr(cfg, attr)} is not served by the engine")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise UnsupportedArchitecture(f"{name}: its forward takes no position_ids (tree verify needs them)")


def _arch(model) -> str:
    return (getattr(model.config, "architectures", None) or [type(model).__name__])[0]


class GeneralCachedTarget(TargetEngine):
    """Own-KV-cache engine over any HF causal LM whose attention goes through the attention
    interface: the same calls and results as ``CachedTarget`` (see there), the model's own
    forward with ``ATTN_NAME`` as its attention. ``kv(i)`` is layer i's (K [B,nkv,S,dk],
    V [B,nkv,S,dv]); sliding-window layers keep a full-length cache (simple, not lean)."""

    def __init__(
        self,
        model,
        aux_layer_ids,
        max_seq_len: int,
        batch_size: int = 1,
        dtype=None,
        options: EngineOptions | None = None,
    ):
        super().__init__()
        _check_config(model)
        options = (options or EngineOptions()).check_resolved()
        self.model, self.config = model, model.config  # a plain reference: weights are shared
        self.embed = model.get_input_embeddings()
        self.layers = decoder_layers(model)
        self.aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, len(self.layers))
        self.check_dtype(self.embed.weight.dtype, dtype)
        self._keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._configs = list(
            {
                id(m.config): m.config
                for m in model.modules()
                if hasattr(getattr(m, "config", None), "_attn_implementation")
            }.values()
        )
        self._call, self._checking = None, False
        shapes = self._probe_shapes()
        self.k = [
            torch.zeros(batch_size, nk, int(max_seq_len), dk, dtype=dt, device=dev) for nk, dk, _, _, dt, dev in shapes
        ]
        self.v = [
            torch.zeros(batch_size, nv, int(max_seq_len), dv, dtype=dt, device=dev) for _, _, nv, dv, dt, dev in shapes
        ]
        self._setup(options, max_seq_len, batch_size, self.embed.weight.device)
        if self._warm_up():  # a feature was turned off: make the static functions again
            self._setup(self.options, max_seq_len, batch_size, self.device)

    def kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    @contextmanager
    def _pass(self):
        """The model's attention is ours for one forward; every config gets its own back."""
        old = [c._attn_implementation for c in self._configs]
        for c in self._configs:
            c._attn_implementation = ATTN_NAME
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.pop()
            for c, o in zip(self._configs, old):
                c._attn_implementation = o

    @torch.no_grad()
    def _probe_shapes(self) -> list[tuple]:
        """One token through the model, recording each layer's K/V shapes; refuses layers that
        do not reach the attention function, or reach it with arguments it would not apply."""
        self._probe: dict | None = {}
        dev = self.embed.weight.device
        one = torch.zeros(1, 1, dtype=torch.long, device=dev)
        try:
            with self._pass():
                self.model(input_ids=one, position_ids=one, use_cache=False)
        finally:
            probe, self._probe = self._probe, None
        missing = [i for i in range(len(self.layers)) if i not in probe]
        if missing:
            raise UnsupportedArchitecture(
                f"{_arch(self.model)}: decoder layers {missing} do not route attention through transformers' "
                "AttentionInterface (recurrent or linear-attention layers, or a model without the interface)"
            )
        return [probe[i] for i in range(len(self.layers))]

    def _record(self, i, q, k, v, kwargs):
        name = _arch(self.model)
        if not isinstance(i, int) or i in self._probe:
            raise UnsupportedArchitecture(f"{name}: an attention call without its own layer_idx ({i!r})")
        extra = sorted(
            n
            for n, val in kwargs.items()
            if val is not None and not isinstance(val, bool) and n not in APPLIED | IGNORED
        )
        if extra:
            raise UnsupportedArchitecture(
                f"{name}: layer {i}'s attention passes {extra}, which the engine does not apply"
            )
        if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
            raise UnsupportedArchitecture(
                f"{name}: layer {i} has {q.shape[1]} query heads over {k.shape[1]} key and {v.shape[1]} value heads"
            )
        self._probe[i] = (k.shape[1], k.shape[-1], v.shape[1], v.shape[-1], k.dtype, k.device)
        return q.new_zeros(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]), None

    def attend(self, module, q, k, v, scaling, kwargs):
        """The registered attention function's work for layer ``module.layer_idx``."""
        i = getattr(module, "layer_idx", None)
        if self._probe is not None:
            return self._record(i, q, k, v, kwargs)
        ks, vs, cache_positions, _, _, _ = self._call
        kc, vc = ks[i], vs[i]
        slots = cache_positions.to(kc.device)
        write = write_kv_in_place if torch.compiler.is_compiling() else write_kv
        write(kc, slots, k)
        write(vc, slots, v)
        mask = self._mask(kwargs.get("sliding_window"), kc.device)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
        if sinks is None and softcap is None and self.attention == "sdpa":
            o = torch.nn.functional.scaled_dot_product_attention(
                q, kc, vc, attn_mask=row_mask(mask), scale=scale, enable_gqa=kc.shape[1] != q.shape[1]
            )
        else:
            o = matmul_attention(q, kc, vc, mask, scale, self.attention == "exact", sinks, softcap)
        return o.transpose(1, 2), None

    def _mask(self, window, device):
        """The caller's mask and, for a sliding layer, only slots > position - window. Slots stand
        in for key positions: a committed slot holds its own position, and a tree node's slot is
        at or after its position, so the window never drops a node the tree mask lets in."""
        _, _, _, positions, attn_mask, made = self._call
        key = (window, device)
        if key not in made:
            mask = attn_mask.to(device)
            if window is not None and window < mask.shape[-1]:  # the mask's width: a prefill's scratch is narrower
                slots = torch.arange(mask.shape[-1], device=device)
                mask = mask & (slots > positions.to(device)[..., None] - window)
            made[key] = mask
        return made[key]

    def _run(self, input_ids, positions, cache_positions, attn_mask, compiled: bool, kv=None, last=None):
        """As ``CachedTarget._run``; ``compiled``: the whole forward as one compiled step."""
        q = input_ids.shape[1]
        input_ids, positions, cache_positions, attn_mask = self.pad_queries(
            input_ids, positions, cache_positions, attn_mask
        )
        ks, vs = kv if kv is not None else (self.k, self.v)
        keep = {"logits_to_keep": last} if last is not None and self._keep_logits else {}
        # A copy: callers may pass one tensor as both positions and slots (a plain step), and the
        # compiler, tracing such a call, reads the slots from the positions ever after (the
        # attention function reaches them outside the step's arguments, unguarded): a tree's
        # nodes, whose slots differ from their positions, then overwrote each other's K/V.
        self._call = (ks, vs, cache_positions.clone(), positions, attn_mask, {})
        try:
            logits, states = self._step(compiled, self.model, input_ids, positions, self.aux_layer_ids, keep)
        finally:
            self._call = None
        if last is None:
            logits = logits[:, :q]
        elif keep:  # row r's hidden states at every row's index: row r wants its own, [r, r]
            rows = torch.arange(len(last), device=logits.device)
            logits = logits[rows, rows][:, None]
        else:
            logits = logits.gather(1, last.to(logits.device)[:, None, None].expand(-1, 1, logits.shape[-1]))
        aux = torch.cat([s[:, :q].to(self.device) for s in states], dim=-1)
        return logits.to(self.device), aux

    def _step(self, compiled: bool, *args):
        """``model_step`` in this engine's pass, compiled when asked. A compile that fails turns
        compile off and the pass reruns eager, repeating the same cache writes; not inside a
        graph capture (it cannot be redone) or the host-sync check (the failure is its answer)."""
        with self._pass():
            if compiled and self.compile:
                try:
                    return compile_once(model_step)(*args)
                except Exception as e:  # whatever the compiler raised, eager is the answer
                    if self._checking or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                        raise
                    self._without("compile", "compiling its forward failed", e)
            return model_step(*args)

    def _without(self, feature: str, why: str, error: BaseException) -> None:
        """Turn ``feature`` ("compile" or "cuda_graphs") off for this target, saying why in one line."""
        first = (str(error).strip().splitlines() or [""])[0][:300]
        log.warning(
            "%s: the general engine path runs without %s: %s (%s: %s)",
            _arch(self.model),
            feature,
            why,
            type(error).__name__,
            first,
        )
        self.options = dataclasses.replace(self.options, **{feature: False})
        self.compile, self.cuda_graphs = self.options.compile, self.options.cuda_graphs

    @torch.no_grad()
    def _warm_up(self) -> bool:
        """One decode-shaped pass (query_pad wide, as the GPU's decode passes are) before any graph
        is made: compiles, and finds a failing compile or a host sync in the forward (CUDA's sync
        debug mode). It writes slots 0..q-1, which a prefill writes before anything reads them.
        Returns whether a feature was turned off."""
        graphs = self.cuda_graphs and self.device.type == "cuda"
        if not (self.compile or graphs):
            return False
        before = self.options
        pos = torch.arange(max(1, self.query_pad), device=self.device).expand(self.batch_size, -1)
        args = (torch.zeros_like(pos), pos, pos, self.cols[None, None] <= pos[..., None])
        self.decode(*args)
        if graphs:
            self._checking = True
            try:
                with host_syncs_raise():
                    self.decode(*args)
            except RuntimeError as e:
                self._without("cuda_graphs", "its forward waits on the device (a host sync)", e)
            finally:
                self._checking = False
        return self.options != before

    @torch.no_grad()
    def prefill_rows(self, rows: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor):
        """As ``CachedTarget.prefill_rows``: through a scratch cache of the prompts' width."""
        g, t = input_ids.shape
        width = max(t, self.query_pad)
        kv = tuple(
            [torch.zeros(g, c.shape[1], width, c.shape[3], dtype=c.dtype, device=c.device) for c in bufs]
            for bufs in (self.k, self.v)
        )
        pos = torch.arange(t, device=self.device)
        logits, aux = self._run(input_ids, pos, pos, causal_mask(0, t, width, self.device), False, kv, lengths - 1)
        for bufs, scratch in zip((self.k, self.v), kv):
            for c, s in zip(bufs, scratch):
                c[rows.to(c.device), :, :t] = s[:, :, :t]
        return logits, aux

    def gather_kv(self, src):
        """As ``CachedTarget.gather_kv``, one tensor per layer: (K rows per layer, V rows per layer)."""
        return tuple(tuple(_gather(c, src.to(c.device)) for c in bufs) for bufs in (self.k, self.v))

    def scatter_kv(self, dst, k_rows, v_rows):
        for bufs, rows in ((self.k, k_rows), (self.v, v_rows)):
            for c, r in zip(bufs, rows):
                slots = dst.to(c.device)
                if slots.dim() == 1:
                    c.index_copy_(2, slots, r)
                else:
                    c.scatter_(2, _slot_index(c, slots), r)
        return ()


@torch.library.custom_op("draftling::write_kv", mutates_args=("cache",))
def write_kv_in_place(cache: torch.Tensor, cache_positions: torch.Tensor, rows: torch.Tensor) -> None:
    """``write_kv`` as one opaque op for the compiler: traced as plain ops, inductor writes into
    a copy of the whole cache and copies that back, every layer of every pass."""
    write_kv(cache, cache_positions, rows)


@write_kv_in_place.register_fake
def _(cache, cache_positions, rows) -> None:
    return None


def model_step(model, input_ids, positions, aux_ids, keep):
    """The model's own forward: (logits, [output of decoder layer i - 1 for i in aux_ids]). One
    function for eager and compiled passes (the aux hooks trace into the compiled graph)."""
    with recording_aux_states(model, aux_ids) as calls:
        logits = model(input_ids=input_ids, position_ids=positions, use_cache=False, **keep).logits
    return logits, [calls[i][-1] for i in aux_ids]


@contextmanager
def host_syncs_raise():
    """CUDA work in the block raises at the first host sync (``.item()``, ``nonzero``, a
    blocking copy): what a CUDA graph capture cannot hold."""
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


def _slot_index(cache, slots):
    """[B,p] slots -> a gather/scatter index into one layer's [B, nkv, S, d]."""
    return slots[:, None, :, None].expand(-1, cache.shape[1], -1, cache.shape[3])


def _gather(cache, slots):
    return cache.index_select(2, slots) if slots.dim() == 1 else cache.gather(2, _slot_index(cache, slots))


def fast_path_refusal(model, max_seq_len: int) -> str | None:
    """Why the fast Llama-family ``CachedTarget`` cannot serve ``model``; None when it can."""
    try:
        _check_architecture(model, max_seq_len)
    except UnsupportedArchitecture as e:
        return str(e)
    return None


def build_target(
    model,
    aux_layer_ids,
    max_seq_len: int,
    dtype=None,
    batch_size: int = 1,
    options: EngineOptions | None = None,
    **engine,
) -> TargetEngine:
    """The engine for ``model``: the fast ``CachedTarget`` where it applies, else the general
    path (which raises ``UnsupportedArchitecture`` with the reason when it cannot serve either).
    Arguments as ``CachedTarget.from_hf``."""
    devices = dispatched_devices(model)
    if devices:  # its cache and graphs live on one device; accelerate's hooks would move weights per call
        raise UnsupportedArchitecture(
            f"{type(model).__name__}: spread over {', '.join(map(str, devices))} by a "
            "device map; the engine runs a target on one device"
        )
    options = EngineOptions.of(options, **engine)
    why = fast_path_refusal(model, max_seq_len)
    if why is None:
        return CachedTarget(model, aux_layer_ids, max_seq_len, batch_size, dtype, options)
    log.info("general engine path: %s", why)
    return GeneralCachedTarget(model, aux_layer_ids, max_seq_len, batch_size, dtype, options)
