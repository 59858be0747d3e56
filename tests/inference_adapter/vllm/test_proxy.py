"""``kvstore pd-proxy`` between a client and two HTTP servers that answer as vLLM's OpenAI
servers do (the real vLLM pair is in tests/integration): what reaches the prefill and the
decode instance, streaming, and a prefill that is down."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvstore.inference_adapter.vllm.proxy import PDProxy
from kvstore.launch import kvstore_command

HANDOFF = {"kvstore_handoff": {"blocks": 7, "block_tokens": 16}}


class Backend(ThreadingHTTPServer):
    """Records each request; a prefill answers with the hand-off, a decode with its body
    back (streamed in three events when asked)."""

    daemon_threads = True

    def __init__(self, role: str) -> None:
        self.role = role
        self.seen: list[tuple[str, str, dict[str, Any] | None]] = []
        super().__init__(("127.0.0.1", 0), _BackendHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _BackendHandler(BaseHTTPRequestHandler):
    server: Backend

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.seen.append(("GET", self.path, None))
        self._json({"data": [{"id": "m"}], "from": self.server.role})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.seen.append(("POST", self.path, body))
        if self.server.role == "prefill":
            self._json({"choices": [{"text": "x"}], "kv_transfer_params": HANDOFF})
        elif body.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            for event in ("a", "b", "[DONE]"):
                self.wfile.write(f"data: {event}\n\n".encode())
                self.wfile.flush()
        else:
            self._json({"echo": body})

    def _json(self, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serving(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def pair() -> Iterator[tuple[Backend, Backend, PDProxy]]:
    prefill, decode = Backend("prefill"), Backend("decode")
    proxy = PDProxy(("127.0.0.1", 0), [prefill.url], [decode.url])
    for server in (prefill, decode, proxy):
        serving(server)
    yield prefill, decode, proxy
    for server in (prefill, decode, proxy):
        server.shutdown()
        server.server_close()


def call(proxy: PDProxy, method: str, path: str, body: Any = None) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=30)
    data = None if body is None else json.dumps(body)
    connection.request(method, path, data, {"content-type": "application/json"})
    return connection.getresponse()


def test_the_prefill_gets_one_token_and_the_decode_the_request_with_its_hand_off(pair) -> None:
    prefill, decode, proxy = pair
    request = {"model": "m", "prompt": "hello", "max_tokens": 40, "stream": False}
    reply = call(proxy, "POST", "/v1/completions", request)
    assert reply.status == 200
    assert reply.getheader("x-kvstore-handoff") == "blocks=7"
    assert float(reply.getheader("x-kvstore-prefill-ms") or -1) >= 0
    assert json.loads(reply.read())["echo"] == {**request, "kv_transfer_params": HANDOFF}
    ((_, path, asked),) = prefill.seen
    assert path == "/v1/completions"
    assert asked == {"model": "m", "prompt": "hello", "max_tokens": 1}  # not streamed
    chat = {"model": "m", "messages": [], "max_completion_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    reply = call(proxy, "POST", "/v1/chat/completions", chat)
    assert reply.read() == b"data: a\n\ndata: b\n\ndata: [DONE]\n\n"  # streamed through
    assert prefill.seen[1][2] == {"model": "m", "messages": [], "max_completion_tokens": 1,
                                  "max_tokens": 1}  # fmt: skip
    assert decode.seen[1][2] == {**chat, "kv_transfer_params": HANDOFF}
    assert json.loads(call(proxy, "GET", "/v1/models").read())["from"] == "decode"
    assert json.loads(call(proxy, "GET", "/kvstore/proxy").read()) == {
        "requests": 2,
        "handoffs": 2,
    }


def test_a_prefill_that_is_down_costs_the_hand_off_not_the_answer(pair) -> None:
    prefill, _, proxy = pair
    prefill.shutdown()
    prefill.server_close()  # its port refuses from now on
    request = {"model": "m", "prompt": "hello", "max_tokens": 4}
    reply = call(proxy, "POST", "/v1/completions", request)
    assert reply.status == 200 and reply.getheader("x-kvstore-handoff") == "none"
    assert json.loads(reply.read())["echo"] == request  # no hand-off: computed in full
    assert json.loads(call(proxy, "GET", "/kvstore/proxy").read()) == {
        "requests": 1,
        "prefill_failures": 1,
    }
    reply = call(proxy, "POST", "/v1/completions", [1, 2])
    assert reply.status == 400 and b"not a JSON object" in reply.read()


def test_the_command_refuses_a_url_it_cannot_use_by_name() -> None:
    done = subprocess.run(
        kvstore_command("pd-proxy", "--prefill", "ftp://a:1", "--decode", "http://b:2"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--prefill 'ftp://a:1': expected http://HOST:PORT" in done.stdout + done.stderr
