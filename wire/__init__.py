"""What the daemon and its clients share: the wire layer, below both.

- :mod:`kvstore.wire.blocks` -- a block's layout and payload format, key size, root key, the
  payload checksum and a written block's spec (``codecs`` holds the payload codecs);
- :mod:`kvstore.wire.namespace` -- model fingerprints, namespaces and block ids;
- :mod:`kvstore.wire.chunks` -- the hand-written codec of Get's and Put's streamed chunks;
- :mod:`kvstore.wire.session` -- the shm session protocol on the daemon's unix socket;
- :mod:`kvstore.wire.results` -- the values a call answers (lookups, put statuses, stats);
- :mod:`kvstore.wire.threads` -- copies in worker threads and whole reads of a descriptor;
- :mod:`kvstore.wire.channels` -- gRPC channels to the daemon (options, TLS).

The daemon (``kvstore``, ``kvstore.tiers``) and the client (``kvstore.client``) import these;
this package imports neither (``tests/test_layering.py``). It imports nothing itself, so a
process loads only the modules it uses.
"""
