"""Whether a training run fits one GPU: the teacher's memory from its config alone (its weights,
a device map's split of them, its forward's working memory) beside the draft's step
(memory.py), with the run config resolved as the trainer resolves it on CUDA. ``plan_run`` is
what ``draftling plan`` prints (cli/plan_text.py); ``fast_settings_fit`` is train.memory_policy=auto's
rule, which the trainer applies with the memory it finds free.

The teacher's weights: param count from its config x bytes per param of the run's dtype (a GGUF
file is dequantized to that dtype by transformers on load) or of its on-load quantization
(~4.5 bits for 4-bit, ~8.5 for 8-bit; embedding and head stay unquantized).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from draftling.dtypes import DTYPES, dtype_bytes, dtype_name
from draftling.train.memory import GIB, BlockShape, DraftShape, MemoryOptions, estimate_train_memory

# Bits per quantized weight including scales (e.g. nf4 with blockwise absmax ~ 4.5).
QUANT_BITS = {"bnb-4bit": 4.5, "quanto-int4": 4.5, "bnb-8bit": 8.5, "quanto-int8": 8.5, "torchao-int8": 8.5}
# What max_memory_allocated does not see but the device still needs: the CUDA context and
# the caching allocator's fragmentation.
RESERVE_FIXED_BYTES = int(0.5 * GIB)
RESERVE_SHARE = 0.05
# A dflash head's memory policy, here and in the trainer (run_memory_policy).
BLOCK_POLICY = "as configured (a dflash head has no recompute or loss chunks to choose)"


# --- the teacher -----------------------------------------------------------------------------


def _first(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def target_param_counts(config) -> dict[str, int]:
    """Params of an HF causal LM from its config: embedding, output head (0 when tied) and
    the decoder layers (dense or mixture-of-experts MLPs, biases where the config has them)."""
    c = getattr(config, "text_config", None) or config
    h, layers, v = c.hidden_size, c.num_hidden_layers, c.vocab_size
    nh = c.num_attention_heads
    nkv = _first(c, "num_key_value_heads", default=nh)
    d = _first(c, "head_dim", default=h // nh)
    model_type = getattr(c, "model_type", "")
    attn = 2 * h * nh * d + 2 * h * nkv * d
    if getattr(c, "attention_bias", False):  # Llama-style: on all four projections
        attn += nh * d + 2 * nkv * d + h
    elif model_type in ("qwen2", "qwen2_moe"):  # q/k/v biases, not configurable
        attn += nh * d + 2 * nkv * d
    if model_type.startswith("qwen3"):  # per-head RMSNorm of q and k
        attn += 2 * d
    dense_mlp = 3 * h * c.intermediate_size + (2 * c.intermediate_size + h if getattr(c, "mlp_bias", False) else 0)
    experts = _first(c, "num_local_experts", "num_experts", "n_routed_experts")
    if experts:
        moe_i = _first(c, "moe_intermediate_size", default=c.intermediate_size)
        shared = _first(c, "n_shared_experts", default=0) * 3 * h * moe_i
        shared += 3 * h * _first(c, "shared_expert_intermediate_size", default=0)
        moe_mlp = experts * 3 * h * moe_i + h * experts + shared
        n_dense = min(layers, _first(c, "first_k_dense_replace", default=0))
        mlp = n_dense * dense_mlp + (layers - n_dense) * moe_mlp
    else:
        mlp = layers * dense_mlp
    tied = getattr(config, "tie_word_embeddings", getattr(c, "tie_word_embeddings", False))
    return {
        "embedding": v * h,
        "lm_head": 0 if tied else v * h,
        "layers": layers * (attn + 2 * h) + mlp,
        "final_norm": h,
    }


def teacher_weight_bytes(config, dtype: str, quantization: str | None = None, bits: float | None = None) -> int:
    """Device bytes of the teacher's weights. A GGUF target is dequantized by transformers on
    load, so it takes ``dtype`` bytes per param like any other. ``quantization`` (the run's
    on-load quantization) or ``bits`` set the bits of the decoder weights; the embedding and
    output head stay in ``dtype`` (the quantizers skip them)."""
    counts = target_param_counts(config)
    dense = dtype_bytes(dtype)
    bits = _decoder_bits(quantization, bits)
    if bits is None:
        return sum(counts.values()) * dense
    kept = counts["embedding"] + counts["lm_head"] + counts["final_norm"]
    return int(counts["layers"] * bits / 8 + kept * dense)


def _decoder_bits(quantization: str | None, bits: float | None) -> float | None:
    """Bits per decoder weight: ``bits``, else the on-load quantization's, else None (the dtype's)."""
    if bits is None and quantization:
        bits = QUANT_BITS.get(quantization)
        if bits is None:
            raise ValueError(f"quantization {quantization!r}: no bits-per-weight estimate; pass bits")
    return bits


@dataclass(frozen=True)
class TeacherSplit:
    """Where a device map puts the teacher's weights (``device_map``, target/devmap.py)."""

    source: str  # the run config's device_map
    by_device: dict  # {GPU index, "cpu" or "disk": bytes}
    training_device: int  # the GPU the draft trains on
    # The largest module's weights that stream through the training device per call: accelerate
    # offloads a GPU map's "cpu" and "disk" modules and runs them there, one module at a time.
    streamed: int

    @property
    def on_training_device(self) -> int:
        return self.by_device.get(self.training_device, 0)


def teacher_split(cfg, target_config, gpu_bytes: int, bits: float | None = None) -> TeacherSplit:
    """The teacher's bytes per device under ``cfg.device_map``: a FILE as it is; auto and balanced
    as accelerate infers them, over ``cfg.max_memory`` or (unset) 90% of one GPU of ``gpu_bytes``
    (what transformers leaves itself on a lone GPU) and then host RAM. Params by the dtype, decoder
    weights by the quantization's bits as ``teacher_weight_bytes`` counts them."""
    from draftling.config import device_map_value, device_name, max_memory_bytes
    from draftling.target.aux import decoder_layers
    from draftling.target.devmap import empty_model, expand_device_map, infer_device_map
    from draftling.target.load import DTYPES

    dtype = cfg.dtype if cfg.dtype in DTYPES else "float32"
    gpu = device_name(cfg.device, "device") if str(cfg.device).startswith("cuda") else 0
    model = empty_model(target_config, DTYPES[dtype])
    device_map = device_map_value(cfg.device_map)
    if isinstance(device_map, str):
        budget = max_memory_bytes(cfg.max_memory) or {gpu: int(0.9 * gpu_bytes), "cpu": 2**60}
        # accelerate warns of each GPU in the budget this machine lacks: planning, that is expected.
        quiet = logging.getLogger("accelerate.utils.modeling")
        level, _ = quiet.level, quiet.setLevel(logging.ERROR)
        try:
            device_map = infer_device_map(model, device_map, budget)
        finally:
            quiet.setLevel(level)
    placed = expand_device_map(model, device_map, cfg.device_map)
    layers = {id(p) for p in decoder_layers(model).parameters()}
    bits = _decoder_bits(getattr(cfg, "quantization", None), bits)
    by_device: dict = {}
    by_module: dict = {}
    for name, p in model.named_parameters():
        size = int(p.numel() * (bits / 8 if bits is not None and id(p) in layers else dtype_bytes(dtype)))
        by_device[placed[name]] = by_device.get(placed[name], 0) + size
        if placed[name] in ("cpu", "disk"):
            by_module[name.rpartition(".")[0]] = by_module.get(name.rpartition(".")[0], 0) + size
    runs_on_gpu = any(isinstance(d, int) for d in by_device)  # else accelerate runs it on the CPU
    return TeacherSplit(cfg.device_map, by_device, gpu, max(by_module.values(), default=0) if runs_on_gpu else 0)


def teacher_forward_bytes(config, batch: int, seq: int, draft_vocab: int, dtype: str, chunk_tokens: int = 2048) -> int:
    """Working memory of ``teacher_forward`` (no grad, no KV cache): one decoder layer's
    temporaries, or the output head's chunk of full-vocab logits and the draft-vocab rows."""
    c = getattr(config, "text_config", None) or config
    e = dtype_bytes(dtype)
    tok = batch * seq
    nh = c.num_attention_heads
    d = _first(c, "head_dim", default=c.hidden_size // nh)
    nkv = _first(c, "num_key_value_heads", default=nh)
    inter = (
        _first(c, "moe_intermediate_size", default=c.intermediate_size)
        if _first(c, "num_local_experts", "num_experts", "n_routed_experts")
        else c.intermediate_size
    )
    layer = tok * e * (3 * c.hidden_size + 2 * nh * d + 2 * nkv * d + 3 * inter)
    head = min(chunk_tokens, tok) * (c.vocab_size * e + 8) + draft_vocab * c.hidden_size * e
    assemble = tok * draft_vocab * 2 * e  # chunks, then their concatenation
    aux_capture = 3 * tok * c.hidden_size * e
    return int(max(layer, head, assemble) + aux_capture)


# --- resolving a run config ------------------------------------------------------------------


@dataclass(frozen=True)
class FastFit:
    """``fast_settings_fit``'s answer."""

    config: object  # the fast TrainConfig (settings.fast_train_config)
    options: MemoryOptions  # its memory options
    need: int  # the draft's estimated peak with them, bytes
    fits: bool  # within FAST_MEMORY_SHARE of the free memory


def fast_settings_fit(tc, shape: DraftShape, batch: int, free_bytes: int, options_for) -> FastFit:
    """train.memory_policy=auto's rule, the one both the trainer (``free_bytes`` queried once the
    teacher is loaded) and ``plan_run`` (the GPU's size less the teacher's weights) apply: train
    with the fast settings (no recompute, large loss chunks) when the draft's estimated peak
    with them stays within FAST_MEMORY_SHARE of ``free_bytes``. ``options_for(fast)``: the fast
    config's (MemoryOptions, sequence length) as the caller resolves them."""
    from draftling.train.settings import FAST_MEMORY_SHARE, fast_train_config

    fast = fast_train_config(tc)
    options, seq = options_for(fast)
    need = estimate_train_memory(shape, batch, seq, tc.ttt_steps, options)["total"]
    return FastFit(fast, options, need, need <= FAST_MEMORY_SHARE * free_bytes)


def resolve_options(tc, gpu_bytes: int, n_params: int, embed_dtype: str) -> MemoryOptions:
    """The trainer's choices for one CUDA process (train/settings.py), with the device's size
    given instead of queried."""
    from draftling.train.settings import draft_param_dtype, memory_options, optimizer_offload

    offload = optimizer_offload(tc, "cuda", n_params, device_bytes=gpu_bytes)
    dtype = draft_param_dtype(tc, "cuda", n_params, device_bytes=gpu_bytes)
    mem = memory_options(tc, "cuda", param_dtype=dtype)
    draft_dtype = dtype_name(dtype)
    return MemoryOptions.from_unroll_options(
        mem,
        optimizer_offload=offload,
        draft_dtype=draft_dtype,
        embed_dtype=embed_dtype,
        embedding_on_host=tc.embedding_on_host,
    )


def plan_run(
    cfg,
    target_config,
    gpu_bytes: int,
    seq: int,
    batch: int,
    *,
    offline: bool = False,
    teacher_bits: float | None = None,
    split: TeacherSplit | None = None,
) -> dict:
    """The estimate for ``draftling train`` with this run config on one GPU of ``gpu_bytes``. With
    ``cfg.device_map`` only the teacher's share on that GPU counts (``split``: computed if None)."""
    embed_dtype = cfg.dtype if cfg.dtype in DTYPES else "float32"
    shape = draft_shape(cfg, target_config)
    quantization = getattr(cfg, "quantization", None)
    if cfg.device_map and split is None:
        split = teacher_split(cfg, target_config, gpu_bytes, teacher_bits)
    weights = (
        split.on_training_device
        if split
        else teacher_weight_bytes(target_config, embed_dtype, quantization, teacher_bits)
    )
    policy, options = _planned_options(cfg.train, shape, batch, seq, gpu_bytes, weights, embed_dtype)
    forward = 0 if offline else teacher_forward_bytes(target_config, batch, seq, shape.draft_vocab, embed_dtype)
    forward += split.streamed if split and not offline else 0
    est = estimate_train_memory(
        shape,
        batch,
        seq,
        cfg.train.ttt_steps,
        options,
        teacher_weight_bytes=weights,
        teacher_forward_bytes=forward,
        embedding_in_teacher=True,
    )
    reserve = RESERVE_FIXED_BYTES + int(RESERVE_SHARE * est["total"])
    return {
        "shape": shape,
        "options": options,
        "estimate": est,
        "reserve": reserve,
        "gpu_bytes": gpu_bytes,
        "headroom": gpu_bytes - est["total"] - reserve,
        "fits": est["total"] + reserve <= gpu_bytes,
        "batch": batch,
        "seq": seq,
        "teacher_params": sum(target_param_counts(target_config).values()),
        "policy": policy,
        "quantization": quantization,
        "teacher_dtype": embed_dtype,
        "split": split,
    }


def draft_shape(cfg, target_config) -> DraftShape:
    """The head ``build_draft`` would build: an EAGLE-3 layer of the target's width, or a dflash
    head's shape from the config ``build_block_draft`` gives it (block: ttt_steps + 1)."""
    if cfg.draft.method == "dflash":
        from draftling.draft.block import block_config_from_target
        from draftling.target.aux import default_aux_layer_ids
        from draftling.train.block_loss import MAX_ANCHORS

        c = getattr(target_config, "text_config", None) or target_config
        vocab, ids = min(cfg.vocab.size, c.vocab_size), cfg.aux_layer_ids or default_aux_layer_ids(c.num_hidden_layers)
        mask = cfg.draft.mask_token_id or 0  # any token: it does not change the shape
        config = block_config_from_target(c, vocab, ids, cfg.train.ttt_steps + 1, cfg.draft.layers, mask)
        if cfg.draft.intermediate_size:
            config.intermediate_size = cfg.draft.intermediate_size
        return BlockShape.from_block_config(config, MAX_ANCHORS)
    shape = DraftShape.from_config(target_config, cfg.vocab.size, cfg.draft.window)
    if cfg.draft.intermediate_size:  # the draft's own MLP width (lab/configs/gpu_smollm2.yaml: 4096)
        shape = dataclasses.replace(shape, intermediate=cfg.draft.intermediate_size)
    return shape


def _planned_options(tc, shape: DraftShape, batch: int, seq: int, gpu_bytes: int, weights: int, embed_dtype: str):
    """The memory policy's name and the resolved memory options the run would train with."""
    if isinstance(shape, BlockShape):
        # The block loss has no recompute, loss chunks, flex or compile to choose (memory.py):
        # those options read as what it runs, and memory_policy has nothing to change.
        options = resolve_options(tc, gpu_bytes, shape.num_params(), embed_dtype)
        off = {"grad_checkpoint": False, "loss_chunk_tokens": 0, "compile": False, "compile_layer": False}
        return BLOCK_POLICY, dataclasses.replace(options, attention="sdpa", **off)
    policy, options = "as configured", None
    if tc.memory_policy == "auto":
        # The trainer's rule, with the memory free after loading the teacher taken as the GPU's
        # size less the teacher's weights.
        fast = fast_settings_fit(
            tc,
            shape,
            batch,
            gpu_bytes - weights - RESERVE_FIXED_BYTES,
            lambda fast: (resolve_options(fast, gpu_bytes, shape.num_params(), embed_dtype), seq),
        )
        if fast.fits:
            tc, policy, options = fast.config, "fast (memory_policy auto: it fits without recompute)", fast.options
    options = options or resolve_options(tc, gpu_bytes, shape.num_params(), embed_dtype)
    return policy, options


def largest_fitting_batch(
    cfg,
    target_config,
    gpu_bytes: int,
    seq: int,
    offline: bool = False,
    teacher_bits: float | None = None,
    limit: int = 4096,
) -> int:
    """The largest batch size that fits at this sequence length (0 if none)."""
    split = teacher_split(cfg, target_config, gpu_bytes, teacher_bits) if cfg.device_map else None

    def fits(b: int) -> bool:
        return plan_run(cfg, target_config, gpu_bytes, seq, b, offline=offline, teacher_bits=teacher_bits, split=split)[
            "fits"
        ]

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


__all__ = [
    "teacher_weight_bytes",
    "teacher_split",
    "TeacherSplit",
    "target_param_counts",
    "teacher_forward_bytes",
    "plan_run",
    "draft_shape",
    "largest_fitting_batch",
    "fast_settings_fit",
    "resolve_options",
]
