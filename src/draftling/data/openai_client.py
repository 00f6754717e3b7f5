"""Regenerate replies through an OpenAI-compatible server (`vllm serve`, SGLang) instead of the
local target: a user who already serves the target gets its replies at serving speed.

Only the standard library is used (urllib, a thread pool), so no `openai` package is needed.
Each conversation is one POST to ``/v1/chat/completions`` with its messages up to the
assistant turn; the records it yields have the shape of :func:`draftling.data.regen.regenerate`'s,
with the server's URL and served model in the provenance instead of the local target.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from draftling.config import RegenConfig
from draftling.data.prompts import Conversation, prompt_messages, reply_record
from draftling.data.regen import render_prompt_ids
from draftling.errors import DraftlingError
from draftling.progress import Progress

log = logging.getLogger(__name__)

# The server's finish_reason -> our `stopped`. A tool call ends the turn like an eos does.
FINISH_REASONS = {"stop": "eos", "tool_calls": "eos", "length": "length"}
# Seconds before the first retry; doubled per attempt, capped at RETRY_MAX_WAIT_S.
RETRY_BACKOFF_S = 1.0
RETRY_MAX_WAIT_S = 30.0


class ServerError(DraftlingError):
    """The server refused a request, or could not be reached after the retries."""


def normalize_base_url(url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` all name one server."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ServerError(f"--server {url}: expected an http:// or https:// URL")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


class ChatServer:
    """One OpenAI-compatible server. Safe to share between threads: each call opens its own
    connection."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 5,
    ):
        self.base_url = normalize_base_url(base_url)
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.model = model or self._only_served_model()

    @classmethod
    def from_config(cls, cfg: RegenConfig) -> ChatServer:
        if not cfg.server_url:
            raise ServerError("no server: set data.regen.server_url or pass --server URL")
        return cls(
            cfg.server_url,
            cfg.server_model,
            api_key=os.environ.get(cfg.api_key_env) or None,
            timeout_s=cfg.request_timeout_s,
            max_retries=cfg.max_retries,
        )

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        url = self.base_url + path
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.max_retries + 1):
            wait = min(RETRY_BACKOFF_S * 2**attempt, RETRY_MAX_WAIT_S)
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                    raw = resp.read()
                try:
                    return json.loads(raw)
                except json.JSONDecodeError:
                    raise ServerError(f"{url}: the reply is not JSON: {raw[:200]!r}") from None
            except urllib.error.HTTPError as e:
                detail = _error_detail(e)
                # 429 and 5xx are the server being busy or restarting; anything else is our
                # request, and sending it again would fail the same way.
                if e.code != 429 and e.code < 500:
                    raise ServerError(f"{url}: HTTP {e.code}: {detail}") from None
                last = f"HTTP {e.code}: {detail}"
                wait = _retry_after(e) or wait
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt < self.max_retries:
                log.warning("%s: %s; retry %d of %d in %.1fs", url, last, attempt + 1, self.max_retries, wait)
                time.sleep(wait)
        raise ServerError(f"{url}: no answer after {self.max_retries + 1} attempts; last: {last}")

    def _only_served_model(self) -> str:
        # vLLM and SGLang serve one model; then the user need not repeat its name.
        names = [m.get("id") for m in self._request("GET", "/v1/models").get("data", [])]
        names = [n for n in names if n]
        if len(names) != 1:
            raise ServerError(
                f"{self.base_url}/v1/models lists {names or 'no models'}; name the one to use with --server-model"
            )
        return names[0]

    def chat(self, messages: list[dict], cfg: RegenConfig, tools: list | None = None) -> dict:
        """One completion: ``{"content", "finish_reason", "tool_calls"?}``."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "n": 1,
        }
        if cfg.temperature > 0:
            # Match the local sampler (no top-k) rather than the model's generation_config
            # default, and make a rerun reproducible where the server honours a seed.
            body.update(top_k=-1, seed=cfg.seed)
        if tools:
            body["tools"] = [t if "type" in t else {"type": "function", "function": t} for t in tools]
        reply = self._request("POST", "/v1/chat/completions", body)
        try:
            choice = reply["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(
                f"{self.base_url}/v1/chat/completions: unexpected reply {json.dumps(reply)[:300]}"
            ) from None
        out = {"content": message.get("content") or "", "finish_reason": choice.get("finish_reason")}
        if message.get("tool_calls"):
            out["tool_calls"] = message["tool_calls"]
        if message.get("reasoning_content") or message.get("reasoning"):
            out["split_reasoning"] = True
        return out


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        body = e.read().decode("utf-8", "replace")
    except Exception:  # the body is only for the message; a broken one must not hide the status
        body = ""
    try:
        err = json.loads(body)
        msg = err.get("error", err) if isinstance(err, dict) else err
        body = msg.get("message", json.dumps(msg)) if isinstance(msg, dict) else str(msg)
    except (json.JSONDecodeError, AttributeError):
        pass
    return (body.strip() or e.reason or "no detail")[:300]


def _retry_after(e: urllib.error.HTTPError) -> float | None:
    value = e.headers.get("Retry-After") if e.headers else None
    try:
        return min(float(value), RETRY_MAX_WAIT_S) if value else None
    except ValueError:
        return None


def regenerate_via_server(
    tokenizer,
    convs: list[Conversation],
    cfg: RegenConfig,
    max_prompt_tokens: int | None = None,
    progress: bool = True,
    server: ChatServer | None = None,
    journal=None,
) -> Iterable[dict]:
    """Yield one record per conversation, like ``regenerate`` does, with the replies from
    ``cfg.server_url``. The local tokenizer renders the prompts only to count (and cap) their
    tokens and to count the reply's; the server applies its own chat template.

    ``journal`` (data/journal.py): replies it holds are not asked for again; each new one is
    journaled before it is yielded."""
    if cfg.concurrency < 1:
        raise ServerError(f"data.regen.concurrency must be >= 1, got {cfg.concurrency}")
    server = server or ChatServer.from_config(cfg)
    prompts = [(c, len(render_prompt_ids(tokenizer, c))) for c in convs]
    if max_prompt_tokens:
        prompts = [(c, n) for c, n in prompts if n <= max_prompt_tokens]
    bar = Progress(len(prompts), f"regenerate via {server.base_url}", enabled=progress)
    tick, warn_once = _ticker(bar, len(prompts)), _warner(server.base_url)
    pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="regen")
    try:
        futures = []
        for conv, _ in prompts:
            if journal is not None and journal.has_all([conv.id]):
                futures.append(None)
                bar.skip(1)
                continue
            fut = pool.submit(server.chat, prompt_messages(conv), cfg, conv.tools)
            fut.add_done_callback(tick)
            futures.append(fut)
        # Results in input order, so a rerun writes the same file.
        for (conv, n_prompt), fut in zip(prompts, futures):
            if fut is None:
                yield journal.get(conv.id)
                continue
            record = _server_record(tokenizer, server, cfg, conv, n_prompt, fut.result(), warn_once)
            if journal is not None:
                journal.add([record])
            yield record
    finally:
        # On an error, drop the requests not yet sent and do not wait for those in flight.
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()


def _ticker(bar: Progress, total: int) -> Callable[[Future], None]:
    """A request's done-callback: advances ``bar``, with a line every twentieth of ``total``."""
    log_every = max(1, total // 20)
    done = [0]
    lock = threading.Lock()  # done-callbacks run on the worker threads

    def tick(_future: Future) -> None:
        with lock:
            done[0] += 1
            logged = done[0] % log_every == 0 or done[0] == total
            bar.update(1, f"regenerate: {done[0]}/{total} prompts" if logged else None)

    return tick


def _warner(base_url: str) -> Callable[[str], None]:
    """``warn_once(why)``: logs each distinct warning about the server once."""
    warned: set[str] = set()

    def warn_once(why: str) -> None:
        if why not in warned:
            warned.add(why)
            log.warning("%s: %s", base_url, why)

    return warn_once


def _server_record(
    tokenizer,
    server: ChatServer,
    cfg: RegenConfig,
    conv: Conversation,
    n_prompt: int,
    reply: dict,
    warn_once: Callable[[str], None],
) -> dict:
    """The data record of one server reply, warning (once each) where it lost what the target wrote."""
    stopped = FINISH_REASONS.get(reply["finish_reason"], str(reply["finish_reason"]))
    if stopped not in ("eos", "length"):
        warn_once(f"finish_reason {reply['finish_reason']!r} recorded as is in provenance.stopped")
    if reply.get("split_reasoning"):
        # The local target's reply would hold the thinking text; this one does not.
        warn_once(
            "the server split off the reasoning; serve without a reasoning parser so replies keep their thinking text"
        )
    assistant = {"role": "assistant", "content": reply["content"]}
    if "tool_calls" in reply:
        # Kept in OpenAI form, which the local chat template renders (or not) its own way.
        warn_once(
            "the server parsed tool calls out of the reply; serve without a tool-call "
            "parser so they stay in the reply text as the target wrote them"
        )
        assistant["tool_calls"] = reply["tool_calls"]
    reply_tokens = len(tokenizer(reply["content"], add_special_tokens=False)["input_ids"])
    return reply_record(
        conv, assistant, {"server": server.base_url, "server_model": server.model}, cfg, stopped, reply_tokens, n_prompt
    )
