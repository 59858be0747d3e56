"""``kvstore pd-proxy``: prefill/decode disaggregation in front of vLLM's OpenAI servers.

Run a prefill vLLM with the connector as ``kv_producer`` and a decode vLLM as
``kv_consumer``, both on the same daemon (or on two daemons sharing a Redis tier written at
put), then::

    kvstore pd-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

and send OpenAI requests to port 8000. Each ``POST /v1/completions`` or
``/v1/chat/completions`` goes first to a prefill instance with ``max_tokens`` (and
``max_completion_tokens``) 1, not streamed. The prefill's step ended only once its saves
were committed, so its reply means the prompt's KV is readable; the reply's
``kv_transfer_params`` (``kvstore_handoff``: the blocks held) go with the original request
to a decode instance, which loads those blocks and answers the client (streamed or not, as
asked). A prefill that fails or cannot be reached costs the hand-off only: the decode
instance gets the request alone and computes the prompt itself (counted). Every other
request (``/v1/models``, ``/health``, ``/metrics``) goes to a decode instance. Several
``--prefill`` or ``--decode`` URLs are taken in turn.

The reply carries ``x-kvstore-prefill-ms`` (the prefill's round trip) and
``x-kvstore-handoff`` (``blocks=N``, or ``none``); ``GET /kvstore/proxy`` answers the
proxy's counts as JSON. Standard library only: it runs beside vLLM or anywhere else.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

__all__ = ["HANDOFF_PATHS", "PDProxy", "main"]

log = logging.getLogger(__name__)

HANDOFF_PATHS = ("/v1/completions", "/v1/chat/completions")
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
               "proxy-connection", "te", "trailer", "upgrade"}  # fmt: skip
TIMEOUT_S = 600.0  # one backend call, a long generation included
CHUNK_BYTES = 1 << 16


class _Backends:
    """URLs taken in turn."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"pd-proxy needs at least one --{role} URL")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"--{role} {url!r}: expected http://HOST:PORT")
        self._urls = itertools.cycle([urlsplit(url) for url in urls])
        self._lock = threading.Lock()

    def next(self) -> http.client.HTTPConnection:
        with self._lock:
            url = next(self._urls)
        return http.client.HTTPConnection(url.hostname or "", url.port or 80, timeout=TIMEOUT_S)


class PDProxy(ThreadingHTTPServer):
    """The proxy's server: ``serve_forever`` it; see the module docstring."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], prefill: Sequence[str], decode: Sequence[str]):
        self.prefill = _Backends("prefill", prefill)
        self.decode = _Backends("decode", decode)
        self.counts = Counter[str]()
        self.counts_lock = threading.Lock()
        super().__init__(address, _Handler)

    def count(self, name: str) -> None:
        with self.counts_lock:
            self.counts[name] += 1


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: PDProxy

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)

    def do_GET(self) -> None:
        if self.path == "/kvstore/proxy":
            with self.server.counts_lock:
                body = json.dumps(dict(self.server.counts)).encode()
            self._answer(200, body)
            return
        self._forward(self.server.decode.next(), "GET", None, {})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path.split("?")[0] not in HANDOFF_PATHS:
            self._forward(self.server.decode.next(), "POST", body, {})
            return
        try:
            request = json.loads(body)
            if not isinstance(request, dict):
                raise ValueError("not a JSON object")
        except ValueError as error:
            self._answer(400, json.dumps({"error": f"pd-proxy: bad JSON body: {error}"}).encode())
            return
        self.server.count("requests")
        began = time.perf_counter()
        params = self._prefill(request)
        extra = {"x-kvstore-prefill-ms": f"{1000 * (time.perf_counter() - began):.1f}"}
        if params is None:
            extra["x-kvstore-handoff"] = "none"
        else:
            request["kv_transfer_params"] = params
            blocks = (params.get("kvstore_handoff") or {}).get("blocks")
            extra["x-kvstore-handoff"] = f"blocks={blocks}"
            self.server.count("handoffs")
        self._forward(self.server.decode.next(), "POST", json.dumps(request).encode(), extra)

    def _prefill(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """The prefill's ``kv_transfer_params``; ``None`` when it failed (counted)."""
        ask = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
        ask["max_tokens"] = 1
        if "max_completion_tokens" in ask:
            ask["max_completion_tokens"] = 1
        connection = self.server.prefill.next()
        try:
            connection.request("POST", self.path, json.dumps(ask), self._headers())
            reply = connection.getresponse()
            body = reply.read()
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {body[:200]!r}")
            params = json.loads(body).get("kv_transfer_params")
            return params if isinstance(params, dict) else {}
        except (OSError, RuntimeError, ValueError, http.client.HTTPException) as error:
            self.server.count("prefill_failures")
            log.warning("pd-proxy: prefill at %s:%s failed (%s); the decode instance computes "
                        "the prompt", connection.host, connection.port, error)  # fmt: skip
            return None
        finally:
            connection.close()

    def _forward(
        self,
        connection: http.client.HTTPConnection,
        method: str,
        body: bytes | None,
        extra: dict[str, str],
    ) -> None:
        """Sends the request to ``connection`` and its reply back, streamed as it comes."""
        try:
            connection.request(method, self.path, body, self._headers())
            reply = connection.getresponse()
        except (OSError, http.client.HTTPException) as error:
            connection.close()
            self.server.count("decode_failures")
            message = f"pd-proxy: {connection.host}:{connection.port} unreachable: {error}"
            self._answer(502, json.dumps({"error": message}).encode(), extra)
            return
        try:
            self.send_response(reply.status)
            for name, value in reply.getheaders():
                if name.lower() not in HOP_HEADERS:
                    self.send_header(name, value)
            for name, value in extra.items():
                self.send_header(name, value)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for chunk in _chunks(reply):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            connection.close()

    def _headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if "authorization" in self.headers:
            headers["authorization"] = self.headers["authorization"]
        return headers

    def _answer(self, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


def _chunks(reply: http.client.HTTPResponse) -> Iterator[bytes]:
    while chunk := reply.read1(CHUNK_BYTES):
        yield chunk


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstore pd-proxy",
        description="Send each OpenAI request to a prefill vLLM (max_tokens 1), then to a "
        "decode vLLM with the prefill's KV hand-off.",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a prefill vLLM (kv_producer), http://HOST:PORT; repeat for more",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a decode vLLM (kv_consumer), http://HOST:PORT; repeat for more",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any)")
    args = parser.parse_args(argv)  # fmt: skip
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        proxy = PDProxy((args.host, args.port), args.prefill, args.decode)
    except (ValueError, OSError) as error:
        print(f"kvstore pd-proxy: {error}")
        return 2
    host, port = proxy.server_address[:2]
    log.info("pd-proxy listening on http://%s:%s: prefill %s, decode %s", host, port,
             ", ".join(args.prefill), ", ".join(args.decode))  # fmt: skip
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.server_close()
    return 0
