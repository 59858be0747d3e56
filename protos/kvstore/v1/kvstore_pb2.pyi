from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WriteStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WRITE_STATUS_UNSPECIFIED: _ClassVar[WriteStatus]
    RESERVED: _ClassVar[WriteStatus]
    DEDUP: _ClassVar[WriteStatus]
    NO_SPACE: _ClassVar[WriteStatus]
    STORED: _ClassVar[WriteStatus]
    EXPIRED: _ClassVar[WriteStatus]
    CHECKSUM_MISMATCH: _ClassVar[WriteStatus]
WRITE_STATUS_UNSPECIFIED: WriteStatus
RESERVED: WriteStatus
DEDUP: WriteStatus
NO_SPACE: WriteStatus
STORED: WriteStatus
EXPIRED: WriteStatus
CHECKSUM_MISMATCH: WriteStatus

class Layout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "block_tokens", "head_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., block_tokens: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class RopeScaling(_message.Message):
    __slots__ = ("name", "number", "text")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    name: str
    number: float
    text: str
    def __init__(self, name: _Optional[str] = ..., number: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class ModelFingerprint(_message.Message):
    __slots__ = ("model_name", "layout", "rope_theta", "rope_scaling")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    ROPE_SCALING_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    layout: Layout
    rope_theta: float
    rope_scaling: _containers.RepeatedCompositeFieldContainer[RopeScaling]
    def __init__(self, model_name: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., rope_theta: _Optional[float] = ..., rope_scaling: _Optional[_Iterable[_Union[RopeScaling, _Mapping]]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("server_version", "max_message_bytes", "chunk_bytes", "lease_seconds", "shm_socket", "instance_id", "max_block_bytes")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    max_message_bytes: int
    chunk_bytes: int
    lease_seconds: float
    shm_socket: str
    instance_id: bytes
    max_block_bytes: int
    def __init__(self, server_version: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., shm_socket: _Optional[str] = ..., instance_id: _Optional[bytes] = ..., max_block_bytes: _Optional[int] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("model", "tenant")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    model: ModelFingerprint
    tenant: str
    def __init__(self, model: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., tenant: _Optional[str] = ...) -> None: ...

class RegisterNamespaceResponse(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    def __init__(self, namespace: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys", "lease_id", "lease_seconds")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_id: int
    lease_seconds: float
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_id: _Optional[int] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_blocks", "tiers", "runs", "lease")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    runs: _containers.RepeatedCompositeFieldContainer[TierRun]
    lease: AcquireResponse
    def __init__(self, num_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., runs: _Optional[_Iterable[_Union[TierRun, _Mapping]]] = ..., lease: _Optional[_Union[AcquireResponse, _Mapping]] = ...) -> None: ...

class TierRun(_message.Message):
    __slots__ = ("tier", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    blocks: int
    def __init__(self, tier: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("namespace", "keys", "lease_seconds", "lease_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_seconds: float
    lease_id: int
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_seconds: _Optional[float] = ..., lease_id: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "slots", "expires_in", "arena_id", "checksums")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    expires_in: float
    arena_id: bytes
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., expires_in: _Optional[float] = ..., arena_id: _Optional[bytes] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockSpec(_message.Message):
    __slots__ = ("key", "parent", "num_tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent: bytes
    num_tokens: int
    def __init__(self, key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace", "blocks", "session")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[BlockSpec]
    session: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[BlockSpec, _Mapping]]] = ..., session: _Optional[bytes] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("status", "slot")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    status: WriteStatus
    slot: Slot
    def __init__(self, status: _Optional[_Union[WriteStatus, str]] = ..., slot: _Optional[_Union[Slot, _Mapping]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservations", "expires_in")
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_FIELD_NUMBER: _ClassVar[int]
    reservations: _containers.RepeatedCompositeFieldContainer[Reservation]
    expires_in: float
    def __init__(self, reservations: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ..., expires_in: _Optional[float] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("namespace", "keys", "session", "checksums")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    session: bytes
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., session: _Optional[bytes] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[WriteStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[WriteStatus, str]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("namespace", "keys", "session")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    session: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., session: _Optional[bytes] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("index", "data", "last", "tier", "checksum")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    last: bool
    tier: str
    checksum: int
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., tier: _Optional[str] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("namespace", "block", "data", "checksum")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block: BlockSpec
    data: bytes
    checksum: int
    def __init__(self, namespace: _Optional[bytes] = ..., block: _Optional[_Union[BlockSpec, _Mapping]] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[WriteStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[WriteStatus, str]]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session_id", "namespace", "chains")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace: bytes
    chains: _containers.RepeatedCompositeFieldContainer[KeyChain]
    def __init__(self, session_id: _Optional[str] = ..., namespace: _Optional[bytes] = ..., chains: _Optional[_Iterable[_Union[KeyChain, _Mapping]]] = ...) -> None: ...

class KeyChain(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "usage_bytes", "capacity_bytes", "blocks", "hits", "evictions", "healthy", "read_bytes", "written_bytes", "failed_writes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    USAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILED_WRITES_FIELD_NUMBER: _ClassVar[int]
    name: str
    usage_bytes: int
    capacity_bytes: int
    blocks: int
    hits: int
    evictions: int
    healthy: bool
    read_bytes: int
    written_bytes: int
    failed_writes: int
    def __init__(self, name: _Optional[str] = ..., usage_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., healthy: _Optional[bool] = ..., read_bytes: _Optional[int] = ..., written_bytes: _Optional[int] = ..., failed_writes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "blocks", "puts", "dedup_puts", "gets", "misses", "promotions", "demotions", "dropped_saves", "corrupt_blocks", "active_leases", "active_reservations", "lookups", "lookup_hit_blocks", "corrupt_writes", "expired_leases", "expired_reservations", "uptime_seconds", "version")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    DEDUP_PUTS_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SAVES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_WRITES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    blocks: int
    puts: int
    dedup_puts: int
    gets: int
    misses: int
    promotions: int
    demotions: int
    dropped_saves: int
    corrupt_blocks: int
    active_leases: int
    active_reservations: int
    lookups: int
    lookup_hit_blocks: int
    corrupt_writes: int
    expired_leases: int
    expired_reservations: int
    uptime_seconds: float
    version: str
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., blocks: _Optional[int] = ..., puts: _Optional[int] = ..., dedup_puts: _Optional[int] = ..., gets: _Optional[int] = ..., misses: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., dropped_saves: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ..., active_leases: _Optional[int] = ..., active_reservations: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_hit_blocks: _Optional[int] = ..., corrupt_writes: _Optional[int] = ..., expired_leases: _Optional[int] = ..., expired_reservations: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., version: _Optional[str] = ...) -> None: ...

class NamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("name", "blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    blocks: int
    def __init__(self, name: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class NamespaceUsage(_message.Message):
    __slots__ = ("namespace", "tenant", "model_name", "blocks", "bytes", "tiers")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    tenant: str
    model_name: str
    blocks: int
    bytes: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    def __init__(self, namespace: _Optional[bytes] = ..., tenant: _Optional[str] = ..., model_name: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ...) -> None: ...

class NamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceUsage]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceUsage, _Mapping]]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("namespace", "tenant")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    tenant: str
    def __init__(self, namespace: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("namespaces", "blocks")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespaces: int
    blocks: int
    def __init__(self, namespaces: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...
