"""Protocol definitions (kvstore/v1/kvstore.proto) and their generated code."""
