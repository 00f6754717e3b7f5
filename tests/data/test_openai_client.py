"""`draftling data --server`: replies from an OpenAI-compatible server, checked against an
in-process fake server (http.server on 127.0.0.1) that answers with canned completions."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from draftling.cli import main
from draftling.config import RegenConfig
from draftling.data import openai_client
from draftling.data.openai_client import ChatServer, ServerError, normalize_base_url, regenerate_via_server
from draftling.data.prompts import Conversation

SERVED = "org/served-model"


class FakeServer:
    """Replies to `/v1/chat/completions` by the last user message: "LONG ..." ends with
    finish_reason "length", "FLAKY ..." fails with a 500 the first time, "BAD ..." gets a 400."""

    def __init__(self, models=(SERVED,)):
        self.models = list(models)
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.seen: dict[str, int] = {}
        self.lock = threading.Lock()  # the server handles requests on several threads
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _send(self, status, body):
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in fake.models]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                user = [m["content"] for m in body["messages"] if m["role"] == "user"][-1]
                with fake.lock:
                    fake.requests.append(body)
                    fake.headers.append(dict(self.headers))
                    fake.seen[user] = fake.seen.get(user, 0) + 1
                if user.startswith("BAD"):
                    return self._send(
                        400,
                        {
                            "object": "error",
                            "message": "messages: bad role order",
                            "type": "BadRequestError",
                            "code": 400,
                        },
                    )
                if user.startswith("FLAKY") and fake.seen[user] == 1:
                    return self._send(500, {"error": {"message": "engine restarting"}})
                finish = "length" if user.startswith("LONG") else "stop"
                self._send(
                    200,
                    {
                        "id": "cmpl-1",
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": finish,
                                "message": {"role": "assistant", "content": f"Answer to: {user}"},
                            }
                        ],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 5},
                    },
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(openai_client, "RETRY_BACKOFF_S", 0.01)


def conv(i: int, text: str, **kw) -> Conversation:
    return Conversation(id=f"c{i}", source="test", category="chat", messages=[{"role": "user", "content": text}], **kw)


def test_normalize_base_url():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert normalize_base_url(url) == "http://h:8000"
    with pytest.raises(ServerError, match="http"):
        normalize_base_url("localhost:8000")


def test_records_retry_and_length(smol_tokenizer):
    convs = [
        conv(0, "Hello there"),
        conv(1, "LONG story please"),
        conv(2, "FLAKY question"),
        conv(3, "Which tool?", tools=[{"name": "f", "parameters": {"type": "object"}}]),
    ]
    cfg = RegenConfig(server_url="", max_new_tokens=7, temperature=0.0, concurrency=3, max_retries=2)
    with FakeServer() as fake:
        server = ChatServer(fake.url + "/v1", timeout_s=10, max_retries=2)
        assert server.model == SERVED  # the only model /v1/models lists
        records = list(regenerate_via_server(smol_tokenizer, convs, cfg, server=server, progress=False))
    assert [r["id"] for r in records] == ["c0", "c1", "c2", "c3"]  # input order
    assert fake.seen["FLAKY question"] == 2  # the 500 was retried
    by_id = {r["id"]: r for r in records}
    assert by_id["c1"]["provenance"]["stopped"] == "length"
    assert by_id["c0"]["provenance"]["stopped"] == "eos"
    assert by_id["c0"]["messages"] == [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Answer to: Hello there"},
    ]
    prov = by_id["c0"]["provenance"]
    assert prov["server"] == fake.url and prov["server_model"] == SERVED and "target" not in prov
    reply_ids = smol_tokenizer("Answer to: Hello there", add_special_tokens=False)["input_ids"]
    assert prov["reply_tokens"] == len(reply_ids)
    assert prov["prompt_tokens"] > 0
    # The request: model, messages up to the assistant turn, the regen parameters.
    body = next(b for b in fake.requests if b["messages"][-1]["content"] == "Hello there")
    assert body["model"] == SERVED and body["max_tokens"] == 7 and body["temperature"] == 0.0
    assert body["top_p"] == 1.0 and "seed" not in body  # greedy: no sampling parameters
    tool_body = next(b for b in fake.requests if b["messages"][-1]["content"] == "Which tool?")
    function = {"name": "f", "parameters": {"type": "object"}}
    assert tool_body["tools"] == [{"type": "function", "function": function}]  # OpenAI's wrapping
    assert by_id["c3"]["tools"] == convs[3].tools  # the record keeps the file's own tool list


def test_bad_request_is_a_clear_error(smol_tokenizer):
    cfg = RegenConfig(server_url="", concurrency=2)
    with FakeServer() as fake:
        server = ChatServer(fake.url, SERVED, max_retries=3)
        with pytest.raises(ServerError) as err:
            list(
                regenerate_via_server(
                    smol_tokenizer, [conv(0, "ok"), conv(1, "BAD one")], cfg, server=server, progress=False
                )
            )
    msg = str(err.value)
    assert f"{fake.url}/v1/chat/completions" in msg and "HTTP 400" in msg and "bad role order" in msg
    assert fake.seen["BAD one"] == 1  # a 4xx is not retried


def test_unreachable_server_gives_up_naming_the_url():
    with FakeServer() as fake:
        url = fake.url  # a port that is closed once the server stops
    with pytest.raises(ServerError, match=rf"{url}/v1/models: no answer after 2 attempts"):
        ChatServer(url, max_retries=1, timeout_s=2)


def test_several_models_need_a_name_and_key_is_sent(monkeypatch, smol_tokenizer):
    monkeypatch.setenv("MY_KEY", "sk-test")
    with FakeServer(models=["a", "b"]) as fake:
        with pytest.raises(ServerError, match="--server-model"):
            ChatServer(fake.url)
        cfg = RegenConfig(server_url=fake.url, server_model="b", api_key_env="MY_KEY", temperature=0.7, seed=3)
        records = list(regenerate_via_server(smol_tokenizer, [conv(0, "hi")], cfg, progress=False))
    assert records[0]["provenance"]["server_model"] == "b"
    assert fake.headers[0]["Authorization"] == "Bearer sk-test"
    assert fake.requests[0]["seed"] == 3 and fake.requests[0]["temperature"] == 0.7


def write_prompts(path, texts):
    path.write_text(
        "".join(
            json.dumps(
                {"id": f"p{i}", "source": "test", "category": "chat", "messages": [{"role": "user", "content": t}]}
            )
            + "\n"
            for i, t in enumerate(texts)
        )
    )
    return path


def test_cli_data_via_server_loads_no_weights(tmp_path, tiny_target_dir, monkeypatch, capsys):
    import transformers

    def no_weights(*args, **kwargs):
        raise AssertionError("draftling data --server must not load the target's weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    texts = [f"Tell me fact number {i} about the sea." for i in range(6)] + ["LONG tale", "FLAKY one"]
    prompts = write_prompts(tmp_path / "prompts.jsonl", texts)
    out = tmp_path / "data"
    with FakeServer() as fake:
        assert (
            main(
                [
                    "data",
                    "--target",
                    str(tiny_target_dir),
                    "--out",
                    str(out),
                    "--prompts",
                    str(prompts),
                    "--server",
                    fake.url,
                    "data.regen.max_new_tokens=16",
                    "data.val_fraction=0.25",
                    "data.min_tokens=4",
                    "data.regen.concurrency=4",
                    "data.keep_teacher_states=true",
                ]
            )
            == 0
        )
    replies = [json.loads(line) for line in (out / "replies.jsonl").read_text().splitlines()]
    assert len(replies) == len(texts) and {r["split"] for r in replies} == {"train", "val"}
    # A server's replies carry no target states: nothing is kept, and the log says why.
    assert not list(out.glob("teacher_states_*")) and "keep_teacher_states is ignored" in capsys.readouterr().out
    assert all(r["provenance"]["server"] == fake.url and r["provenance"]["server_model"] == SERVED for r in replies)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["server"] == fake.url and summary["server_model"] == SERVED
    assert summary["replies_hit_cap"] == 1 and summary["replies_stopped_eos"] == len(texts) - 1
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (out / "val.jsonl").read_text().splitlines()]
    assert len(train) + len(val) == len(texts)
    # The loss mask covers the server's reply, tokenized with the target's own tokenizer.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    row = train[0]
    masked = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert masked.startswith("Answer to: ") and masked.endswith("<|im_end|>")


def test_cli_data_server_error_is_one_line(tmp_path, tiny_target_dir, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["fine", "BAD request"])
    out = tmp_path / "data"
    with FakeServer() as fake:
        assert (
            main(
                [
                    "data",
                    "--target",
                    str(tiny_target_dir),
                    "--out",
                    str(out),
                    "--prompts",
                    str(prompts),
                    "--server",
                    fake.url,
                    "--server-model",
                    SERVED,
                    "data.val_fraction=0",
                ]
            )
            == 2
        )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("draftling: error: ") and "HTTP 400" in err and fake.url in err
    assert not (out / "replies.jsonl").exists()


def test_server_rows_match_local_format(tiny_target_dir, smol_tokenizer):
    """Same record keys as local regeneration; provenance swaps `target` (and the local model's
    `dtype`, which a server does not report) for the server's names."""
    from draftling.data.regen import regenerate
    from draftling.target import load_target

    target = load_target(str(tiny_target_dir), device="cpu")
    cfg = RegenConfig(max_new_tokens=3, batch_size=2)
    convs = [conv(0, "Hello"), conv(1, "Bye")]
    local = list(regenerate(target, convs, cfg, progress=False))
    with FakeServer() as fake:
        cfg.server_url = fake.url
        remote = list(regenerate_via_server(smol_tokenizer, convs, cfg, progress=False))
    assert set(local[0]) == set(remote[0])
    assert local[0]["provenance"]["dtype"] == "float32"
    local_keys = set(local[0]["provenance"]) - {"target", "dtype"}
    assert local_keys == set(remote[0]["provenance"]) - {"server", "server_model"}
