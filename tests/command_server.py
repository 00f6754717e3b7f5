"""Run many `draftling` commands as processes of their own without paying Python's, torch's and
transformers' imports for each: a server process imports them once, then forks one child per
command. A child is a process as `python -m draftling` would be: its own cwd, stdout and stderr
(files), and an exit status from `draftling.cli.main` (an uncaught exception prints its traceback
and exits 1, as the interpreter does).

The server imports but runs no torch op before forking, so no thread pool exists to be copied
half-locked into a child. Used by tests whose cases are dozens of short commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
PRELOAD = ("torch", "transformers", "safetensors.torch", "draftling.cli", "draftling.target.load")


class CommandServer:
    """``run(argv, cwd)`` -> (exit status, stdout, stderr); thread-safe, ``jobs`` at once."""

    def __init__(self, env_extra: dict | None = None, jobs: int = 2):
        env = {**os.environ, **(env_extra or {})}
        env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT / "src"), str(CHECKOUT)])
        cmd = [sys.executable, "-m", "tests.command_server", str(jobs)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._lock, self._done, self._next, self._ended = threading.Lock(), {}, 0, False
        self._cond = threading.Condition(self._lock)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:  # type: ignore[union-attr]
            msg = json.loads(line)
            with self._cond:
                self._done[msg["id"]] = msg["exit"]
                self._cond.notify_all()
        with self._cond:  # the server ended: wake every waiter
            self._ended = True
            self._cond.notify_all()

    def run(self, argv: list, cwd: Path, timeout: float = 300) -> tuple[int, str, str]:
        cwd = Path(cwd)
        out, err = cwd.parent / f".{cwd.name}.stdout", cwd.parent / f".{cwd.name}.stderr"
        with self._cond:
            job, self._next = self._next, self._next + 1
            msg = {"id": job, "argv": [str(a) for a in argv], "cwd": str(cwd), "out": str(out), "err": str(err)}
            self._proc.stdin.write(json.dumps(msg) + "\n")  # type: ignore[union-attr]
            self._proc.stdin.flush()  # type: ignore[union-attr]
            if not self._cond.wait_for(lambda: job in self._done or self._ended, timeout):
                raise TimeoutError(f"draftling {' '.join(msg['argv'])} ran over {timeout} s")
            if job not in self._done:
                raise RuntimeError("the command server ended")
            code = self._done.pop(job)
        text = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        return code, *text

    def close(self) -> None:
        self._proc.stdin.close()  # type: ignore[union-attr]
        self._proc.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _child(msg: dict) -> None:
    """In the forked child: become the command, then leave without running the server's code."""
    code = 1
    try:
        os.chdir(msg["cwd"])
        for fd, path in ((1, msg["out"]), (2, msg["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        from draftling.cli import main

        try:
            code = main(msg["argv"])
        except SystemExit as e:  # argparse's errors, sys.exit inside a command
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def _serve(jobs: int) -> None:
    """Read commands (JSON lines) from stdin, at most ``jobs`` children at once; report each
    exit as it happens (stdin is polled, so a finished child is never left waiting on input)."""
    import importlib
    import select

    for name in PRELOAD:
        importlib.import_module(name)
    running: dict[int, int] = {}  # pid -> job id
    queue: list[dict] = []
    buf, stdin_open = b"", True
    while stdin_open or queue or running:
        if stdin_open and select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 65536)
            stdin_open = bool(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            queue += [json.loads(x) for x in lines if x.strip()]
        elif not stdin_open and running and not queue:
            _report(running, block=True)
        while queue and len(running) < jobs:
            msg = queue.pop(0)
            pid = os.fork()
            if pid == 0:
                _child(msg)
            running[pid] = msg["id"]
        _report(running, block=False)


def _report(running: dict, block: bool) -> None:
    while running:
        pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        print(json.dumps({"id": running.pop(pid), "exit": os.waitstatus_to_exitcode(status)}), flush=True)
        block = False


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
