"""A concurrency stress harness: a real daemon on tiny tiers, many client processes and tasks.

Two runs, each of which checks every byte it reads against content derived from the block's
key and the tenant whose namespace holds it (``payload(tenant, key)``: SHAKE-256 of both), so
that another block's bytes, another tenant's bytes, a torn or reused slot all read as *wrong*:

- :func:`run_daemon_stress`: one ``kvstore serve`` (host + SSD + the real Redis, write-back
  all the way down, tiers a few dozen blocks each so eviction, demotion and promotion run all
  the time), three tenants with tokens, and ``workers`` client processes
  (``python -m tests.support.stress --worker CONFIG``), each with ``tasks`` asyncio tasks
  doing a random mix of puts (shm and stream planes), gets (bytes and ``out=`` buffers),
  views, lookups, deletes of a chain's suffix, prefetch hints, cancelled gets/views/puts,
  slow readers whose lease expires, probes of another tenant's keys under the tenant's own
  namespace (must miss or read the tenant's own content) and calls on another tenant's
  namespace digest (must be refused). At the end: no lease or reservation left once the
  clients are gone (checked at once, well inside the lease lifetime), no lease expired on the
  daemon that no client saw expire and no reservation expired before its commit (both
  counted in the daemon's log), the daemon alive, SERVING and without a traceback in its log,
  every chain ever written reads back exactly (both planes, with ``verify``, and a view), and
  a whole put of each chain at idle leaves all of it held (a DEDUP for a block nobody can
  read is a lost write).
- :func:`run_store_stress`: the same kind of load on an in-process
  :class:`kvstore.store.BlockStore` (host + SSD + Redis tiers), including ``acquire`` read
  through the tenant's arena mapping (released by owner; a release by another tenant must be
  refused), ``reserve``/``commit`` writes, ``get_layer``, and puts, reserves and gets that are
  cancelled midway (as the daemon's streams are when their client goes away).

Both return a JSON-able report whose ``problems`` list is empty on a healthy run. Chains come
from a small fixed universe (families of prompts sharing prefix blocks, branches sharing the
family prefix) so different tasks and processes write the same keys: DEDUP, shared parents
and concurrent promotions of one block happen constantly.

The modules: ``content`` (the universe: chains and payloads), ``tally`` (what a run saw),
``workers``, ``worker_ops`` and ``foreign_ops`` (the client worker processes and their ops),
``processes`` (spawning them, and a private redis-server), ``daemon_run`` and
``daemon_scan`` (the daemon run and its final scan), ``store_ops`` and ``store_run`` (the
in-process run), ``checks`` (the figures and checks both runs share), ``__main__`` (the
script).

As a script, from the repository root (prints the report as JSON; exit status 1 when there
are problems)::

    python -m tests.support.stress --seconds 600 [--workers 4] [--tasks 12] [--store-seconds 60]
"""

from __future__ import annotations

from tests.support.stress.checks import summary
from tests.support.stress.content import BLOCK, MODEL, TENANTS, payload
from tests.support.stress.daemon_run import run_daemon_stress
from tests.support.stress.store_run import run_store_stress

__all__ = [
    "BLOCK",
    "MODEL",
    "TENANTS",
    "payload",
    "run_daemon_stress",
    "run_store_stress",
    "summary",
]
