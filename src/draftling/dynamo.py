"""torch.compile settings shared by the trainer, the benches and the decode engine."""

import torch


def allow_recompiles(limit: int = 64) -> None:
    """Raise dynamo's per-function recompile limit (default 8) to at least ``limit``.

    Past the limit a compiled function silently runs eagerly: a training run with many batch
    shapes, or an engine serving several tree configs, would then lose its speed with no error."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))
