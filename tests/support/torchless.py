"""The daemon and the client where torch cannot be imported: ``python torchless.py``.

Imports the client and the daemon's modules, starts a real daemon (``python -m kvstore serve``
through tests/support/daemon.py), then on each data plane puts a chain of blocks (bytes and
numpy arrays) and reads it back (new bytes, into numpy arrays and bytearrays, and as views),
with checksums on. Prints one JSON report line. tests/test_packaging.py runs it with torch
blocked (tests/support/no_torch on ``PYTHONPATH``) and in a fresh venv where only
``pip install .`` ran; so it loads nothing of the repository but daemon.py, by path, and
``kvstore`` is whichever is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np

DAEMON_MODULES = ["kvstore.cli", "kvstore.server", "kvstore.service", "kvstore.servicer"]


def load_daemon_support() -> ModuleType:
    path = Path(__file__).with_name("daemon.py")
    spec = importlib.util.spec_from_file_location("torchless_daemon_support", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def round_trip(address: str, use_shm: bool, tenant: str) -> dict[str, object]:
    from kvstore.client import KVStoreClient, ModelFingerprint, Namespace, block_keys

    # 512 KiB blocks: 8 of them take the threaded copies, split over threads.
    model = ModelFingerprint("torchless", 4, 4, 128, "float16", block_tokens=64)
    namespace = Namespace(model, tenant)
    size = model.layout().payload_bytes
    keys = block_keys(list(range(8 * model.block_tokens)), namespace)
    rng = np.random.default_rng(len(tenant))
    arrays = [rng.standard_normal(size // 2).astype(np.float16) for _ in keys[4:]]
    blocks: list[object] = [rng.bytes(size) for _ in keys[:4]] + arrays
    expected = [bytes(memoryview(block)) for block in blocks]  # type: ignore[arg-type]
    with KVStoreClient(address, use_shm=use_shm, verify=True) as client:
        statuses = client.put(namespace, keys, blocks)  # type: ignore[arg-type]
        copies = client.get(namespace, keys)
        into_arrays = client.get(namespace, keys, out=[np.empty(size, np.uint8) for _ in keys])
        into_buffers = client.get(namespace, keys, out=[bytearray(size) for _ in keys])
        with client.view(namespace, keys) as views:
            viewed = [bytes(view) for view in views]
        try:
            with client.view_tensors(namespace, keys):
                tensors_error = "none"
        except ModuleNotFoundError as error:
            tensors_error = f"{error.name}: {error}"
        plane = client.data_plane
    return {
        "plane": plane,
        "statuses": [status.name for status in statuses],
        "exact": {
            "get": copies == expected,
            "get out=arrays": [a.tobytes() for a in into_arrays] == expected,
            "get out=bytearrays": [bytes(b) for b in into_buffers] == expected,
            "view": viewed == expected,
        },
        "view_tensors_error": tensors_error,
    }


def main() -> dict[str, object]:
    import kvstore.client

    for name in DAEMON_MODULES:
        importlib.import_module(name)
    attempts_before_use = _attempts()
    support = load_daemon_support()
    with tempfile.TemporaryDirectory(prefix="torchless-") as workdir:
        daemon = support.Daemon(Path(workdir), host_capacity="32MiB")
        try:
            daemon.start()
            daemon_pid = daemon.proc.pid
            planes = [
                round_trip(daemon.address, True, "torchless-shm"),
                round_trip(daemon.address, False, "torchless-stream"),
            ]
            maps = Path(f"/proc/{daemon_pid}/maps").read_text()
        finally:
            exit_status = daemon.stop()
            daemon.close()
    return {
        "client_dir": str(Path(kvstore.client.__file__).parent),
        "attempts_before_use": attempts_before_use,
        "torch_in_modules": sorted(m for m in sys.modules if m.partition(".")[0] == "torch"),
        "torch_importable": _importable("torch"),
        "planes": planes,
        "daemon_pid": daemon_pid,
        "daemon_maps_libtorch": "libtorch" in maps,
        "daemon_exit": exit_status,
    }


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _attempts() -> list[str]:
    """The imports of torch & co. the blocker refused so far (none without it)."""
    blocker = sys.modules.get("sitecustomize")
    return list(getattr(blocker, "ATTEMPTS", []))


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
