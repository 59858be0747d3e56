"""Bench sizes: the model, the workloads and the store configurations of each preset.

``default`` is sized for a 2-core CPU: a random Llama of 4 layers x 256 hidden (2 query
heads over 1 KV head, head_dim 128, vocab 1024, fp32, 4096 positions, 4 KiB of KV per
token), whose 2K-token prefill takes about a second there (the CPU attention is the torch
reference, which materialises the score matrix: fewer, wider heads halve it), with
histories of a few thousand tokens. ``quick`` is the same model on smaller workloads;
``smoke`` is a toy that only checks the machinery (the test suite runs it). ``quick`` skips
the tier sweep unless asked: its workload fits the smallest host tier.

Store configurations (:func:`tier_setups`) are sized from a workload's unique KV bytes
``W`` (every full block of every session's final context): the host tier holds
``host_share * W`` but at least two full contexts (a load larger than the arena fails
whole), a *constrained* SSD tier ``ssd_share * W``, an *ample* one and Redis ``4 * W``.
The main kvstore mode runs host + ample SSD with the scheduler-aware policy (LRU where
this build lacks it); the tier sweep and the policy comparison run the ShareGPT workload
on the others.

On real conversations (``--dataset sharegpt``: the preset's ``dataset`` shape, and a model
with the tokenizer's vocabulary) the sweep is the hit-rate-by-tier grid
(:func:`grid_setups`): a host tier of each of ``host_fractions`` of ``W`` (raised to the
longest prompt's KV where that is more, as a load needs it all in the arena), host only,
+ an SSD of ``ssd_share * W``, + Redis ``4 * W``, each under LRU and scheduler-aware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvstore.inference_adapter.bench.daemon import TierSetup
from kvstore.inference_adapter.bench.workloads import (
    DatasetShape,
    DocumentShape,
    QaShape,
    ShareGptShape,
    Workload,
)
from kvstore.inference_adapter.model import LlamaModel
from kvstore.inference_adapter.weights import LlamaConfig
from kvstore.kernels.rope import RopeConfig
from kvstore.policies import EVICTION_POLICIES

__all__ = [
    "PRESETS",
    "GridPoint",
    "ModelSize",
    "Preset",
    "build_model",
    "grid_setups",
    "main_setup",
    "tier_setups",
]

SCHEDULER_AWARE = "scheduler_aware"


@dataclass(frozen=True, slots=True)
class ModelSize:
    """A random Llama's architecture and the engine's page (= store block) size."""

    hidden: int = 256
    layers: int = 4
    heads: int = 2
    kv_heads: int = 1
    vocab: int = 1024
    max_positions: int = 4096
    block_tokens: int = 64

    def config(self) -> LlamaConfig:
        head_dim = self.hidden // self.heads
        return LlamaConfig(
            hidden_size=self.hidden,
            intermediate_size=self.hidden * 11 // 4,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=head_dim,
            vocab_size=self.vocab,
            rope=RopeConfig(head_dim, 10000.0),
            max_position_embeddings=self.max_positions,
        )

    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * (self.hidden // self.heads) * 4  # fp32

    def describe(self) -> str:
        return (
            f"random Llama, {self.layers} layers x {self.hidden} hidden, {self.heads} query / "
            f"{self.kv_heads} KV heads (head_dim {self.hidden // self.heads}), vocab "
            f"{self.vocab}, fp32, {self.max_positions} positions; blocks of {self.block_tokens}"
            f" tokens ({self.kv_bytes_per_token() * self.block_tokens // 1024} KiB)"
        )


@dataclass(frozen=True, slots=True)
class Preset:
    """Everything a run's size depends on."""

    name: str
    model: ModelSize = field(default_factory=ModelSize)
    generated: int = 8  # answer tokens the model samples per turn
    sharegpt: ShareGptShape = field(default_factory=ShareGptShape)
    dataset: DatasetShape = field(default_factory=DatasetShape)  # --dataset sharegpt
    qa: QaShape = field(default_factory=QaShape)
    document: DocumentShape = field(default_factory=DocumentShape)
    host_share: float = 0.125
    ssd_share: float = 0.25  # the constrained SSD of the sweep
    hint_ttl_s: float = 10.0  # how long a prefetch hint protects its blocks
    sweep: bool = True  # run the tier sweep and policy comparison unless told otherwise
    host_fractions: tuple[float, ...] = (0.1, 0.25, 0.5)  # of W: the grid's host tiers


PRESETS = {
    "default": Preset(
        "default",
        sharegpt=ShareGptShape(sessions=20),
        qa=QaShape(users=6, rounds=4, system_tokens=768, history_tokens=1536),
        document=DocumentShape(document_tokens=3000, questions=10),
    ),
    "quick": Preset(
        "quick",
        sharegpt=ShareGptShape(sessions=5, warmup_share=0.2),
        dataset=DatasetShape(sessions=5, warmup_share=0.2),
        qa=QaShape(users=3, rounds=3, system_tokens=512, history_tokens=1536),
        document=DocumentShape(document_tokens=2048, questions=4),
        sweep=False,  # the host tier (two contexts) would hold this whole workload anyway
    ),
    "smoke": Preset(
        "smoke",
        model=ModelSize(
            hidden=64, layers=2, heads=4, kv_heads=2, vocab=256, max_positions=512, block_tokens=16
        ),
        generated=3,
        sharegpt=ShareGptShape(
            sessions=3,
            user_words=12,
            answer_words=24,
            warmup_share=0.0,
            arrival_rate=1.0,
            mean_gap_s=1.0,
        ),
        dataset=DatasetShape(
            sessions=4,
            max_message_tokens=48,
            max_answer_tokens=64,
            pool=500,
            warmup_share=0.0,
            arrival_rate=1.0,
            mean_gap_s=1.0,
        ),
        host_fractions=(0.25, 0.5),
        qa=QaShape(
            users=2,
            rounds=2,
            system_tokens=32,
            history_tokens=48,
            answer_tokens=8,
            question_tokens=8,
        ),
        document=DocumentShape(document_tokens=96, questions=2, question_tokens=8, answer_tokens=6),
    ),
}


def build_model(size: ModelSize, seed: int, device: str = "cpu") -> LlamaModel:
    return LlamaModel.from_config(size.config(), seed=seed, device=device)


def unique_kv_bytes(workload: Workload, preset: Preset) -> int:
    """``W``: the KV of every full block of every session's final context."""
    lengths = workload.final_lengths(preset.generated).values()
    blocks = sum(length // preset.model.block_tokens for length in lengths)
    return blocks * preset.model.block_tokens * preset.model.kv_bytes_per_token()


def hbm_pools(workload: Workload, preset: Preset) -> list[tuple[str, int]]:
    """The HBM level's sizes for ``workload``: (what it keeps, retained pages) with none,
    the largest session's final context, and every session's (the whole working set)."""
    pages = [
        n // preset.model.block_tokens for n in workload.final_lengths(preset.generated).values()
    ]
    sessions = len(pages)
    return [
        ("none", 0),
        ("1 session", max(pages, default=0)),
        (f"all {sessions} sessions", sum(pages)),
    ]


def _lookahead(workload: Workload, preset: Preset, host_bytes: int) -> int:
    """Queued sessions whose KV fits the host tier (CachedAttention's ``C_mem / S_kv``)."""
    per_session = unique_kv_bytes(workload, preset) / max(workload.num_sessions, 1)
    return max(1, math.floor(host_bytes / per_session))


def _best_policy() -> str:
    return SCHEDULER_AWARE if SCHEDULER_AWARE in EVICTION_POLICIES else "lru"


def main_setup(workload: Workload, preset: Preset) -> TierSetup:
    """Host + ample SSD, scheduler-aware prefetch and eviction: the kvstore mode."""
    kv = unique_kv_bytes(workload, preset)
    # A load larger than the host arena fails whole (the engine recomputes): the host tier
    # holds at least two full contexts, as any deployment's would.
    context_bytes = preset.model.max_positions * preset.model.kv_bytes_per_token()
    host = max(int(preset.host_share * kv), 2 * context_bytes)
    return TierSetup(
        "host+SSD",
        host_bytes=host,
        ssd_bytes=max(4 * kv, 4 << 20),
        policy=_best_policy(),
        lookahead=_lookahead(workload, preset, host),
        hint_ttl_s=preset.hint_ttl_s,
    )


def tier_setups(workload: Workload, preset: Preset, *, redis: bool) -> list[TierSetup]:
    """The sweep beside the main setup: host only, host + constrained SSD under LRU and
    scheduler-aware, and the same plus Redis (when ``redis``)."""
    main = main_setup(workload, preset)
    kv, host = unique_kv_bytes(workload, preset), main.host_bytes
    small_ssd = max(int(preset.ssd_share * kv), 4 << 20)
    small = f"host+SSD/{1 / preset.ssd_share:g}"  # "host+SSD/4": a quarter of W
    setups = [
        TierSetup("host only", host_bytes=host),
        TierSetup(small, host_bytes=host, ssd_bytes=small_ssd),
    ]
    if main.policy != "lru":
        setups.append(
            TierSetup(
                small,
                host_bytes=host,
                ssd_bytes=small_ssd,
                policy=main.policy,
                lookahead=main.lookahead,
                hint_ttl_s=preset.hint_ttl_s,
            )
        )
    if redis:
        setups.append(
            TierSetup(
                f"{small}+Redis",
                host_bytes=host,
                ssd_bytes=small_ssd,
                redis_bytes=max(4 * kv, 4 << 20),
            )
        )
    return setups


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One run of the hit-rate-by-tier grid: a host tier of ``host_fraction`` of ``W``, a
    tier stack (``host``, ``+SSD``, ``+Redis``) and its policy, in ``setup``."""

    host_fraction: float  # as asked; the setup's host tier may be raised to one prompt's KV
    stack: str
    setup: TierSetup


def grid_setups(workload: Workload, preset: Preset, *, redis: bool) -> list[GridPoint]:
    """The CachedAttention table as runs: for every host fraction of ``W``, host only, host +
    an SSD of ``ssd_share * W``, and the same + Redis of ``4 * W`` (when ``redis``), each
    under LRU and the scheduler-aware policy (where this build has it)."""
    kv = unique_kv_bytes(workload, preset)
    policies = ["lru"] if _best_policy() == "lru" else ["lru", SCHEDULER_AWARE]
    small_ssd = max(int(preset.ssd_share * kv), 1)
    stacks: dict[str, tuple[int | None, int | None]] = {"host": (None, None)}
    stacks["+SSD"] = (small_ssd, None)
    if redis:
        stacks["+Redis"] = (small_ssd, max(4 * kv, 4 << 20))
    points = []
    for fraction in preset.host_fractions:
        host = max(int(fraction * kv), longest_prompt_bytes(workload, preset))
        for stack, (ssd, redis_bytes) in stacks.items():
            for policy in policies:
                hinted = policy != "lru"
                setup = TierSetup(
                    f"host {fraction:.0%} of W{'' if stack == 'host' else ' ' + stack}",
                    host_bytes=host,
                    ssd_bytes=ssd,
                    redis_bytes=redis_bytes,
                    policy=policy,
                    lookahead=_lookahead(workload, preset, host) if hinted else 0,
                    hint_ttl_s=preset.hint_ttl_s,
                )
                points.append(GridPoint(fraction, stack, setup))
    return points


def longest_prompt_bytes(workload: Workload, preset: Preset) -> int:
    """The KV of the workload's longest prompt (history + message): a host tier smaller
    than that fails the load whole, so the grid's host tiers hold at least this."""
    context: dict[str, int] = {}
    longest = 0
    for turn in workload.turns:
        prompt = context.get(turn.session_id, 0) + len(turn.message)
        longest = max(longest, prompt)
        context[turn.session_id] = prompt + preset.generated + len(turn.tail)
    return longest * preset.model.kv_bytes_per_token()
