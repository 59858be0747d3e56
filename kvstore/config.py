"""Configuration: one frozen dataclass tree, loaded from TOML, overridden by the environment.

Order of precedence (later wins): the embedded defaults below, a TOML file
(``kvstore serve --config kvstore.toml``), ``KVSTORE_SECTION__KEY`` environment variables
(``KVSTORE_SSD__CAPACITY=64GiB``), then explicit overrides (CLI flags) passed to
:func:`load_config`. Every value is checked once, here: an unknown section or key, a wrong
type, a negative size or an impossible combination raises :class:`ConfigError` naming the key
and the value. Sizes take binary units (``"512MiB"``, ``"8GiB"``, ``"1.5TiB"``) or bytes;
``"1GB"``, ``"1gb"`` and ``"1g"`` are refused as ambiguous (SI reads ``GB`` as 10^9, redis.conf
as 2^30);
durations accept ``"250ms"``, ``"30s"``, ``"5m"``, ``"1h"`` or seconds as a number.

The annotated example is ``deploy/kvstore.example.toml``.
"""

from __future__ import annotations

import dataclasses
import grp
import itertools
import os
import re
import tempfile
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import platformdirs

from kvstore.policies import EVICTION_POLICIES, WRITE_POLICIES
from kvstore.tiers.redis_url import check_tls, check_url

COMPRESSIONS: Final = ("none", "lz4", "lz4_shuffle")
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
TIER_SECTIONS: Final = ("host", "ssd", "redis")  # the tiers a config can turn on, top first
ENV_PREFIX: Final = "KVSTORE_"

# One convention: binary IEC units. "KB", "1g" and "1gb" are refused, not guessed: SI reads
# "1GB" as 10^9 and redis.conf reads "1gb" as 2^30 and "1g" as 10^9.
_SIZE_UNITS: Final = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AMBIGUOUS_UNITS: Final = {"k": "KiB", "m": "MiB", "g": "GiB", "t": "TiB",
                           "kb": "KiB", "mb": "MiB", "gb": "GiB", "tb": "TiB"}  # fmt: skip
_DURATION_UNITS: Final = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER_WITH_UNIT: Final = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$"
)


REMOVED_KEYS: Final = {
    "host.directory": "the host arenas are anonymous memory (memfds) handed to clients over "
    "the shm session socket, not files in a directory; delete the key",
}


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and the value."""


def size(default: int) -> int:
    """A field holding a byte count that accepts units in TOML and the environment."""
    return field(default=default, metadata={"kind": "size"})


def duration(default: float) -> float:
    """A field holding seconds that accepts units ("30s", "5m") in TOML and the environment."""
    return field(default=default, metadata={"kind": "duration"})


def default_ssd_directory() -> str:
    return str(Path(platformdirs.user_cache_dir("kvstore")) / "blocks")


@dataclass(frozen=True, slots=True)
class HostConfig:
    """The shared-memory host tier: the top tier, where every put lands and reads are served."""

    enabled: bool = True
    capacity: int = size(default=4 * 2**30)  # all tenants' arenas together
    ttl: float = duration(default=0.0)
    prefault: bool = True  # fault a new arena's free pages in off the hot path


@dataclass(frozen=True, slots=True)
class SsdConfig:
    """The local SSD tier."""

    enabled: bool = True
    directory: str = field(default_factory=default_ssd_directory)
    capacity: int = size(default=64 * 2**30)
    write_policy: str = "write_back"
    selective_hits: int = 2
    compression: str = "lz4_shuffle"
    ttl: float = duration(default=0.0)
    fsync: bool = True


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """The Redis tier, shared between nodes (off unless configured)."""

    enabled: bool = False
    url: str = "redis://127.0.0.1:6379/0"
    capacity: int = size(default=16 * 2**30)
    key_prefix: str = "kvstore"
    write_policy: str = "write_back"
    selective_hits: int = 2
    compression: str = "lz4_shuffle"
    ttl: float = duration(default=0.0)
    pool_size: int = 16
    timeout: float = duration(default=1.0)
    # With a rediss URL: PEM files of the CA that signed the servers' certificates (empty: the
    # system's; certificates are always verified), and a client certificate and its key.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    """When and what to evict: start at ``high_watermark`` of a tier, stop at ``low_watermark``."""

    policy: str = "lru"  # or "scheduler_aware": blocks named in prefetch hints go last
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    hint_ttl: float = duration(default=60.0)  # how long a prefetch hint protects its blocks
    hint_share: float = 0.25  # one hint promotes at most this share of the host tier
    hint_rate: float = 1.0  # hints together promote at most this share of it per second


def default_socket() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR") or str(
        Path(tempfile.gettempdir()) / f"kvstore-{os.getuid()}"
    )
    return "unix:" + str(Path(runtime) / "kvstore" / "kvstore.sock")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where the daemon listens and the limits of its requests."""

    # "unix:/path/to.sock" or "host:port" (TCP); several allowed.
    listen: tuple[str, ...] = field(default_factory=lambda: (default_socket(),))
    socket_mode: str = "0600"  # unix socket permissions (octal); "0660" to share with a group
    socket_group: str = ""  # group (name or gid) of the sockets and of a directory made for them
    max_message_bytes: int = size(default=8 * 2**20)
    chunk_bytes: int = size(default=2**20)  # payload bytes per streamed chunk
    lease_ttl: float = duration(default=10.0)  # leases and reservations expire after this
    shutdown_grace: float = duration(default=5.0)
    log_level: str = "info"  # debug | info | warning | error; SIGHUP applies a change
    tls_cert: str = ""  # PEM files; both set = TLS on TCP listeners
    tls_key: str = ""
    # Limits checked before any work: the largest block a namespace may have (at
    # RegisterNamespace), the bytes one shm session may hold reserved in the arena at once
    # (its window; the name is from when puts went through a staging area), how many
    # sessions may be open,
    # and the bytes of streamed blocks assembled in memory at once (no room in the arena).
    max_block_bytes: int = size(default=2**30)
    max_staging_bytes: int = size(default=2**30)
    max_sessions: int = 1024
    max_buffered_bytes: int = size(default=2**30)


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Bearer tokens. Empty: no authentication (rely on the unix socket's permissions)."""

    # "token:tenant" pairs; a token may only use namespaces registered for its tenant.
    tokens: tuple[str, ...] = ()

    def tenants_by_token(self) -> dict[str, str]:
        return dict(entry.split(":", 1) for entry in self.tokens)


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """The Prometheus endpoint (:mod:`kvstore.metrics`)."""

    listen: str = ""  # "host:port" of /metrics; empty: no endpoint


@dataclass(frozen=True, slots=True)
class Config:
    """The whole configuration tree."""

    host: HostConfig = field(default_factory=HostConfig)
    ssd: SsdConfig = field(default_factory=SsdConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        validate(self)


def parse_size(text: str | float, key: str = "size") -> int:
    """Parses ``"8GiB"``, ``"512MiB"``, ``"1.5TiB"`` or a byte count into bytes (``KiB`` =
    1024; the ambiguous ``KB``, ``k`` and kin are refused).

    Raises:
        ConfigError: the text is not a size, or the size is negative.
    """
    if isinstance(text, bool):
        raise ConfigError(f"{key}: expected a size like '8GiB', got {text!r}")
    value: float
    if isinstance(text, int | float):
        value = text
    else:
        match = _NUMBER_WITH_UNIT.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is not None and unit in _AMBIGUOUS_UNITS:
            raise ConfigError(
                f"{key}: {text!r} is ambiguous (SI and redis.conf read it differently): "
                f"write {match.group(1)}{_AMBIGUOUS_UNITS[unit]} (binary) or a byte count"
            )
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigError(f"{key}: expected a size like '8GiB' or '512MiB', got {text!r}")
        value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value < 0:
        raise ConfigError(f"{key}: size must not be negative, got {text!r}")
    return int(value)


def parse_duration(text: str | float, key: str = "duration") -> float:
    """Parses ``"250ms"``, ``"30s"``, ``"5m"``, ``"1h"`` or a number of seconds.

    Raises:
        ConfigError: the text is not a duration, or the duration is negative.
    """
    if isinstance(text, bool):
        raise ConfigError(f"{key}: expected a duration like '30s', got {text!r}")
    if isinstance(text, int | float):
        value = float(text)
    else:
        match = _NUMBER_WITH_UNIT.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _DURATION_UNITS:
            raise ConfigError(f"{key}: expected a duration like '30s' or '5m', got {text!r}")
        value = float(match.group(1)) * _DURATION_UNITS[unit]
    if value < 0:
        raise ConfigError(f"{key}: duration must not be negative, got {text!r}")
    return value


def _parse_bool(value: object, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _parse_int(value: object, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value):
        return int(value)
    raise ConfigError(f"{key}: expected an integer, got {value!r}")


def _parse_float(value: object, key: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected a number, got {value!r}")


def _parse_str(value: object, key: str) -> str:
    if isinstance(value, str):
        return value
    raise ConfigError(f"{key}: expected a string, got {value!r}")


def _parse_strings(value: object, key: str) -> tuple[str, ...]:
    if isinstance(value, str):  # from the environment: comma-separated
        return tuple(item.strip() for item in value.split(",") if item.strip())
    if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ConfigError(f"{key}: expected a list of strings, got {value!r}")


def _convert(spec: dataclasses.Field[object], value: object, key: str) -> object:
    kind = spec.metadata.get("kind")
    if kind == "size":
        if not isinstance(value, str | int | float):
            raise ConfigError(f"{key}: expected a size like '8GiB', got {value!r}")
        return parse_size(value, key)
    if kind == "duration":
        if not isinstance(value, str | int | float):
            raise ConfigError(f"{key}: expected a duration like '30s', got {value!r}")
        return parse_duration(value, key)
    parsers = {
        "bool": _parse_bool,
        "int": _parse_int,
        "float": _parse_float,
        "str": _parse_str,
        "tuple[str, ...]": _parse_strings,
    }
    return parsers[str(spec.type)](value, key)


def _section(cls: type[object], values: Mapping[str, object], section: str) -> object:
    specs = {spec.name: spec for spec in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {}
    for name, value in values.items():
        if f"{section}.{name}" in REMOVED_KEYS:
            raise ConfigError(f"'{section}.{name}' is gone: {REMOVED_KEYS[f'{section}.{name}']}")
        if name not in specs:
            known = ", ".join(sorted(specs))
            raise ConfigError(f"unknown key '{section}.{name}' (known keys: {known})")
        kwargs[name] = _convert(specs[name], value, f"{section}.{name}")
    return cls(**kwargs)


def _sections() -> dict[str, type[object]]:
    return {spec.name: spec.default_factory for spec in dataclasses.fields(Config)}  # type: ignore[misc]


def from_mapping(data: Mapping[str, object]) -> Config:
    """Builds a :class:`Config` from nested mappings (parsed TOML), checking every key.

    Raises:
        ConfigError: unknown section or key, wrong type, bad value or combination.
    """
    sections = _sections()
    kwargs = {}
    for name, values in data.items():
        if name not in sections:
            raise ConfigError(f"unknown section '{name}' (known: {', '.join(sorted(sections))})")
        if not isinstance(values, Mapping):
            raise ConfigError(f"section '{name}' must be a table, got {values!r}")
        kwargs[name] = _section(sections[name], values, name)
    return Config(**kwargs)  # type: ignore[arg-type]


def env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Collects ``KVSTORE_SECTION__KEY=value`` variables into nested mappings.

    Raises:
        ConfigError: a ``KVSTORE_`` variable without the ``SECTION__KEY`` shape.
    """
    overrides: dict[str, dict[str, str]] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("__")
        if not section or not key:
            raise ConfigError(f"environment variable {name}: expected KVSTORE_SECTION__KEY")
        overrides.setdefault(section, {})[key] = value
    return overrides


def _merge(base: dict[str, dict[str, object]], extra: Mapping[str, Mapping[str, object]]) -> None:
    for section, values in extra.items():
        if not isinstance(values, Mapping):
            raise ConfigError(f"section '{section}' must be a table, got {values!r}")
        base.setdefault(section, {}).update(values)


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, object]] | None = None,
) -> Config:
    """Loads the configuration: defaults, then the TOML file, the environment, ``overrides``.

    Args:
        path: a TOML file, or None for the embedded defaults.
        environ: the environment to read ``KVSTORE_SECTION__KEY`` from (default ``os.environ``).
        overrides: values that win over everything else (from CLI flags), as nested mappings.

    Raises:
        ConfigError: the file is missing or not TOML, or any value is invalid.
    """
    merged: dict[str, dict[str, object]] = {}
    if path is not None:
        try:
            with open(path, "rb") as handle:
                _merge(merged, tomllib.load(handle))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    _merge(merged, env_overrides(os.environ if environ is None else environ))
    _merge(merged, overrides or {})
    return from_mapping(merged)


def validate(config: Config) -> None:
    """Checks values and combinations; raises :class:`ConfigError` naming the key and value."""
    for section in ("ssd", "redis"):
        tier = getattr(config, section)
        _check_choice(f"{section}.write_policy", tier.write_policy, tuple(WRITE_POLICIES))
        _check_choice(f"{section}.compression", tier.compression, COMPRESSIONS)
        if tier.selective_hits < 1:
            raise ConfigError(f"{section}.selective_hits must be >= 1, got {tier.selective_hits}")
    _check_choice("eviction.policy", config.eviction.policy, tuple(EVICTION_POLICIES))
    low, high = config.eviction.low_watermark, config.eviction.high_watermark
    if not 0.0 < low < high <= 1.0:
        raise ConfigError(
            f"eviction watermarks need 0 < low_watermark < high_watermark <= 1, "
            f"got low_watermark={low} high_watermark={high}"
        )
    for key in ("hint_share", "hint_rate"):
        value = getattr(config.eviction, key)
        if not 0.0 < value <= 1.0:
            raise ConfigError(f"eviction.{key} must be in (0, 1], got {value}")
    _check_server(config.server)
    for index, entry in enumerate(config.auth.tokens):
        token, _, tenant = entry.partition(":")
        if not token or not tenant:  # the entry is a secret: its value is never shown
            raise ConfigError(
                f"auth.tokens[{index}] must look like 'token:tenant' "
                f"(it has {'no tenant' if token else 'no token'}; its value is not shown)"
            )
    if config.ssd.enabled and not config.ssd.directory.strip():
        raise ConfigError(
            "ssd.directory is empty: name a directory for the SSD tier's files "
            "(or set ssd.enabled = false)"
        )
    listen = config.metrics.listen
    if listen and not listen.rpartition(":")[2].isdigit():
        raise ConfigError(f"metrics.listen must look like 'host:port', got {listen!r}")
    if config.redis.pool_size < 1:
        raise ConfigError(f"redis.pool_size must be >= 1, got {config.redis.pool_size}")
    if config.redis.enabled:
        try:
            check_url(config.redis.url)
        except ValueError as error:
            raise ConfigError(f"redis.url: {error}") from None
        rc = config.redis
        try:
            check_tls(rc.url, rc.tls_ca, rc.tls_cert, rc.tls_key)
        except ValueError as error:
            raise ConfigError(f"redis.{error}") from None
    _check_tiers(config)


def socket_gid(server: ServerConfig) -> int | None:
    """The gid ``server.socket_group`` names (a group name or a number); None when empty.

    Raises:
        ConfigError: no such group on this machine.
    """
    name = server.socket_group.strip()
    if not name:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"server.socket_group: no group named {name!r} on this machine") from None


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")


def _check_tiers(config: Config) -> None:
    tiers: list[tuple[str, HostConfig | SsdConfig | RedisConfig]] = [
        ("host", config.host),
        ("ssd", config.ssd),
        ("redis", config.redis),
    ]
    enabled = [(name, tier) for name, tier in tiers if tier.enabled]
    if not enabled:
        raise ConfigError("at least one tier must be enabled (host.enabled, ssd.enabled, ...)")
    for name, tier in enabled:
        if tier.capacity <= 0:
            raise ConfigError(f"{name}.capacity must be positive, got {tier.capacity}")
    # Write-through copies everything the tier above holds, so it must be at least as large.
    for (upper_name, upper), (name, tier) in itertools.pairwise(enabled):
        policy = getattr(tier, "write_policy", "write_through")
        if policy == "write_through" and tier.capacity < upper.capacity:
            raise ConfigError(
                f"{name}.capacity ({tier.capacity} bytes) is smaller than {upper_name}.capacity "
                f"({upper.capacity} bytes) while {name}.write_policy is write_through: "
                f"every block in {upper_name} is also written to {name}"
            )


def _check_server(server: ServerConfig) -> None:
    if not server.listen:
        raise ConfigError("server.listen needs at least one address ('unix:/path' or 'host:port')")
    for address in server.listen:
        if not address.startswith("unix:") and address.rpartition(":")[2].isdigit() is False:
            raise ConfigError(
                f"server.listen: expected 'unix:/path/to.sock' or 'host:port', got {address!r}"
            )
    if not re.fullmatch(r"0?[0-7]{3}", server.socket_mode):
        raise ConfigError(
            f"server.socket_mode must be octal like '0600', got {server.socket_mode!r}"
        )
    socket_gid(server)
    _check_choice("server.log_level", server.log_level, LOG_LEVELS)
    if server.chunk_bytes <= 0 or server.chunk_bytes > server.max_message_bytes // 2:
        raise ConfigError(
            f"server.chunk_bytes must be in 1..max_message_bytes/2 "
            f"({server.max_message_bytes // 2}), got {server.chunk_bytes}"
        )
    if bool(server.tls_cert) != bool(server.tls_key):
        raise ConfigError(
            f"server.tls_cert and server.tls_key go together, got tls_cert={server.tls_cert!r} "
            f"tls_key={server.tls_key!r}"
        )
    if server.lease_ttl <= 0:
        raise ConfigError(f"server.lease_ttl must be positive, got {server.lease_ttl}")
    for name in ("max_block_bytes", "max_staging_bytes", "max_sessions", "max_buffered_bytes"):
        if getattr(server, name) <= 0:
            raise ConfigError(f"server.{name} must be positive, got {getattr(server, name)}")
