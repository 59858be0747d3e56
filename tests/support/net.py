"""Network helpers for tests: a free TCP port, and a self-signed certificate for TLS.

``free_port()`` is a port on 127.0.0.1 that binds now, below the ephemeral range (see
:mod:`kvstore.inference_adapter.bench.ports`; a test binds it right after).
``self_signed(directory)`` makes ``cert.pem`` and ``key.pem`` there with the openssl
command, valid for ``localhost`` and ``127.0.0.1``.
``silent_listener(port)`` is a hung host: it accepts connections on ``port`` and never
answers.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

from kvstore.inference_adapter.bench.ports import free_port

__all__ = ["free_port", "self_signed", "silent_listener"]


@contextlib.contextmanager
def silent_listener(port: int) -> Iterator[list[socket.socket]]:
    """A node that accepts connections on ``port`` and never answers (a hung host); yields
    the connections it accepted so far."""
    accepted: list[socket.socket] = []
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(0.05)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield accepted
    finally:
        stop.set()
        thread.join()
        listener.close()
        for conn in accepted:
            conn.close()


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1 and its key."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key
