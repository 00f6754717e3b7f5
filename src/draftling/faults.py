"""Named fault points for the fault trials (tests/test_faults.py): with
``DRAFTLING_FAULT=NAME:N[:ACTION]`` the N-th time a process passes ``fault_point(NAME)`` it
is SIGKILLed (ACTION ``kill``, the default) or gets an ``OSError(ENOSPC)`` (``enospc``), so a
trial can hit a narrow window, such as between a checkpoint's files and its rename, every time.
Unset, a fault point costs one dict lookup."""

from __future__ import annotations

import errno
import os
import signal

_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get("DRAFTLING_FAULT")
    if not spec:
        return
    want, n, *action = spec.split(":")
    if want != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != int(n):
        return
    if action == ["enospc"]:
        raise OSError(errno.ENOSPC, "No space left on device (injected)", f"fault point {name}")
    os.kill(os.getpid(), signal.SIGKILL)
