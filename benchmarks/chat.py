"""Multi-turn chat TTFT, prefill throughput and hit rates, kvstore against recompute.

    python -m benchmarks.chat [--quick] [--out DIR] [--json FILE] ...

The same as ``kvstore bench chat``; the bench lives in ``kvstore.inference_adapter.bench``
(installed with the project). See docs/BENCHMARKS.md for a recorded run.
"""

import sys

from kvstore.inference_adapter.bench.chat import main

if __name__ == "__main__":
    sys.exit(main())
