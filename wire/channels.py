"""gRPC channels to the daemon, opened in one place for the client and the ``kvstore`` command.

``open_channel(address, root_cert=..., server_name=...)`` is the client's ``grpc.aio``
channel, ``open_sync_channel`` the command's blocking one; both speak TLS when given the CA's
PEM certificate (``server_name`` overrides the name checked against the daemon's
certificate) and carry :data:`OPTIONS`.
"""

from __future__ import annotations

from typing import Final

import grpc

__all__ = ["OPTIONS", "open_channel", "open_sync_channel"]

OPTIONS: Final[tuple[tuple[str, int], ...]] = (
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 256 << 20),
    # The daemon is usually on this host: after a restart, reconnect within a second or two
    # instead of gRPC's default backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # A new client gets subchannels of its own. gRPC shares them per address across a
    # process's channels by default, so a client made right after the daemon came back
    # inherited the dead one's backoff and failed at once ("connection refused").
    ("grpc.use_local_subchannel_pool", 1),
)


def open_channel(
    address: str, *, root_cert: bytes | None = None, server_name: str | None = None
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address``: TLS against ``root_cert`` when given."""
    options = _options(server_name)
    if root_cert is None:
        return grpc.aio.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=root_cert)
    return grpc.aio.secure_channel(address, credentials, options=options)


def open_sync_channel(
    address: str, *, root_cert: bytes | None = None, server_name: str | None = None
) -> grpc.Channel:
    """A blocking channel to ``address``, as :func:`open_channel`."""
    options = _options(server_name)
    if root_cert is None:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=root_cert)
    return grpc.secure_channel(address, credentials, options=options)


def _options(server_name: str | None) -> list[tuple[str, int | str]]:
    named: list[tuple[str, int | str]] = [*OPTIONS]
    if server_name:
        named.append(("grpc.ssl_target_name_override", server_name))
    return named
