"""End-to-end benchmarks of the engine with and without the store (``kvstore bench chat``).

The chat bench replays multi-turn workloads (:mod:`.workloads`) through the engine's
:class:`~kvstore.inference_adapter.sessions.ChatServer`, in recompute mode (no store) and in
kvstore mode (a daemon it starts per store configuration, :mod:`.daemon`), turn by turn in
the same run (:mod:`.runner`, :mod:`.replay`), and fails when the two modes generate
different tokens. :mod:`.report` turns the per-turn records into tables and JSON,
:mod:`.plots` into PNGs; :mod:`.presets` sizes everything; :mod:`.chat` is the command.
:mod:`.sharegpt` reads real ShareGPT V3 conversations for ``--dataset sharegpt``.

The package's other benches: :mod:`.truncation` (``kvstore bench truncation``: perplexity of
real replies past a chat truncation, SmolLM2, recompute vs reuse vs naive reuse),
:mod:`.vllm` (``kvstore bench vllm``, with the chat driver :mod:`.vllm_chat`) and :mod:`.gpu`
(``kvstore bench gpu``: store hits against recompute and the load and save rates against the
host link, per prompt length, on one device; :mod:`.gpu_runs`, :mod:`.gpu_models`,
:mod:`.gpu_report`, :mod:`.bandwidth`).

Method, and what it leaves out:

- Replay is sequential, in simulated arrival order (Poisson sessions or a fixed QPS): the
  CPU engine runs one turn at a time. TTFT is measured from the turn's admission to its
  first token; simulated queueing is not added. The queue of turns that arrived next is
  what the chat server names in its prefetch hints.
- Each answer's first ``generated`` tokens are sampled by the model (greedy) and compared
  between modes; the rest of the answer is scripted tokens of the workload's length (CPU
  decode of hundreds of tokens per turn would take the bench's whole budget). In kvstore
  mode an untimed one-token request then saves the scripted part's KV, as a server saving
  KV during decode would; the next turn computes only its new message (and the partial
  last block). The replay waits for the saves after every turn, so each turn sees the same
  store state whatever the machine's speed.
"""

from kvstore.inference_adapter.bench.chat import add_bench_parser, main

__all__ = ["add_bench_parser", "main"]
