"""Protocol definitions (``kvstore/v1/kvstore.proto``) and their generated code.

Import the messages and stubs as ``from kvstore.protos.kvstore.v1 import kvstore_pb2``.
"""
