"""The target checkpoint's fingerprint: what a head was trained against, so that a head is
never served on a target that only looks the same (a retrained checkpoint, another tokenizer).

``config``: a hash of the architecture fields that decide the hidden states a head reads;
``tokenizer``: a hash of the vocabulary and the chat template. Weights are not hashed (a GGUF
of the same checkpoint dequantizes to other values, and hashing gigabytes is slow)."""

from __future__ import annotations

import hashlib
import json

CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "intermediate_size", "head_dim", "rope_theta", "max_position_embeddings",
                 "tie_word_embeddings")


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_hash(config) -> str:
    return _digest({k: getattr(config, k, None) for k in CONFIG_FIELDS})


def tokenizer_hash(tokenizer) -> str:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return _digest({"vocab": sorted(vocab.items()), "chat_template": getattr(tokenizer, "chat_template", None)})


def fingerprint(config, tokenizer=None) -> dict:
    out = {"config": config_hash(config)}
    if tokenizer is not None:
        out["tokenizer"] = tokenizer_hash(tokenizer)
    return out
