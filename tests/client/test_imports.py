"""``import kvstore.client`` loads none of the daemon's serving, storage or index modules.

A fresh interpreter (``-P``: the checkout's root never shadows the installed package) imports
the client and reports ``sys.modules``. The client still loads the tiers package's ``base``
and ``threads`` (its copy helpers live there) with the shared values (``blocks``,
``namespace``, ``chunks``, ``shm_wire``, ``results``, ...).
"""

from __future__ import annotations

import json
import subprocess
import sys

DAEMON = {
    "kvstore.arena", "kvstore.budget", "kvstore.cli", "kvstore.config", "kvstore.index",
    "kvstore.leases", "kvstore.metrics", "kvstore.policies", "kvstore.server",
    "kvstore.service", "kvstore.servicer", "kvstore.sessions", "kvstore.store",
    "kvstore.streams", "kvstore.tiering", "kvstore.tiers.allocator", "kvstore.tiers.collector",
    "kvstore.tiers.host", "kvstore.tiers.locks", "kvstore.tiers.redis", "kvstore.tiers.ssd",
    "kvstore.tiers.ssd_files",
}  # fmt: skip


def test_the_client_loads_no_daemon_serving_storage_or_index_module() -> None:
    code = "import json, sys, kvstore.client; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    modules = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "kvstore.client.client" in modules  # the client is there
    assert modules & DAEMON == set()
