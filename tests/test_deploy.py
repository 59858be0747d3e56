"""deploy/ is valid and agrees with the daemon it deploys; the commands it runs really serve.

- ``kvstore.service``: ``systemd-analyze verify`` says nothing about it; ``systemd-analyze
  security --offline`` rates it at most ``EXPOSURE_LIMIT`` ("OK", the figure deploy/README.md
  quotes); its directories are the example config's (``RuntimeDirectory`` holds the socket,
  ``StateDirectory`` the SSD tier), ``TimeoutStopSec`` covers ``shutdown_grace`` and the flush
  of a full host tier. Its ``ExecStart`` runs as an unprivileged user without capabilities or
  new privileges, in a mount namespace where the root is read-only, the home directories are
  empty (but for this interpreter and repository) and only its two directories are writable,
  with its ``UMask`` (and its limits, where root may raise them), under seccomp filters built
  as systemd 252 builds them from its ``SystemCallFilter``, ``MemoryDenyWriteExecute`` and
  ``RestrictAddressFamilies``: blocks round-trip on both data planes, /metrics counts them,
  ``ExecReload``'s signal reloads the config, ``KillSignal`` stops it with status 0.
- ``Dockerfile``: the daemon image installs the project without extras (no torch), runs as a
  non-root user, copies the container config where its command reads it, declares the socket
  and SSD volumes and exposes the configured ports. Its entry command (ENTRYPOINT + CMD, with
  this venv's ``kvstore`` and the config the image copies) runs here as the image's uid, in
  the same kind of mount namespace with only the volumes writable: it serves over the socket
  and TCP (what the grpc probes ask), blocks round-trip, /metrics counts them, the HEALTHCHECK
  command says SERVING, and STOPSIGNAL stops it with status 0.
- ``compose.yaml``: valid under the Compose Specification's JSON schema (vendored by
  check-jsonschema); the engine shares the daemon's socket volume at the same path, the
  daemon's environment turns Redis on at the redis service, limits and stop grace fit the
  config; the engine image's command chats through a real daemon.
- ``compose.cluster.yaml``: valid under the same schema; two daemons (each its own socket and
  SSD volumes, published ports, limits fitting their config) whose config loads and names
  every node of the Redis Cluster at its port as seeds, with one key prefix; 3 primaries with
  a replica each, every node at a fixed address it announces, with a cache's settings and a
  memory limit above its maxmemory; the primaries' maxmemory together exceeds what the daemons
  may write. Its commands run here (the nodes at 127.0.0.1 on free ports, nothing else
  changed): the nodes' redis-server, the init script twice (the second run leaves the cluster
  alone), both daemons; a chain one saves, the other reads bit-exact through the cluster, and
  serves on, healthy, once the whole cluster is dead.
- ``kubernetes/``: every manifest (and the engine pod in deploy/README.md) is valid under the
  Kubernetes schemas of kubernetes-validate in strict mode; the ConfigMap holds
  ``kvstore.container.toml``; probes, scrape annotations, hostPath, memory limit and
  termination grace agree with it; the Service reaches the node's own daemon.

Without systemd-analyze, the schema packages, libseccomp, root (mount namespaces) or
redis-server and redis-cli, a test skips; with ``KVSTORE_REQUIRE_FILES=1`` it fails instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import importlib.util
import ipaddress
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KVStoreClient, WriteStatus, block_keys
from kvstore.client.errors import TRANSIENT
from kvstore.config import Config, load_config, parse_duration
from kvstore.inference_adapter.bench.redis_cluster import command as redis_command
from kvstore.inference_adapter.bench.redis_cluster import dbsize
from kvstore.tiers.redis_url import cluster_seeds
from tests.support.daemon import running_daemon
from tests.support.files import fetched
from tests.support.net import free_port
from tests.support.waiting import wait_for
from tests.support.worker import NAMESPACE, own_tokens, payload

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "kvstore.service"
EXAMPLE = DEPLOY / "kvstore.example.toml"  # what the unit's config path gets (deploy/README.md)
CONTAINER = DEPLOY / "kvstore.container.toml"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
CLUSTER_COMPOSE = DEPLOY / "compose.cluster.yaml"  # two daemons on a Redis Cluster
KUBERNETES = DEPLOY / "kubernetes"
KVSTORE = Path(sys.executable).parent / "kvstore"

EXPOSURE_LIMIT = 1.5  # measured 1.2
FLUSH_BYTES_PER_S = 50 * 2**20  # the shutdown flush rate every stop timeout assumes
INTERPRETER_BYTES = 256 * 2**20  # the daemon's memory beyond its arenas and buffers
KUBERNETES_VERSION = "1.37.0"
INSTALL = "pip install -e '.[dev]' (make install)"


# Tools -------------------------------------------------------------------------------------


def tool(name: str, hint: str) -> str:
    """The path of a command, or a skip (a failure under KVSTORE_REQUIRE_FILES=1)."""

    def find() -> Path:
        found = shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} is not installed: {hint}")
        return Path(found)

    return str(fetched(find))


def package_file(package: str, relative: str) -> Path:
    """A file shipped inside an installed package, found without importing it."""

    def find() -> Path:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"{package} is not installed: {INSTALL}")
        path = Path(next(iter(spec.submodule_search_locations))) / relative
        if not path.exists():
            raise FileNotFoundError(f"{package} has no {relative}")
        return path

    return fetched(find)


def analyze() -> str:
    return tool("systemd-analyze", "apt-get install systemd")


def run(command: Sequence[str | Path], **options: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, timeout=60, **options
    )


# Parsing -----------------------------------------------------------------------------------


def unit_settings(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections: every key's values in order (repeated keys accumulate)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service() -> dict[str, list[str]]:
    return unit_settings(UNIT.read_text())["Service"]


def one(settings: Mapping[str, list[str]], key: str) -> str:
    assert key in settings, f"the unit sets no {key}="
    return settings[key][-1]


def timespan(value: str) -> float:
    """Seconds in a systemd time span, as systemd reads it."""
    result = run([analyze(), "timespan", value])
    assert result.returncode == 0, result.stderr
    micros = re.search(r"μs: (\d+)", result.stdout)
    assert micros, result.stdout
    return int(micros.group(1)) / 1e6


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON array form's words (a shell form fails the test)."""
        words = json.loads(self.args)
        assert isinstance(words, list), f"{self.keyword} {self.args}: not the exec (JSON) form"
        return [str(word) for word in words]


def dockerfile(path: Path) -> list[list[Instruction]]:
    """A Dockerfile's stages (from each FROM on), continuations joined, comments dropped."""
    stages: list[list[Instruction]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        if keyword.upper() == "FROM":
            stages.append([])
        assert stages, f"{path.name}: {keyword} before the first FROM"
        stages[-1].append(Instruction(keyword.upper(), args.strip()))
    return stages


def instructions(stage: list[Instruction], keyword: str) -> list[Instruction]:
    return [item for item in stage if item.keyword == keyword]


def image_command(stage: list[Instruction]) -> list[str]:
    """What a container of this stage runs: ENTRYPOINT + CMD, both in exec form."""
    entry = instructions(stage, "ENTRYPOINT")
    cmd = instructions(stage, "CMD")
    assert entry or cmd, "the stage has neither ENTRYPOINT nor CMD"
    return (entry[-1].exec_form() if entry else []) + (cmd[-1].exec_form() if cmd else [])


def copies(stage: list[Instruction]) -> dict[str, str]:
    """The stage's COPY instructions from the build context: destination -> source."""
    found: dict[str, str] = {}
    for item in instructions(stage, "COPY"):
        words = [word for word in shlex.split(item.args) if not word.startswith("--")]
        if "--from=" in item.args:
            continue
        *sources, destination = words
        for source in sources:
            found[destination if len(sources) == 1 else f"{destination}{source}"] = source
    return found


def pip_targets(stage: list[Instruction]) -> list[list[str]]:
    """What each ``pip install`` of the stage's RUN instructions installs (options dropped)."""
    targets = []
    for item in instructions(stage, "RUN"):
        for command in re.split(r"&&|;", item.args):
            words = shlex.split(command)
            if "pip" in " ".join(words[:2]) and "install" in words:
                after = words[words.index("install") + 1 :]
                skip_next = {"-c", "--constraint", "--index-url", "--extra-index-url", "-r"}
                skip_next.add("--requirement")
                kept, skip = [], False
                for word in after:
                    if skip:
                        skip = False
                    elif word in skip_next:
                        skip = True
                    elif not word.startswith("-"):
                        kept.append(word)
                targets.append(kept)
    return targets


def container_config(environ: Mapping[str, str] | None = None) -> Config:
    return load_config(CONTAINER, environ=environ or {})


def unix_path(config: Config) -> Path:
    addresses = [a for a in config.server.listen if a.startswith("unix:")]
    assert len(addresses) == 1, config.server.listen
    return Path(addresses[0].removeprefix("unix:"))


def tcp_port(config: Config) -> int:
    ports = [int(a.rpartition(":")[2]) for a in config.server.listen if not a.startswith("unix:")]
    assert len(ports) == 1, config.server.listen
    return ports[0]


def metrics_port(config: Config) -> int:
    assert config.metrics.listen, "the config serves no metrics"
    return int(config.metrics.listen.rpartition(":")[2])


def stop_allowance(config: Config) -> float:
    """Seconds a clean stop may take: the grace, then the flush of a full host tier."""
    return config.server.shutdown_grace + config.host.capacity / FLUSH_BYTES_PER_S


def quantity(text: str) -> int:
    """A Kubernetes memory quantity (``2Gi``, ``512Mi``) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "": 1}
    match = re.fullmatch(r"(\d+)([KMGT]i)?", text)
    assert match, f"unexpected quantity {text!r}"
    return int(match.group(1)) * units[match.group(2) or ""]


def compose_bytes(text: str) -> int:
    """A Compose byte value (``2g``, ``512m``: binary units)."""
    match = re.fullmatch(r"(\d+)([kmg]?)b?", str(text).lower())
    assert match, f"unexpected byte value {text!r}"
    return int(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2)]


def daemon_stage() -> list[Instruction]:
    return dockerfile(DOCKERFILE)[-1]


def healthcheck(stage: list[Instruction]) -> list[str]:
    """The command of the stage's HEALTHCHECK (exec form)."""
    return [
        str(word)
        for word in json.loads(instructions(stage, "HEALTHCHECK")[-1].args.partition(" CMD ")[2])
    ]


def created_id(stage: list[Instruction], command: str, name: str) -> int:
    """The number a ``useradd --uid N`` or ``groupadd --gid N`` of the stage gives ``name``."""
    runs = " ".join(item.args for item in instructions(stage, "RUN"))
    option = "--uid" if command == "useradd" else "--gid"
    found = re.search(rf"{command} [^&]*{option} (\d+)[^&]* {name}\b", runs)
    assert found, f"no {command} {option} for {name}"
    return int(found.group(1))


def image_uid_gid(stage: list[Instruction]) -> tuple[int, int]:
    """The numeric uid and gid of the stage's USER."""
    user, _, group = instructions(stage, "USER")[-1].args.partition(":")
    return created_id(stage, "useradd", user), created_id(stage, "groupadd", group or user)


# Running the daemon as deployed -------------------------------------------------------------

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_ERRNO = 0x00050000
_CMP_EQ, _CMP_GT, _CMP_MASKED_EQ = 4, 6, 7
_SHM_EXEC = 0o100000


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def libseccomp() -> str:
    """libseccomp's file name (systemd links it; so does this test's filter loader)."""

    def find() -> Path:
        name = ctypes.util.find_library("seccomp")
        if name is None:
            raise FileNotFoundError("libseccomp is not installed: apt-get install libseccomp2")
        return Path(name)

    return str(fetched(find))


def _libseccomp(name: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)
    ]  # fmt: skip
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _load_filter(
    lib: ctypes.CDLL, default: int, rules: Sequence[tuple[int, str, Sequence[tuple[int, ...]]]]
) -> None:
    context = lib.seccomp_init(default)
    for action, name, comparisons in rules:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # not a system call of this architecture
            continue
        array = (_ArgCmp * len(comparisons))(*(_ArgCmp(*c) for c in comparisons))
        status = lib.seccomp_rule_add_array(context, action, number, len(comparisons), array)
        if status != 0:
            raise OSError(-status, f"seccomp_rule_add_array({name})")
    status = lib.seccomp_load(context)
    lib.seccomp_release(context)
    if status != 0:
        raise OSError(-status, "seccomp_load")


def load_filters(spec: Mapping[str, Any]) -> None:
    """Loads systemd 252's seccomp filters for a unit, as ``spec`` (from unit_filters) says."""
    lib = _libseccomp(spec["library"])
    eperm = _SCMP_ACT_ERRNO | errno.EPERM
    if spec["deny_write_execute"]:  # seccomp_memory_deny_write_execute()
        wx = ctypes.c_uint64(0x2 | 0x4).value  # PROT_WRITE | PROT_EXEC
        _load_filter(lib, _SCMP_ACT_ALLOW, [
            (eperm, "mmap", [(2, _CMP_MASKED_EQ, wx, wx)]),
            (eperm, "mprotect", [(2, _CMP_MASKED_EQ, 0x4, 0x4)]),
            (eperm, "pkey_mprotect", [(2, _CMP_MASKED_EQ, 0x4, 0x4)]),
            (eperm, "shmat", [(2, _CMP_MASKED_EQ, _SHM_EXEC, _SHM_EXEC)]),
        ])  # fmt: skip
    families = spec["address_families"]
    if families:  # seccomp_restrict_address_families(), allow-list form
        refuse = _SCMP_ACT_ERRNO | errno.EAFNOSUPPORT
        rules = [
            (refuse, "socket", [(0, _CMP_EQ, af, 0)]) for af in range(64) if af not in families
        ]
        _load_filter(lib, _SCMP_ACT_ALLOW, [*rules, (refuse, "socket", [(0, _CMP_GT, 63, 0)])])
    _load_filter(lib, eperm, [(_SCMP_ACT_ALLOW, name, []) for name in spec["allow"]])


def launch() -> None:
    """``python -c '...launch()' SPEC COMMAND...``: load SPEC's filters, then exec COMMAND."""
    load_filters(json.loads(sys.argv[1]))
    os.execv(sys.argv[2], sys.argv[2:])


def syscall_groups() -> dict[str, list[str]]:
    """systemd's system call groups, as ``systemd-analyze syscall-filter`` lists them."""
    result = run([analyze(), "syscall-filter", "--no-pager"])
    assert result.returncode == 0, result.stderr
    groups: dict[str, list[str]] = {}
    members: list[str] = []
    for raw in result.stdout.splitlines():
        line = raw.strip()
        if raw.startswith("@"):
            members = groups.setdefault(line, [])
        elif line and not line.startswith("#"):
            members.append(line)
    return groups


def unit_filters(settings: Mapping[str, list[str]]) -> dict[str, Any]:
    """The allowed system calls and the other seccomp settings of a unit's [Service]."""
    groups = syscall_groups()

    def expand(names: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for name in names:
            name = name.partition(":")[0]
            found |= expand(groups[name]) if name.startswith("@") else {name}
        return found

    allowed: set[str] | None = None
    for value in settings.get("SystemCallFilter", []):
        deny = value.startswith("~")
        names = expand(value.removeprefix("~").split())
        if allowed is None:
            assert not deny, "the unit's first SystemCallFilter= must be an allow list"
            allowed = set()
        allowed = allowed - names if deny else allowed | names
    assert allowed, "the unit sets no SystemCallFilter="
    families = one(settings, "RestrictAddressFamilies").split()
    return {
        "library": libseccomp(),
        "allow": sorted(allowed),
        "deny_write_execute": one(settings, "MemoryDenyWriteExecute") == "yes",
        "address_families": [int(getattr(socket, family)) for family in families],
    }


def proc_status(pid: int | str = "self") -> dict[str, str]:
    """Identity, capabilities and seccomp state from /proc/PID/status."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines)
    keys = ("Uid", "Gid", "Groups", "CapEff", "CapBnd", "NoNewPrivs", "Seccomp_filters")
    return {key: " ".join(fields[key].split()) for key in keys}


@dataclass
class Deployed:
    """A daemon started the way a deployment starts it; ``log`` holds its output."""

    proc: subprocess.Popen[bytes]
    log: Path
    address: str

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.serving():
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"not serving:\n{self.output()}"
            time.sleep(0.05)

    def serving(self) -> bool:
        try:
            with KVStoreClient(self.address, use_shm=False, timeout=1.0, retries=0) as client:
                return bool(client.health())
        except TRANSIENT:  # not listening yet
            return False

    def confinement(self) -> dict[str, str]:
        """The process's identity, capabilities and seccomp state."""
        return proc_status(self.proc.pid)

    def stop(self, signum: int, timeout: float) -> int:
        self.proc.send_signal(signum)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {timeout} s after signal {signum}:\n{self.output()}")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a socket path must stay under ~107 bytes) that any user
    may pass."""
    base = Path(tempfile.mkdtemp(prefix="kvs-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def volumes(short_dir: Path) -> tuple[Path, Path]:
    """Short paths for a socket directory and a state directory."""
    return short_dir / "run", short_dir / "lib"


@dataclass(frozen=True)
class Relocated:
    """Where a daemon with a container config listens and keeps its SSD tier here."""

    socket: Path
    tcp: int
    metrics: int
    env: dict[str, str]  # the KVSTORE_* variables that put it there

    @property
    def address(self) -> str:
        return f"unix:{self.socket}"


def relocated(config: Config, run_dir: Path, lib_dir: Path) -> Relocated:
    """A container config's socket moved into ``run_dir`` (the socket volume's place), its SSD
    tier into ``lib_dir`` (the state volume's), its TCP and metrics ports to free local ones,
    and small tiers."""
    socket_path = run_dir / unix_path(config).name
    tcp, metrics = free_port(), free_port()
    env = {
        "KVSTORE_SERVER__LISTEN": f"unix:{socket_path},127.0.0.1:{tcp}",
        "KVSTORE_SSD__DIRECTORY": str(lib_dir / Path(config.ssd.directory).name),
        "KVSTORE_SSD__CAPACITY": "256MiB",
        "KVSTORE_HOST__CAPACITY": "64MiB",
        "KVSTORE_METRICS__LISTEN": f"127.0.0.1:{metrics}",
    }
    return Relocated(socket_path, tcp, metrics, env)


def kvstore_here(command: Sequence[str], config_path: str, config_file: Path) -> list[str]:
    """An image's ``kvstore`` command with this venv's ``kvstore``, reading ``config_file``
    where the image reads ``config_path``."""
    assert command[0] == "kvstore"
    return [str(KVSTORE), *(str(config_file) if w == config_path else w for w in command[1:])]


def sandbox_tools() -> tuple[str, str]:
    def find() -> Path:
        if os.geteuid() != 0:
            raise FileNotFoundError("running the daemon as deployed needs root (mount namespace)")
        return Path(tool("unshare", "apt-get install util-linux"))

    return str(fetched(find)), tool("setpriv", "apt-get install util-linux")


def mount_script(writable: Sequence[Path], stash: Path) -> list[str]:
    """Shell lines, run as root in a new mount namespace: the home directories become empty
    (ProtectHome=; a container has no host homes) but for this interpreter and this repository,
    bound back; then everything is read-only but ``writable``. ``stash`` holds the binds."""

    def q(path: Path) -> str:
        return shlex.quote(str(path))

    lines = [f"mount --bind {q(d)} {q(d)}" for d in writable]
    needed = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), REPO}
    kept = sorted(p for p in needed if not any(other in p.parents for other in needed))
    for home in (Path("/root"), Path("/home")):
        if not home.is_dir():
            continue
        inside = {stash / f"{home.name}{i}": p for i, p in enumerate(kept) if home in p.parents}
        lines += [f"mkdir -p {q(s)} && mount --bind {q(p)} {q(s)}" for s, p in inside.items()]
        lines.append(f"mount -t tmpfs -o mode=0755 tmpfs {q(home)}")
        for s, p in inside.items():
            lines += [f"mkdir -p {q(p)} && mount --bind {q(s)} {q(p)} && umount {q(s)}"]
            lines += [f"mount -o remount,bind,ro {q(p)}"]
        lines.append(f"mount -o remount,ro {q(home)}")
    return [*lines, "mount -o remount,bind,ro /"]


@contextlib.contextmanager
def deployed(
    command: Sequence[str],
    *,
    writable: Mapping[Path, int],
    uid: int,
    gid: int,
    env: Mapping[str, str],
    log: Path,
    address: str,
    umask: str | None = None,
    limits: Sequence[str] = (),
    filters: Mapping[str, Any] | None = None,
) -> Iterator[Deployed]:
    """Runs ``command`` as ``uid``:``gid`` without capabilities or new privileges, in a mount
    namespace (mount_script) where only ``writable`` (dir -> mode, made for ``uid``) can be
    written; with ``limits`` (shell ulimit lines) and ``filters``, the seccomp filters."""
    unshare, setpriv = sandbox_tools()
    for directory, mode in writable.items():
        directory.mkdir()
        os.chown(directory, uid, gid)
        directory.chmod(mode)
    script = [*mount_script(list(writable), log.parent / "stash"), *limits]
    script += [f"umask {umask}"] if umask else []
    prefix = [unshare, "--mount", "--propagation", "private", "--", "sh", "-ec"]
    prefix += ["\n".join([*script, 'exec "$@"']), "sh", setpriv, f"--reuid={uid}"]
    prefix += [f"--regid={gid}", "--clear-groups", "--no-new-privs", "--bounding-set=-all", "--"]
    if filters is not None:
        code = f"import sys; sys.path.append({str(REPO)!r}); import tests.test_deploy as t"
        prefix += [sys.executable, "-P", "-c", f"{code}; t.launch()", json.dumps(filters)]
    with launched([*prefix, *command], env=env, log=log, address=address) as daemon:
        yield daemon


@contextlib.contextmanager
def launched(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    log: Path,
    address: str,
    cwd: Path | None = None,
) -> Iterator[Deployed]:
    """Runs ``command`` with ``env`` over this environment less its ``KVSTORE_*`` variables,
    its output in ``log``; kills it at the end if it still runs."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    with open(log, "wb") as output:
        proc = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env={**clean, **env}, cwd=cwd
        )
    daemon = Deployed(proc, log, address)
    try:
        yield daemon
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def round_trips(address: str) -> int:
    """Puts and gets blocks on both data planes, checking every byte; the blocks now held."""
    held: set[bytes] = set()
    for plane in ("shm", "stream"):
        keys = block_keys(own_tokens(f"deploy-{plane}", 4), NAMESPACE)
        with KVStoreClient(address, use_shm=plane == "shm") as client:
            statuses = client.put(NAMESPACE, keys, [payload(key) for key in keys])
            assert client.data_plane == plane
            assert statuses[-4:] == [WriteStatus.STORED] * 4
            blocks = client.get(NAMESPACE, keys)
            assert [bytes(block) for block in blocks] == [payload(key) for key in keys]
        held |= set(keys)
    return len(held)


def scrape(port: int) -> dict[str, float]:
    """The unlabelled samples of the /metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


# systemd ------------------------------------------------------------------------------------


def unit_for_here(tmp_path: Path) -> Path:
    """The unit with ExecStart's binary swapped for this venv's ``kvstore`` (verify checks
    that it exists)."""
    binary = shlex.split(one(service(), "ExecStart"))[0]
    text = UNIT.read_text().replace(f"ExecStart={binary} ", f"ExecStart={KVSTORE} ")
    assert str(KVSTORE) in text
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    return copy


def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = unit_for_here(tmp_path)
    result = run([analyze(), "verify", "--man=no", unit])
    output = result.stdout + result.stderr
    about_it = [line for line in output.splitlines() if UNIT.name in line or str(unit) in line]
    assert about_it == [], output
    assert result.returncode == 0, output


def test_the_unit_is_rated_ok_by_systemd_analyze_security(tmp_path: Path) -> None:
    result = run([analyze(), "security", "--offline=yes", "--no-pager", unit_for_here(tmp_path)])
    assert result.returncode == 0, result.stderr
    rating = re.search(rf"exposure level for {UNIT.name}: ([0-9.]+) (\w+)", result.stdout)
    assert rating, result.stdout[-2000:]
    score = float(rating.group(1))
    assert score <= EXPOSURE_LIMIT and rating.group(2) == "OK", result.stdout
    quoted = re.search(r"`systemd-analyze security kvstore` rates it ([0-9.]+)", readme())
    assert quoted and float(quoted.group(1)) == score, "deploy/README.md quotes another score"


def test_the_unit_agrees_with_the_config_it_runs() -> None:
    settings = service()
    command = shlex.split(one(settings, "ExecStart"))
    assert command[1:3] == ["serve", "--config"]
    config_path = command[3]
    # The unit's comment (and deploy/README.md) installs the example config there.
    assert f"deploy/{EXAMPLE.name} {config_path}" in UNIT.read_text()
    assert f"deploy/{EXAMPLE.name} {config_path}" in readme()
    config = load_config(EXAMPLE, environ={})
    assert one(settings, "User") == one(settings, "Group") == "kvstore"
    assert unix_path(config).parent == Path("/run") / one(settings, "RuntimeDirectory")
    state = Path("/var/lib") / one(settings, "StateDirectory")
    assert state in Path(config.ssd.directory).parents
    assert int(one(settings, "RuntimeDirectoryMode"), 8) & 0o050 == 0o050  # the group passes
    assert timespan(one(settings, "TimeoutStopSec")) > stop_allowance(config)
    assert one(settings, "KillSignal") == "SIGTERM"
    assert shlex.split(one(settings, "ExecReload"))[1:] == ["-HUP", "$MAINPID"]
    assert one(settings, "LimitMEMLOCK") == "infinity"
    assert int(one(settings, "LimitNOFILE")) >= 4 * config.server.max_sessions
    assert one(settings, "Restart") == "on-failure"
    assert set(one(settings, "RestartPreventExitStatus").split()) == {"1", "2"}
    assert one(settings, "CapabilityBoundingSet") == ""
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices",
                "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
                "RestrictNamespaces", "LockPersonality", "MemoryDenyWriteExecute"):  # fmt: skip
        assert one(settings, key) == "yes", key
    assert one(settings, "ProtectSystem") == "strict"
    assert set(one(settings, "RestrictAddressFamilies").split()) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
    }
    assert one(settings, "SystemCallArchitectures") == "native"


def test_the_units_command_serves_in_the_units_sandbox(volumes: tuple[Path, Path]) -> None:
    settings = service()
    runtime, state = volumes  # the RuntimeDirectory and StateDirectory systemd would make
    config = load_config(EXAMPLE, environ={})
    socket_path = runtime / unix_path(config).name
    ssd = state / Path(config.ssd.directory).relative_to(
        Path("/var/lib") / one(settings, "StateDirectory")
    )
    metrics = free_port()
    env = {
        "KVSTORE_SERVER__LISTEN": f"unix:{socket_path}",
        "KVSTORE_SERVER__SOCKET_MODE": "0660",  # deploy/README.md: for the engines' group
        "KVSTORE_SSD__DIRECTORY": str(ssd),
        "KVSTORE_SSD__CAPACITY": "256MiB",
        "KVSTORE_HOST__CAPACITY": "64MiB",
        "KVSTORE_METRICS__LISTEN": f"127.0.0.1:{metrics}",
    }
    command = shlex.split(one(settings, "ExecStart"))
    command[0], command[3] = str(KVSTORE), str(EXAMPLE)
    # As far as this machine lets root raise them (a container may not: no CAP_SYS_RESOURCE).
    limits = [f"ulimit -n {one(settings, 'LimitNOFILE')} 2>/dev/null || :"]
    if one(settings, "LimitMEMLOCK") == "infinity":
        limits += ["ulimit -l unlimited 2>/dev/null || :"]
    with deployed(
        command,
        writable={
            runtime: int(one(settings, "RuntimeDirectoryMode"), 8),
            state: int(one(settings, "StateDirectoryMode"), 8),
        },
        uid=65534,  # nobody: no kvstore user here
        gid=65534,
        env=env,
        log=state.parent / "daemon.log",
        address=f"unix:{socket_path}",
        umask=one(settings, "UMask"),
        limits=limits,
        filters=unit_filters(settings),
    ) as daemon:
        daemon.wait_serving()
        assert daemon.confinement() == {
            "Uid": "65534 65534 65534 65534", "Gid": "65534 65534 65534 65534", "Groups": "",
            "CapEff": "0000000000000000", "CapBnd": "0000000000000000", "NoNewPrivs": "1",
            # system calls, write+execute memory, address families; and this process's own
            "Seccomp_filters": str(3 + int(proc_status()["Seccomp_filters"])),
        }  # fmt: skip
        assert socket_path.stat().st_mode & 0o777 == 0o660  # not cut by the unit's UMask
        held = round_trips(daemon.address)
        assert scrape(metrics)["kvstore_blocks"] == held
        reload = shlex.split(one(settings, "ExecReload"))[1].removeprefix("-")
        daemon.proc.send_signal(signal.Signals[f"SIG{reload}"])
        deadline = time.monotonic() + 10
        while "SIGHUP: applied" not in daemon.output():
            assert time.monotonic() < deadline, daemon.output()
            time.sleep(0.05)
        daemon.wait_serving()
        kill = signal.Signals[one(settings, "KillSignal")]
        assert daemon.stop(kill, timespan(one(settings, "TimeoutStopSec"))) == 0, daemon.output()
        assert "Operation not permitted" not in daemon.output()


# Dockerfile ---------------------------------------------------------------------------------


def test_the_daemon_image_installs_no_torch_and_runs_as_a_user() -> None:
    stages = dockerfile(DOCKERFILE)
    assert not [i for stage in stages for i in stage if "torch" in i.args.lower()]
    assert all(stage[0].args.split()[0] == "python:3.11-slim" for stage in stages)
    targets = [target for stage in stages for target in pip_targets(stage)]
    assert targets == [["."]], f"the project alone, without extras: {targets}"
    build = next(stage for stage in stages if any(pip_targets(stage)))
    pyproject = (REPO / "pyproject.toml").read_text()
    folders = set(re.findall(r'^"kvstore[.\w]*" = "(\w+)"$', pyproject, re.MULTILINE))
    assert folders >= {"kvstore", "wire", "tiers", "client", "protos"}
    assert set(copies(build).values()) >= folders | {
        "pyproject.toml",
        "README.md",
        "requirements.lock",
    }
    assert "-c requirements.lock" in " ".join(i.args for i in instructions(build, "RUN"))
    final = stages[-1]
    user = instructions(final, "USER")[-1].args.partition(":")[0]
    assert user not in ("root", "0") and image_uid_gid(final)[0] != 0
    command = image_command(final)
    assert command[:3] == ["kvstore", "serve", "--config"]
    assert copies(final)[command[3]] == f"deploy/{CONTAINER.name}"
    config = container_config()
    volumes = set(json.loads(instructions(final, "VOLUME")[-1].args))
    assert str(unix_path(config).parent) in volumes
    assert any(Path(volume) in Path(config.ssd.directory).parents for volume in volumes)
    exposed = {int(port) for item in instructions(final, "EXPOSE") for port in item.args.split()}
    assert exposed == {tcp_port(config), metrics_port(config)}
    assert instructions(final, "STOPSIGNAL")[-1].args == "SIGTERM"
    assert healthcheck(final)[:2] == ["kvstore", "health"]


def test_the_images_entry_command_serves_as_its_user(volumes: tuple[Path, Path]) -> None:
    final = daemon_stage()
    config = container_config()
    run_dir, lib_dir = volumes
    place = relocated(config, run_dir, lib_dir)
    config_path = image_command(final)[3]

    def here(command: list[str]) -> list[str]:
        return kvstore_here(command, config_path, CONTAINER)

    uid, gid = image_uid_gid(final)
    with deployed(
        here(image_command(final)),
        writable={run_dir: 0o750, lib_dir: 0o700},  # as the image makes them
        uid=uid,
        gid=gid,
        env=place.env,
        log=lib_dir.parent / "daemon.log",
        address=place.address,
    ) as daemon:
        daemon.wait_serving()
        confinement = daemon.confinement()
        assert confinement["Uid"] == f"{uid} {uid} {uid} {uid}" and confinement["Groups"] == ""
        assert confinement["CapEff"] == confinement["CapBnd"] == "0000000000000000"
        with KVStoreClient(f"127.0.0.1:{place.tcp}", use_shm=False) as client:
            assert client.health()  # what the Kubernetes grpc probes ask
        held = round_trips(daemon.address)
        samples = scrape(place.metrics)
        assert samples["kvstore_blocks"] == held and samples["kvstore_gets_total"] >= held
        result = run(here(healthcheck(final)), env={**os.environ, **place.env})
        assert result.returncode == 0 and "SERVING" in result.stdout, result
        stop = signal.Signals[instructions(final, "STOPSIGNAL")[-1].args]
        assert daemon.stop(stop, stop_allowance(config)) == 0, daemon.output()


# Compose ------------------------------------------------------------------------------------


def compose(path: Path = COMPOSE) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def built_from(service: Mapping[str, Any]) -> Path:
    build = service["build"]
    return (DEPLOY / str(build["context"]) / str(build["dockerfile"])).resolve()


def mounted(data: Mapping[str, Any], service: Mapping[str, Any], target: str) -> Path:
    """The file of the top-level config that ``service`` mounts at ``target``."""
    (source,) = [c["source"] for c in service["configs"] if c["target"] == target]
    return (DEPLOY / data["configs"][source]["file"]).resolve()


def daemon_services(data: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The services running the daemon's image."""
    return {
        n: s for n, s in data["services"].items() if "build" in s and built_from(s) == DOCKERFILE
    }


def daemon_config(data: Mapping[str, Any], service: Mapping[str, Any]) -> tuple[Path, Config]:
    """The config file a daemon service mounts where the image's command reads it, and the
    config it loads to with the service's environment."""
    path = mounted(data, service, image_command(daemon_stage())[3])
    return path, load_config(path, environ=service.get("environment", {}))


def mounts(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's volumes: the path in the container -> the volume."""
    return {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}


def check_daemon_service(
    data: Mapping[str, Any], service: Mapping[str, Any], config: Config
) -> tuple[str, str]:
    """A daemon service agrees with its config: the socket directory and the SSD tier on
    volumes of the file, no IPC sharing (the arenas are memfds sent over the socket), the
    config's ports published, a memory limit above the arenas and buffers, a stop grace above
    the shutdown's. Returns the socket's and the SSD tier's volumes."""
    mounted_at = mounts(service)
    socket_volume = mounted_at[str(unix_path(config).parent)]
    (ssd_volume,) = [
        v for d, v in mounted_at.items() if Path(d) in Path(config.ssd.directory).parents
    ]
    assert {socket_volume, ssd_volume} <= set(data["volumes"])
    assert not {"ipc", "shm_size"} & set(service)
    published = {int(p.rpartition(":")[2]) for p in service["ports"]}
    assert published == {tcp_port(config), metrics_port(config)}
    memory = config.host.capacity + config.server.max_buffered_bytes + INTERPRETER_BYTES
    assert compose_bytes(service["mem_limit"]) >= memory
    assert parse_duration(service["stop_grace_period"]) > stop_allowance(config)
    return socket_volume, ssd_volume


def redis_settings(data: Mapping[str, Any], service: Mapping[str, Any]) -> dict[str, list[str]]:
    """What a redis-server service runs with, as redis-server reads it: the config file its
    command names (a file the service mounts), then the command's ``--name value...`` over it."""
    command = [str(word) for word in service["command"]]
    assert command[0] == "redis-server", command
    words = command[1:]
    settings: dict[str, list[str]] = {}
    if words and not words[0].startswith("--"):
        for line in mounted(data, service, words[0]).read_text().splitlines():
            if line.strip() and not line.strip().startswith("#"):
                name, *values = shlex.split(line)
                settings[name.lower()] = values
        words = words[1:]
    name = ""
    for word in words:
        if word.startswith("--"):
            name = word[2:].lower()
            settings[name] = []
        else:
            settings[name].append(word)
    return settings


@pytest.mark.parametrize("path", [COMPOSE, CLUSTER_COMPOSE], ids=lambda path: path.name)
def test_compose_file_follows_the_compose_specification(path: Path) -> None:
    schema = json.loads(
        package_file("check_jsonschema", "builtin_schemas/vendor/compose-spec.json").read_text()
    )
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(compose(path))]
    assert errors == []


def test_compose_engine_shares_the_daemons_socket_and_redis_is_the_tier() -> None:
    data = compose()
    services = data["services"]
    ((daemon_name, daemon),) = daemon_services(data).items()
    engine_name, engine = next((n, s) for n, s in services.items() if "engine" in n)
    path, config = daemon_config(data, daemon)
    assert path == CONTAINER
    assert config.redis.enabled
    redis_host = urlparse(config.redis.url).hostname
    assert redis_host in services and services[redis_host]["image"].startswith("redis:7")
    maxmemory = redis_settings(data, services[redis_host])["maxmemory"]
    assert compose_bytes(maxmemory[0]) > config.redis.capacity
    socket_volume, _ = check_daemon_service(data, daemon, config)
    assert mounts(engine)[str(unix_path(config).parent)] == socket_volume
    assert not {"ipc", "shm_size"} & set(engine)  # memfds over the socket
    assert engine["depends_on"][daemon_name]["condition"] == "service_healthy"
    command = engine.get("command") or image_command(dockerfile(built_from(engine))[-1])
    assert command[command.index("--address") + 1] == f"unix:{unix_path(config)}", engine_name


def test_the_engine_images_command_chats_through_a_daemon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvstore.cli import main

    engine = dockerfile(DEPLOY / "engine.Dockerfile")[-1]
    targets = pip_targets(engine)
    assert targets == [[".[engine]"]]
    installs = " ".join(i.args for i in instructions(engine, "RUN"))
    # At the lock's versions; its torch is the CPU build, on PyTorch's CPU index.
    assert "-c requirements.lock" in installs and "download.pytorch.org/whl/cpu" in installs
    # The engine's user is in the daemon's socket group.
    socket_group = image_uid_gid(daemon_stage())[1]
    user = instructions(engine, "USER")[-1].args
    runs = " ".join(item.args for item in instructions(engine, "RUN"))
    assert re.search(rf"useradd [^&]*--groups kvstore[^&]* {user}\b", runs)
    assert created_id(engine, "groupadd", "kvstore") == socket_group
    command = image_command(engine)
    assert command[:2] == ["kvstore", "chat"] and "--random" in command  # the image has no model
    with running_daemon(tmp_path) as daemon:
        address = command.index("--address") + 1
        argv = [
            *command[1:address],
            daemon.address,
            *command[address + 1 :],
            "--turns",
            "2",
            "--no-recompute",
        ]
        assert main(argv) == 0
    out = capsys.readouterr().out
    turn = re.search(r"turn 2: .* loaded (\d+) \(host (\d+) blocks\)", out)
    assert turn and int(turn.group(2)) > 0, out


# Compose: two daemons on a Redis Cluster -----------------------------------------------------


def cluster_nodes(data: Mapping[str, Any]) -> dict[str, dict[str, list[str]]]:
    """The services running a Redis Cluster node, with their redis-server settings."""
    found = {}
    for name, service in data["services"].items():
        if str(service.get("command", [""])[0]) == "redis-server":
            settings = redis_settings(data, service)
            if settings.get("cluster-enabled") == ["yes"]:
                found[name] = settings
    return found


def cluster_create(data: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The service whose script runs ``redis-cli --cluster create``, and that command's words."""
    for name, service in data["services"].items():
        script = "\n".join(str(word) for word in service.get("command", []))
        for line in script.replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            if words[:3] == ["redis-cli", "--cluster", "create"]:
                return name, words
    pytest.fail("no service runs redis-cli --cluster create")


def created_shape(create: Sequence[str]) -> tuple[list[str], int]:
    """The nodes (``host:port``) a ``--cluster create`` joins, and the replicas per primary."""
    nodes = list(itertools.takewhile(lambda word: not word.startswith("--"), create[3:]))
    assert "--cluster-yes" in create  # no one answers the prompt in a container
    assert "--cluster-replicas" in create, "without --cluster-replicas, no primary has a replica"
    return nodes, int(create[create.index("--cluster-replicas") + 1])


def test_the_cluster_compose_file_agrees_with_its_configs() -> None:
    data = compose(CLUSTER_COMPOSE)
    services = data["services"]
    nodes = cluster_nodes(data)
    ports = {name: int(settings["port"][0]) for name, settings in nodes.items()}
    init, create = cluster_create(data)
    joined, replicas = created_shape(create)
    assert sorted(joined) == sorted(f"{name}:{port}" for name, port in ports.items())
    primaries, unpaired = divmod(len(nodes), 1 + replicas)
    assert replicas >= 1 and unpaired == 0 and primaries >= 3  # a cluster needs 3 primaries
    assert services[init]["depends_on"] == {n: {"condition": "service_healthy"} for n in nodes}
    # Every node announces a fixed address on the network, outside the range Compose hands to
    # other containers: what the daemons are told and what nodes.conf keeps stay true.
    (pool,) = data["networks"]["default"]["ipam"]["config"]
    subnet, dynamic = ipaddress.ip_network(pool["subnet"]), ipaddress.ip_network(pool["ip_range"])
    announced = set()
    for name, settings in nodes.items():
        service = services[name]
        assert service["image"].startswith("redis:7")
        address = service["networks"]["default"]["ipv4_address"]
        assert settings["cluster-announce-ip"] == [address], name
        assert (
            ipaddress.ip_address(address) in subnet and ipaddress.ip_address(address) not in dynamic
        )
        announced.add(address)
        probe = service["healthcheck"]["test"]
        assert probe[:2] == ["CMD", "redis-cli"] and probe[-1] == "ping"
        assert int(probe[probe.index("-p") + 1]) == ports[name]
        assert settings["save"] == [""] and settings["appendonly"] == ["no"]  # a cache
        assert settings["maxmemory-policy"][0].startswith("allkeys-")
        assert settings["cluster-require-full-coverage"] == ["no"]  # a lost shard costs its slots
        # Beyond maxmemory: a replica's full sync forks the primary (copy-on-write), buffers.
        maxmemory = compose_bytes(settings["maxmemory"][0])
        assert compose_bytes(service["mem_limit"]) >= maxmemory * 3 // 2, name
    assert len(announced) == len(nodes)
    daemons = daemon_services(data)
    assert len(daemons) == 2
    configs, volumes, host_ports = [], [], []
    for name, service in daemons.items():
        _, config = daemon_config(data, service)
        assert config.redis.enabled and config.redis.url.startswith("redis+cluster://"), name
        assert sorted(cluster_seeds(config.redis.url)) == sorted(ports.items()), name
        assert config.redis.write_policy == "write_through"  # the other node finds it at once
        volumes += check_daemon_service(data, service, config)
        host_ports += [port.rsplit(":", 2)[-2] for port in service["ports"]]
        assert set(service.get("networks", ["default"])) == {"default"}  # the nodes' network
        assert service["depends_on"] == {init: {"condition": "service_completed_successfully"}}
        configs.append(config)
    assert len(set(volumes)) == len(volumes)  # each its own socket and SSD volume
    assert len(set(host_ports)) == len(host_ports)
    assert len({config.redis.key_prefix for config in configs}) == 1  # one shared set of blocks
    # The slots are split evenly over the primaries; 25% for keys hashing unevenly.
    written = sum(config.redis.capacity for config in configs)
    least = min(compose_bytes(settings["maxmemory"][0]) for settings in nodes.values())
    assert primaries * least >= written * 5 // 4


def test_the_cluster_compose_files_commands_share_a_chain_between_its_nodes(
    short_dir: Path,
) -> None:
    """The compose file's own commands, run here: each node's redis-server command, the init
    service's script (twice: the second time, as when the project starts again, it creates
    nothing), and the daemons' image command with their config. A chain node-a saves, node-b
    reads bit-exact from the cluster; with the whole cluster dead, node-b still serves it and
    takes new blocks, and the image's health check passes. On this machine every node is
    127.0.0.1: its address (cluster-announce-ip), its ports and the ``service:port`` names in
    the script and the Redis URL are mapped to 127.0.0.1 and free local ports; nothing else
    changes."""
    server = tool("redis-server", "apt-get install redis-server")
    tool("redis-cli", "apt-get install redis-tools")
    data = compose(CLUSTER_COMPOSE)
    services = data["services"]
    nodes = cluster_nodes(data)
    drawn: set[int] = set()
    while len(drawn) < 2 * len(nodes):
        drawn.add(free_port())
    free = iter(drawn)
    local = {name: (next(free), next(free)) for name in nodes}  # its port, its bus port

    def on_this_machine(text: str) -> str:
        for name, (port, _) in local.items():
            named = rf"(?<![\w.-]){re.escape(name)}:{nodes[name]['port'][0]}(?!\d)"
            text = re.sub(named, f"127.0.0.1:{port}", text)
        assert not any(re.search(rf"(?<![\w.-]){re.escape(n)}:\d", text) for n in nodes), text
        return text

    stage = daemon_stage()
    config_path = image_command(stage)[3]
    stop = signal.Signals[instructions(stage, "STOPSIGNAL")[-1].args]
    redis_nodes: list[Deployed] = []
    with contextlib.ExitStack() as stack:
        for name in nodes:
            command = [str(word) for word in services[name]["command"]]
            command[0], command[1] = server, str(mounted(data, services[name], command[1]))
            command[command.index("--cluster-announce-ip") + 1] = "127.0.0.1"
            port, bus = local[name]
            workdir = short_dir / name  # the image's working directory, /data: nodes.conf
            workdir.mkdir()
            node = launched(
                [*command, "--port", str(port), "--cluster-port", str(bus)],
                env={},
                log=workdir / "redis.log",
                address=f"127.0.0.1:{port}",
                cwd=workdir,
            )
            redis_nodes.append(stack.enter_context(node))
        ports = [port for port, _ in local.values()]
        wait_for(lambda: all(redis_command(port, "PING") == "+PONG" for port in ports))
        init, create = cluster_create(data)
        script = [on_this_machine(str(word)) for word in services[init]["command"]]
        created = run(script)
        assert created.returncode == 0 and "All 16384 slots covered" in created.stdout, created
        again = run(script)  # it leaves the cluster alone: no slots allocated, no error
        assert again.returncode == 0 and "slots" not in again.stdout + again.stderr, again
        wait_for(
            lambda: all("cluster_state:ok" in redis_command(p, "CLUSTER", "INFO") for p in ports)
        )
        daemons: dict[str, Deployed] = {}
        configs: dict[str, Config] = {}
        checks: dict[str, tuple[list[str], dict[str, str]]] = {}  # health check command, env
        for name, service in daemon_services(data).items():
            path, configs[name] = daemon_config(data, service)
            (short_dir / name).mkdir()
            place = relocated(configs[name], short_dir / name / "run", short_dir / name / "lib")
            env = {**service.get("environment", {}), **place.env}
            env["KVSTORE_REDIS__URL"] = on_this_machine(configs[name].redis.url)
            daemon = launched(
                kvstore_here(image_command(stage), config_path, path),
                env=env,
                log=short_dir / name / "daemon.log",
                address=place.address,
            )
            daemons[name] = stack.enter_context(daemon)
            checks[name] = (kvstore_here(healthcheck(stage), config_path, path), env)
        for daemon in daemons.values():
            daemon.wait_serving()
        writer, reader = sorted(daemons)  # node-a saves, node-b reads
        keys = block_keys(own_tokens("deploy-cluster", 12), NAMESPACE)
        with KVStoreClient(daemons[writer].address) as client:
            statuses = client.put(NAMESPACE, keys, [payload(key) for key in keys])
            assert statuses == [WriteStatus.STORED] * len(keys)
        with KVStoreClient(daemons[reader].address) as client:
            found = client.lookup_tiers(NAMESPACE, keys)
            assert found.num_blocks == len(keys) and set(found.tiers) == {"redis"}
            assert [bytes(block) for block in client.get(NAMESPACE, keys)] == [
                payload(key) for key in keys
            ]
        # The chain went through the cluster: spread over its primaries.
        primaries = [port for port in ports if "master" in redis_command(port, "ROLE")]
        joined, replicas = created_shape(create)
        assert len(primaries) == len(joined) // (1 + replicas)
        held = [dbsize(port) for port in primaries]
        assert sum(held) == len(keys) and sum(1 for count in held if count) >= 2, held
        # The whole cluster dies: node-b serves the chain from its host tier and takes new
        # blocks, and the image's health check still passes (the container is not restarted).
        for node in redis_nodes:
            node.proc.kill()
            node.proc.wait(10)
        with KVStoreClient(daemons[reader].address) as client:
            assert [bytes(block) for block in client.get(NAMESPACE, keys)] == [
                payload(key) for key in keys
            ]
            more = block_keys(own_tokens("deploy-cluster-down", 4), NAMESPACE)
            statuses = client.put(NAMESPACE, more, [payload(key) for key in more])
            assert statuses[-4:] == [WriteStatus.STORED] * 4  # past the prefix both chains share
            assert [bytes(block) for block in client.get(NAMESPACE, more)] == [
                payload(key) for key in more
            ]
        check, env = checks[reader]
        result = run(check, env={**os.environ, **env})
        assert result.returncode == 0 and "SERVING, degraded: redis" in result.stdout, result
        for name, daemon in daemons.items():
            assert daemon.stop(stop, stop_allowance(configs[name])) == 0, daemon.output()


# Kubernetes ---------------------------------------------------------------------------------


def manifests() -> dict[str, dict[str, Any]]:
    """The manifests in deploy/kubernetes by kind."""
    found = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            found[document["kind"]] = document
    return found


def readme() -> str:
    return (DEPLOY / "README.md").read_text()


def readme_pod() -> dict[str, Any]:
    (block,) = [
        b for b in re.findall(r"```yaml\n(.*?)```", readme(), re.DOTALL) if "kind: Pod" in b
    ]
    pod = yaml.safe_load(block)
    assert isinstance(pod, dict)
    return pod


def test_kubernetes_manifests_follow_the_kubernetes_schemas() -> None:
    package_file("kubernetes_validate", "kubernetes-json-schema")
    from kubernetes_validate import utils

    documents = [*manifests().values(), readme_pod()]
    assert {d["kind"] for d in documents} == {"ConfigMap", "DaemonSet", "Service", "Pod"}
    for document in documents:
        try:
            utils.validate(document, KUBERNETES_VERSION, strict=True)
        except utils.ValidationError as error:
            pytest.fail(f"{document['kind']}: {error.message} at {list(error.absolute_path)}")


def test_the_configmap_holds_the_container_config(tmp_path: Path) -> None:
    (text,) = manifests()["ConfigMap"]["data"].values()
    assert text == CONTAINER.read_text()
    copy = tmp_path / "kvstore.toml"
    copy.write_text(text)
    assert load_config(copy, environ={}) == container_config()


def test_the_daemonset_agrees_with_the_config() -> None:
    found = manifests()
    config = container_config()
    pod = found["DaemonSet"]["spec"]["template"]
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert "command" not in container and "args" not in container  # the image's command
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": tcp_port(config), "metrics": metrics_port(config)}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == tcp_port(config), probe
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == metrics_port(config)
    assert annotations["prometheus.io/path"] == "/metrics"
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    socket_dir = str(unix_path(config).parent)
    socket = volumes[mounts[socket_dir]]["hostPath"]
    assert socket == {"path": socket_dir, "type": "DirectoryOrCreate"}
    assert any(Path(path) in Path(config.ssd.directory).parents for path in mounts)
    config_path = Path(image_command(daemon_stage())[3])
    source = volumes[mounts[str(config_path.parent)]]["configMap"]
    assert source["name"] == found["ConfigMap"]["metadata"]["name"]
    assert config_path.name in found["ConfigMap"]["data"]
    assert not any(v.get("emptyDir", {}).get("medium") == "Memory" for v in volumes.values())
    limit = quantity(container["resources"]["limits"]["memory"])
    assert limit >= config.host.capacity + config.server.max_buffered_bytes + INTERPRETER_BYTES
    assert spec["terminationGracePeriodSeconds"] > stop_allowance(config)
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert spec["securityContext"]["runAsNonRoot"]
    uid, gid = image_uid_gid(daemon_stage())
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]) == (
        uid,
        gid,
    )
    (init,) = spec["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert f"chown {uid}:{gid} {socket_dir}" in " ".join(init["command"])
    for variable in container.get("env", []):
        load_config(CONTAINER, environ={variable["name"]: "token:tenant"})


def test_the_service_reaches_the_daemon_on_the_clients_node() -> None:
    found = manifests()
    pod = found["DaemonSet"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    service = found["Service"]["spec"]
    assert service["internalTrafficPolicy"] == "Local"
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    named = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert {port["port"]: named[port["targetPort"]] for port in service["ports"]} == {
        port: port for port in named.values()
    }


def test_the_readme_engine_pod_mounts_only_the_socket_directory() -> None:
    pod = readme_pod()
    config = container_config()
    daemonset = manifests()["DaemonSet"]["spec"]["template"]["spec"]
    socket_volume = next(
        v
        for v in daemonset["volumes"]
        if v.get("hostPath", {}).get("path") == str(unix_path(config).parent)
    )
    (volume,) = pod["spec"]["volumes"]
    assert volume["hostPath"]["path"] == socket_volume["hostPath"]["path"]
    (container,) = pod["spec"]["containers"]
    assert container["volumeMounts"] == [
        {"name": volume["name"], "mountPath": str(unix_path(config).parent)}
    ]
    assert image_uid_gid(daemon_stage())[1] in pod["spec"]["securityContext"]["supplementalGroups"]
    command = container["command"]
    assert command[command.index("--address") + 1] == f"unix:{unix_path(config)}"
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and path.name != "README.md":
            assert str(path.relative_to(DEPLOY)) in readme(), f"deploy/README.md: {path.name}?"
