"""``import kvstore.client`` loads no daemon module: only the client, the wire layer it shares
with the daemon (:mod:`kvstore.wire`) and the generated protos.

A fresh interpreter (``-P``: the checkout's root never shadows the installed package) imports
the client and reports ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys

SHARED = ("kvstore.client", "kvstore.wire", "kvstore.protos")


def loaded_by(statement: str) -> set[str]:
    """The project's modules a fresh interpreter holds after running ``statement``."""
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    return {name for name in modules if name == "kvstore" or name.startswith("kvstore.")}


def test_the_client_loads_only_itself_the_wire_layer_and_the_protos() -> None:
    modules = loaded_by("import kvstore.client")
    assert "kvstore.client.client" in modules  # the client is there
    others = {name for name in modules - {"kvstore"} if not name.startswith(SHARED)}
    assert others == set(), f"the client loads daemon modules: {sorted(others)}"


def test_the_check_sees_a_daemon_module() -> None:
    """The same check fails for a process that loads the daemon's store beside the client."""
    modules = loaded_by("import kvstore.client, kvstore.store")
    assert {"kvstore.store", "kvstore.tiers.host"} <= modules
