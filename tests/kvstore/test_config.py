"""Config: TOML + environment + overrides, units, and errors that name the key and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import (
    Config,
    ConfigError,
    from_mapping,
    load_config,
    parse_duration,
    parse_size,
)

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    return path


def test_example_file_loads_with_its_values() -> None:
    config = load_config(REPO / "deploy" / "kvstore.example.toml", environ={})
    assert config.host.capacity == 4 * 2**30
    assert config.ssd.capacity == 64 * 2**30
    assert config.ssd.write_policy == "write_back"
    assert config.redis.enabled is False
    assert config.redis.ttl == 3600.0
    assert config.eviction.low_watermark == 0.85


def test_embedded_defaults_are_valid() -> None:
    config = load_config(environ={})
    assert config == Config()
    assert config.host.enabled and config.ssd.enabled and not config.redis.enabled


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5TiB", 3 * 2**39),
        ("4096", 4096),
        ("64 KiB", 65536),
        ("4096b", 4096),
        (123, 123),
    ],
)
def test_sizes(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "suggested"), [("1GB", "1GiB"), ("1gb", "1GiB"), ("1g", "1GiB"), ("64k", "64KiB"),
                            ("2.5 TB", "2.5TiB"), ("8mb", "8MiB")]
)  # fmt: skip
def test_ambiguous_sizes_are_refused_with_the_binary_spelling(text: str, suggested: str) -> None:
    """SI and redis.conf disagree on these (redis: 1g = 10^9, 1gb = 2^30): never guessed."""
    with pytest.raises(ConfigError, match=rf"host\.capacity: '{text}' is ambiguous.*{suggested}"):
        load_config(overrides={"host": {"capacity": text}})


@pytest.mark.parametrize(
    ("text", "expected"), [("250ms", 0.25), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), (2, 2.0)]
)
def test_durations(text: str | int, expected: float) -> None:
    assert parse_duration(text) == expected


def test_environment_overrides_file_and_flags_override_environment(tmp_path: Path) -> None:
    path = write(tmp_path, '[ssd]\ncapacity = "10GiB"\n[host]\ncapacity = "1GiB"\n')
    environ = {"KVSTORE_SSD__CAPACITY": "20GiB", "KVSTORE_REDIS__ENABLED": "true", "HOME": "/x"}
    config = load_config(path, environ=environ)
    assert config.ssd.capacity == 20 * 2**30
    assert config.host.capacity == 2**30
    assert config.redis.enabled is True
    config = load_config(path, environ=environ, overrides={"ssd": {"capacity": "30GiB"}})
    assert config.ssd.capacity == 30 * 2**30


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[ssd]\ncapacit = "1GiB"\n', r"unknown key 'ssd\.capacit'"),
        ('[disk]\ncapacity = "1GiB"\n', r"unknown section 'disk'"),
        ('[ssd]\ncapacity = "-5GiB"\n', r"ssd\.capacity: expected a size.*'-5GiB'"),
        ("[ssd]\ncapacity = -5\n", r"ssd\.capacity: size must not be negative, got -5"),
        ('[ssd]\ncapacity = "lots"\n', r"ssd\.capacity: expected a size.*'lots'"),
        ('[ssd]\nfsync = "maybe"\n', r"ssd\.fsync: expected true or false, got 'maybe'"),
        ('[redis]\npool_size = "many"\n', r"redis\.pool_size: expected an integer, got 'many'"),
        ('[ssd]\nwrite_policy = "sometimes"\n', r"ssd\.write_policy must be one of .*'sometimes'"),
        ('[ssd]\ncompression = "zstd"\n', r"ssd\.compression must be one of .*'zstd'"),
        (
            '[eviction]\npolicy = "fifo"\n',
            r"eviction\.policy must be one of lru, scheduler_aware; got 'fifo'",
        ),
        ("[eviction]\nlow_watermark = 0.99\n", r"low_watermark=0\.99 high_watermark=0\.95"),
        ("[eviction]\nhint_share = 0\n", r"eviction\.hint_share must be in \(0, 1\], got 0"),
        ("[eviction]\nhint_rate = 2.5\n", r"eviction\.hint_rate must be in \(0, 1\], got 2\.5"),
        ("[ssd]\nselective_hits = 0\n", r"ssd\.selective_hits must be >= 1, got 0"),
        ('[ssd]\ndirectory = " "\n', r"ssd\.directory is empty: name a directory"),
        ("ssd = 3\n", r"section 'ssd' must be a table, got 3"),
        ('[host]\nttl = "soon"\n', r"host\.ttl: expected a duration.*'soon'"),
        ("[host]\ncapacity = 0\n", r"host\.capacity must be positive, got 0"),
    ],
)
def test_bad_values_name_key_and_value(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text), environ={})


def test_write_through_to_a_smaller_tier_is_impossible(tmp_path: Path) -> None:
    text = '[host]\ncapacity = "8GiB"\n[ssd]\ncapacity = "4GiB"\nwrite_policy = "write_through"\n'
    with pytest.raises(ConfigError, match=r"ssd\.capacity \(4294967296 bytes\) is smaller"):
        load_config(write(tmp_path, text), environ={})
    # The same sizes are fine with write-back: only blocks evicted from host go down.
    load_config(write(tmp_path, text.replace("write_through", "write_back")), environ={})


def test_bad_environment_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"ssd\.capacity: expected a size.*'huge'"):
        load_config(environ={"KVSTORE_SSD__CAPACITY": "huge"})
    with pytest.raises(ConfigError, match=r"unknown key 'ssd\.size'"):
        load_config(environ={"KVSTORE_SSD__SIZE": "1GiB"})


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml", environ={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[ssd\n"), environ={})


def test_no_tier_enabled_is_an_error() -> None:
    environ = {"KVSTORE_HOST__ENABLED": "false", "KVSTORE_SSD__ENABLED": "0"}
    with pytest.raises(ConfigError, match="at least one tier must be enabled"):
        load_config(environ=environ)


def test_server_and_auth_sections(tmp_path: Path) -> None:
    text = (
        '[server]\nlisten = ["unix:/tmp/k.sock", "127.0.0.1:7070"]\nsocket_mode = "0660"\n'
        '[auth]\ntokens = ["s3cret:team-a", "other:team-b"]\n'
    )
    config = load_config(write(tmp_path, text), environ={})
    assert config.server.listen == ("unix:/tmp/k.sock", "127.0.0.1:7070")
    assert config.auth.tenants_by_token() == {"s3cret": "team-a", "other": "team-b"}
    config = load_config(environ={"KVSTORE_SERVER__LISTEN": "unix:/a.sock, 0.0.0.0:9000"})
    assert config.server.listen == ("unix:/a.sock", "0.0.0.0:9000")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[server]\nlisten = ["nowhere"]\n', r"server\.listen: expected .*'nowhere'"),
        ("[server]\nlisten = []\n", r"server\.listen needs at least one address"),
        ('[server]\nsocket_mode = "0999"\n', r"server\.socket_mode must be octal.*'0999'"),
        ('[server]\nchunk_bytes = "8MiB"\n', r"server\.chunk_bytes must be in .*got 8388608"),
        ('[server]\ntls_cert = "a.pem"\n', r"tls_cert and server\.tls_key go together"),
        (
            '[auth]\ntokens = ["no-tenant"]\n',
            r"auth\.tokens\[0\] .*\(it has no tenant; its value is not shown\)",
        ),
        ('[auth]\ntokens = ["a:b", ":x"]\n', r"auth\.tokens\[1\] .*no token"),
        ("[auth]\ntokens = [1, 2]\n", r"auth\.tokens: expected a list of strings, got \[1, 2\]"),
    ],
)
def test_bad_server_values(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text), environ={})


def test_a_removed_key_says_why() -> None:
    with pytest.raises(ConfigError, match=r"'host.directory' is gone: the host arenas are"):
        from_mapping({"host": {"directory": "/dev/shm"}})


def test_a_malformed_token_is_never_echoed(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text('[auth]\ntokens = ["ok:team", "hunter2-with-no-tenant"]\n')
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert "hunter2" not in str(caught.value) and "auth.tokens[1]" in str(caught.value)
