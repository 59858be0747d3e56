"""Redis URLs: the schemes the Redis tier takes, a check that names what is wrong without
echoing the URL (it may carry a password), and the URL with its secrets taken out for logs.

- one server: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS), ``unix:///path``;
- a Redis Cluster: ``redis+cluster://[user:password@]host:port,host:port,...`` (seed nodes;
  the client learns the rest), ``rediss+cluster://`` with TLS. A cluster has database 0 only;
- a Sentinel-managed primary: ``redis+sentinel://[user:password@]host:port,.../service[/db]``
  (the sentinels' addresses, then the service name they monitor), ``rediss+sentinel://``;
- ``check_url(url)`` raises ``ValueError`` for a scheme outside :data:`URL_SCHEMES`, a port
  that is not a number in 1-65535, a missing host (TCP schemes) or path (``unix``), or a
  database that is not a number (not 0, for a cluster);
- ``cluster_seeds(url)`` -> the seed nodes of a cluster (or the sentinels of a sentinel) URL,
  as ``(host, port)``; ``sentinel_service(url)`` -> the service name and database;
- ``without_secrets(url)`` -> ``redis://***@host:6379/0`` when the URL has a user or password;
- ``check_tls(url, ca, cert, key)`` raises ``ValueError`` naming the setting when TLS files
  are given for a URL without TLS, a client certificate comes without its key (or the
  reverse), or a file does not exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final
from urllib.parse import unquote, urlsplit

__all__ = [
    "CLUSTER_SCHEMES",
    "SENTINEL_SCHEMES",
    "URL_SCHEMES",
    "check_tls",
    "check_url",
    "cluster_credentials",
    "cluster_seeds",
    "sentinel_service",
    "without_secrets",
]

CLUSTER_SCHEMES: Final = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES: Final = ("redis+sentinel", "rediss+sentinel")
URL_SCHEMES: Final = ("redis", "rediss", "unix", *CLUSTER_SCHEMES, *SENTINEL_SCHEMES)
SENTINEL_PORT: Final = 26379
DEFAULT_PORT: Final = 6379


def check_tls(url: str, ca: str = "", cert: str = "", key: str = "") -> None:
    """Raises ``ValueError`` naming the setting (``tls_ca``, ``tls_cert``, ``tls_key``) that
    does not fit ``url`` or is no file."""
    given = {"tls_ca": ca, "tls_cert": cert, "tls_key": key}
    named = [name for name, path in given.items() if path]
    if named and not url.startswith("rediss"):
        raise ValueError(
            f"{named[0]} is set but the url does not use TLS (rediss://, rediss+cluster://, "
            "rediss+sentinel://)"
        )
    if bool(cert) != bool(key):
        raise ValueError("tls_cert and tls_key go together (a client certificate and its key)")
    for name in named:
        if not Path(given[name]).expanduser().is_file():
            raise ValueError(f"{name} {given[name]!r}: no such file")


def check_url(url: str) -> None:
    """Raises ``ValueError`` naming what is wrong with ``url`` (never its password)."""
    shown = without_secrets(url) if "://" in url else "the url"
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in URL_SCHEMES:
        raise ValueError(f"{shown}: the scheme must be one of {', '.join(URL_SCHEMES)}")
    if scheme == "unix":
        if not urlsplit(url).path:
            raise ValueError(f"{shown}: a unix URL needs a socket path (unix:///path/redis.sock)")
        return
    hosts, database = _hosts_and_path(url)
    if scheme in SENTINEL_SCHEMES:
        for host in hosts:
            _host_port(host, shown, SENTINEL_PORT)
        service, _, database = database.partition("/")
        if not service:
            raise ValueError(f"{shown}: name the service the sentinels monitor (/mymaster)")
        if database and not database.isdigit():
            raise ValueError(f"{shown}: the database must be a number, got {database!r}")
        return
    if scheme not in CLUSTER_SCHEMES and len(hosts) != 1:
        raise ValueError(f"{shown}: one host:port (for seed nodes, use redis+cluster://)")
    for host in hosts:
        _host_port(host, shown)
    if database and not database.isdigit():
        raise ValueError(f"{shown}: the database must be a number, got {database!r}")
    if scheme in CLUSTER_SCHEMES and database not in ("", "0"):
        raise ValueError(f"{shown}: a Redis Cluster has database 0 only, got {database!r}")


def cluster_seeds(url: str) -> list[tuple[str, int]]:
    """The seed nodes of a ``redis+cluster://`` URL, or the sentinels of a
    ``redis+sentinel://`` one (checked: see :func:`check_url`)."""
    check_url(url)
    port = SENTINEL_PORT if url.partition("://")[0] in SENTINEL_SCHEMES else DEFAULT_PORT
    return [_host_port(host, "the url", port) for host in _hosts_and_path(url)[0]]


def sentinel_service(url: str) -> tuple[str, int]:
    """The service name and database of a ``redis+sentinel://`` URL."""
    check_url(url)
    service, _, database = _hosts_and_path(url)[1].partition("/")
    return service, int(database or 0)


def cluster_credentials(url: str) -> tuple[str | None, str | None]:
    """The user and password of a cluster URL (``None`` where it names none)."""
    userinfo = _netloc(url).rpartition("@")[0]
    if not userinfo:
        return None, None
    user, has_password, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if has_password else None)


def without_secrets(url: str) -> str:
    """``url`` with any user and password taken out (``redis://***@host:6379/0``)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    _, at, hosts = netloc.rpartition("@")
    if not sep or not at:
        return url
    return f"{scheme}://***@{hosts}{slash}{path}"


def _netloc(url: str) -> str:
    return url.partition("://")[2].partition("/")[0]


def _hosts_and_path(url: str) -> tuple[list[str], str]:
    hosts = _netloc(url).rpartition("@")[2]
    path = url.partition("://")[2].partition("/")[2].partition("?")[0].strip("/")
    return [host.strip() for host in hosts.split(",")], path


def _host_port(text: str, shown: str, default: int = DEFAULT_PORT) -> tuple[str, int]:
    host, colon, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not colon:
        host, port = text, str(default)
    host = host.strip("[]")
    if not host:
        raise ValueError(f"{shown}: no host")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{shown}: the port must be a number in 1-65535")
    return host, int(port)
