"""Fail fast without a network: a hub id that is not cached would otherwise end in a traceback
after a minute of retries."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """None if the Hugging Face hub answers a TCP connect within ``timeout`` seconds, else why not."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        return f"{url.hostname}:{port} cannot be reached ({e.strerror or e})"
    return None


def hub_model_cached(repo_id: str) -> bool:
    """Whether the local HF cache holds this model's config (then from_pretrained needs no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    found = try_to_load_from_cache(repo_id, "config.json")
    return isinstance(found, str)
