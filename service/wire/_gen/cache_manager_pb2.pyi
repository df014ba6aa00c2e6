# Generated from proto/radixkv/v1/cache_manager.proto by `make proto` (proto/generate.py). Do not edit.
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionRef(_message.Message):
    __slots__ = ("session_id", "epoch", "lease_ttl_s", "secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    lease_ttl_s: float
    secret: bytes
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., secret: _Optional[bytes] = ...) -> None: ...

class ShmFile(_message.Message):
    __slots__ = ("path", "nbytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    nbytes: int
    def __init__(self, path: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_index", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "tensor_offset", "nbytes")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    nbytes: int
    def __init__(self, device_index: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., tensor_offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class PoolMapping(_message.Message):
    __slots__ = ("pool", "shm", "cuda_ipc")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    pool: str
    shm: ShmFile
    cuda_ipc: CudaIpcHandle
    def __init__(self, pool: _Optional[str] = ..., shm: _Optional[_Union[ShmFile, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("worker_name", "pid", "client_nonce")
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NONCE_FIELD_NUMBER: _ClassVar[int]
    worker_name: str
    pid: int
    client_nonce: bytes
    def __init__(self, worker_name: _Optional[str] = ..., pid: _Optional[int] = ..., client_nonce: _Optional[bytes] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("session", "layout_json", "mappings")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    MAPPINGS_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    layout_json: str
    mappings: _containers.RepeatedCompositeFieldContainer[PoolMapping]
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., layout_json: _Optional[str] = ..., mappings: _Optional[_Iterable[_Union[PoolMapping, _Mapping]]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_left_s",)
    LEASE_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    lease_left_s: float
    def __init__(self, lease_left_s: _Optional[float] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MatchQuery(_message.Message):
    __slots__ = ("token_ids_i32", "extra_key")
    TOKEN_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    token_ids_i32: bytes
    extra_key: str
    def __init__(self, token_ids_i32: _Optional[bytes] = ..., extra_key: _Optional[str] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("session", "queries")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    queries: _containers.RepeatedCompositeFieldContainer[MatchQuery]
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., queries: _Optional[_Iterable[_Union[MatchQuery, _Mapping]]] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("prefix_len_i64", "kv_prefix_len_i64", "host_len_i64", "storage_len_i64")
    PREFIX_LEN_I64_FIELD_NUMBER: _ClassVar[int]
    KV_PREFIX_LEN_I64_FIELD_NUMBER: _ClassVar[int]
    HOST_LEN_I64_FIELD_NUMBER: _ClassVar[int]
    STORAGE_LEN_I64_FIELD_NUMBER: _ClassVar[int]
    prefix_len_i64: bytes
    kv_prefix_len_i64: bytes
    host_len_i64: bytes
    storage_len_i64: bytes
    def __init__(self, prefix_len_i64: _Optional[bytes] = ..., kv_prefix_len_i64: _Optional[bytes] = ..., host_len_i64: _Optional[bytes] = ..., storage_len_i64: _Optional[bytes] = ...) -> None: ...

class AllocExtendRequest(_message.Message):
    __slots__ = ("session", "rids", "rid_lens_i32", "token_ids_i32", "token_lens_i32", "extra_keys", "extra_key_lens_i32", "priorities_i64")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RIDS_FIELD_NUMBER: _ClassVar[int]
    RID_LENS_I32_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LENS_I32_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_LENS_I32_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_I64_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    rids: str
    rid_lens_i32: bytes
    token_ids_i32: bytes
    token_lens_i32: bytes
    extra_keys: str
    extra_key_lens_i32: bytes
    priorities_i64: bytes
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., rids: _Optional[str] = ..., rid_lens_i32: _Optional[bytes] = ..., token_ids_i32: _Optional[bytes] = ..., token_lens_i32: _Optional[bytes] = ..., extra_keys: _Optional[str] = ..., extra_key_lens_i32: _Optional[bytes] = ..., priorities_i64: _Optional[bytes] = ...) -> None: ...

class AllocExtendResponse(_message.Message):
    __slots__ = ("req_pool_idx_i64", "prefix_len_i64", "start_i64", "seq_len_i64", "out_cache_loc_i64", "mamba_slot_i64", "reserved_i64", "reserved_lens_i64", "track_slot_i64", "track_seqlen_i64", "host_len_i64", "storage_len_i64")
    REQ_POOL_IDX_I64_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_I64_FIELD_NUMBER: _ClassVar[int]
    START_I64_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_I64_FIELD_NUMBER: _ClassVar[int]
    OUT_CACHE_LOC_I64_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SLOT_I64_FIELD_NUMBER: _ClassVar[int]
    RESERVED_I64_FIELD_NUMBER: _ClassVar[int]
    RESERVED_LENS_I64_FIELD_NUMBER: _ClassVar[int]
    TRACK_SLOT_I64_FIELD_NUMBER: _ClassVar[int]
    TRACK_SEQLEN_I64_FIELD_NUMBER: _ClassVar[int]
    HOST_LEN_I64_FIELD_NUMBER: _ClassVar[int]
    STORAGE_LEN_I64_FIELD_NUMBER: _ClassVar[int]
    req_pool_idx_i64: bytes
    prefix_len_i64: bytes
    start_i64: bytes
    seq_len_i64: bytes
    out_cache_loc_i64: bytes
    mamba_slot_i64: bytes
    reserved_i64: bytes
    reserved_lens_i64: bytes
    track_slot_i64: bytes
    track_seqlen_i64: bytes
    host_len_i64: bytes
    storage_len_i64: bytes
    def __init__(self, req_pool_idx_i64: _Optional[bytes] = ..., prefix_len_i64: _Optional[bytes] = ..., start_i64: _Optional[bytes] = ..., seq_len_i64: _Optional[bytes] = ..., out_cache_loc_i64: _Optional[bytes] = ..., mamba_slot_i64: _Optional[bytes] = ..., reserved_i64: _Optional[bytes] = ..., reserved_lens_i64: _Optional[bytes] = ..., track_slot_i64: _Optional[bytes] = ..., track_seqlen_i64: _Optional[bytes] = ..., host_len_i64: _Optional[bytes] = ..., storage_len_i64: _Optional[bytes] = ...) -> None: ...

class AllocDecodeRequest(_message.Message):
    __slots__ = ("session", "rids", "token_ids_i32")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RIDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    rids: _containers.RepeatedScalarFieldContainer[str]
    token_ids_i32: bytes
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., rids: _Optional[_Iterable[str]] = ..., token_ids_i32: _Optional[bytes] = ...) -> None: ...

class AllocDecodeResponse(_message.Message):
    __slots__ = ("out_cache_loc_i64", "seq_lens_i64", "req_pool_indices_i64", "mamba_slots_i64", "reserved_i64", "reserved_lens_i64", "track_slots_i64")
    OUT_CACHE_LOC_I64_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_I64_FIELD_NUMBER: _ClassVar[int]
    REQ_POOL_INDICES_I64_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SLOTS_I64_FIELD_NUMBER: _ClassVar[int]
    RESERVED_I64_FIELD_NUMBER: _ClassVar[int]
    RESERVED_LENS_I64_FIELD_NUMBER: _ClassVar[int]
    TRACK_SLOTS_I64_FIELD_NUMBER: _ClassVar[int]
    out_cache_loc_i64: bytes
    seq_lens_i64: bytes
    req_pool_indices_i64: bytes
    mamba_slots_i64: bytes
    reserved_i64: bytes
    reserved_lens_i64: bytes
    track_slots_i64: bytes
    def __init__(self, out_cache_loc_i64: _Optional[bytes] = ..., seq_lens_i64: _Optional[bytes] = ..., req_pool_indices_i64: _Optional[bytes] = ..., mamba_slots_i64: _Optional[bytes] = ..., reserved_i64: _Optional[bytes] = ..., reserved_lens_i64: _Optional[bytes] = ..., track_slots_i64: _Optional[bytes] = ...) -> None: ...

class ApplyDecodesRequest(_message.Message):
    __slots__ = ("session", "rids", "rid_lens_i32", "call_lens_i32", "rid_index_i32", "token_ids_i32")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RIDS_FIELD_NUMBER: _ClassVar[int]
    RID_LENS_I32_FIELD_NUMBER: _ClassVar[int]
    CALL_LENS_I32_FIELD_NUMBER: _ClassVar[int]
    RID_INDEX_I32_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    rids: str
    rid_lens_i32: bytes
    call_lens_i32: bytes
    rid_index_i32: bytes
    token_ids_i32: bytes
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., rids: _Optional[str] = ..., rid_lens_i32: _Optional[bytes] = ..., call_lens_i32: _Optional[bytes] = ..., rid_index_i32: _Optional[bytes] = ..., token_ids_i32: _Optional[bytes] = ...) -> None: ...

class ApplyDecodesResponse(_message.Message):
    __slots__ = ("applied", "error")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    applied: int
    error: StepError
    def __init__(self, applied: _Optional[int] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class CacheRequest(_message.Message):
    __slots__ = ("session", "rids")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RIDS_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    rids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., rids: _Optional[_Iterable[str]] = ...) -> None: ...

class CacheResponse(_message.Message):
    __slots__ = ("cached_len_i64",)
    CACHED_LEN_I64_FIELD_NUMBER: _ClassVar[int]
    cached_len_i64: bytes
    def __init__(self, cached_len_i64: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session", "rids")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RIDS_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    rids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., rids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("session", "num_tokens", "num_states")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STATES_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    num_tokens: int
    num_states: int
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., num_tokens: _Optional[int] = ..., num_states: _Optional[int] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("tokens", "states")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    states: int
    def __init__(self, tokens: _Optional[int] = ..., states: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("kv_capacity", "kv_available", "kv_evictable", "kv_protected", "kv_held", "state_capacity", "state_available", "state_evictable", "state_protected", "state_held", "rows_capacity", "rows_available", "sessions", "requests", "queries", "queried_tokens", "hit_tokens", "inserted_tokens", "evicted_tokens", "host_capacity", "host_available", "host_used", "tier_hit_device", "tier_hit_host", "tier_hit_storage", "host_loaded_pages", "host_loaded_bytes", "host_load_us", "host_demoted_pages", "host_dropped_pages", "storage_loaded_pages", "storage_loaded_bytes", "storage_load_us", "storage_written_pages", "storage_write_failed", "storage_backup_dropped", "storage_fetch_timeouts", "storage_errors", "storage_pending", "host_state_slots", "host_state_used", "host_state_hits", "host_state_hit_tokens", "host_state_loaded", "host_state_demoted", "host_state_dropped")
    KV_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KV_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    KV_EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    KV_PROTECTED_FIELD_NUMBER: _ClassVar[int]
    KV_HELD_FIELD_NUMBER: _ClassVar[int]
    STATE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    STATE_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    STATE_EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    STATE_PROTECTED_FIELD_NUMBER: _ClassVar[int]
    STATE_HELD_FIELD_NUMBER: _ClassVar[int]
    ROWS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ROWS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INSERTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HOST_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_DEVICE_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_HOST_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_STORAGE_FIELD_NUMBER: _ClassVar[int]
    HOST_LOADED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_LOAD_US_FIELD_NUMBER: _ClassVar[int]
    HOST_DEMOTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_DROPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_LOADED_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_LOAD_US_FIELD_NUMBER: _ClassVar[int]
    STORAGE_WRITTEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_WRITE_FAILED_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BACKUP_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FETCH_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PENDING_FIELD_NUMBER: _ClassVar[int]
    HOST_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_STATE_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_STATE_HITS_FIELD_NUMBER: _ClassVar[int]
    HOST_STATE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_STATE_LOADED_FIELD_NUMBER: _ClassVar[int]
    HOST_STATE_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    HOST_STATE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    kv_capacity: int
    kv_available: int
    kv_evictable: int
    kv_protected: int
    kv_held: int
    state_capacity: int
    state_available: int
    state_evictable: int
    state_protected: int
    state_held: int
    rows_capacity: int
    rows_available: int
    sessions: int
    requests: int
    queries: int
    queried_tokens: int
    hit_tokens: int
    inserted_tokens: int
    evicted_tokens: int
    host_capacity: int
    host_available: int
    host_used: int
    tier_hit_device: int
    tier_hit_host: int
    tier_hit_storage: int
    host_loaded_pages: int
    host_loaded_bytes: int
    host_load_us: int
    host_demoted_pages: int
    host_dropped_pages: int
    storage_loaded_pages: int
    storage_loaded_bytes: int
    storage_load_us: int
    storage_written_pages: int
    storage_write_failed: int
    storage_backup_dropped: int
    storage_fetch_timeouts: int
    storage_errors: int
    storage_pending: int
    host_state_slots: int
    host_state_used: int
    host_state_hits: int
    host_state_hit_tokens: int
    host_state_loaded: int
    host_state_demoted: int
    host_state_dropped: int
    def __init__(self, kv_capacity: _Optional[int] = ..., kv_available: _Optional[int] = ..., kv_evictable: _Optional[int] = ..., kv_protected: _Optional[int] = ..., kv_held: _Optional[int] = ..., state_capacity: _Optional[int] = ..., state_available: _Optional[int] = ..., state_evictable: _Optional[int] = ..., state_protected: _Optional[int] = ..., state_held: _Optional[int] = ..., rows_capacity: _Optional[int] = ..., rows_available: _Optional[int] = ..., sessions: _Optional[int] = ..., requests: _Optional[int] = ..., queries: _Optional[int] = ..., queried_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., inserted_tokens: _Optional[int] = ..., evicted_tokens: _Optional[int] = ..., host_capacity: _Optional[int] = ..., host_available: _Optional[int] = ..., host_used: _Optional[int] = ..., tier_hit_device: _Optional[int] = ..., tier_hit_host: _Optional[int] = ..., tier_hit_storage: _Optional[int] = ..., host_loaded_pages: _Optional[int] = ..., host_loaded_bytes: _Optional[int] = ..., host_load_us: _Optional[int] = ..., host_demoted_pages: _Optional[int] = ..., host_dropped_pages: _Optional[int] = ..., storage_loaded_pages: _Optional[int] = ..., storage_loaded_bytes: _Optional[int] = ..., storage_load_us: _Optional[int] = ..., storage_written_pages: _Optional[int] = ..., storage_write_failed: _Optional[int] = ..., storage_backup_dropped: _Optional[int] = ..., storage_fetch_timeouts: _Optional[int] = ..., storage_errors: _Optional[int] = ..., storage_pending: _Optional[int] = ..., host_state_slots: _Optional[int] = ..., host_state_used: _Optional[int] = ..., host_state_hits: _Optional[int] = ..., host_state_hit_tokens: _Optional[int] = ..., host_state_loaded: _Optional[int] = ..., host_state_demoted: _Optional[int] = ..., host_state_dropped: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("flushed",)
    FLUSHED_FIELD_NUMBER: _ClassVar[int]
    flushed: bool
    def __init__(self, flushed: _Optional[bool] = ...) -> None: ...

class CheckInvariantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckInvariantsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes_u64", "parent_block_hash", "token_ids_i32", "block_size", "lora_id", "medium", "lora_name", "extra_key_json")
    BLOCK_HASHES_U64_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_I32_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_JSON_FIELD_NUMBER: _ClassVar[int]
    block_hashes_u64: bytes
    parent_block_hash: int
    token_ids_i32: bytes
    block_size: int
    lora_id: int
    medium: str
    lora_name: str
    extra_key_json: str
    def __init__(self, block_hashes_u64: _Optional[bytes] = ..., parent_block_hash: _Optional[int] = ..., token_ids_i32: _Optional[bytes] = ..., block_size: _Optional[int] = ..., lora_id: _Optional[int] = ..., medium: _Optional[str] = ..., lora_name: _Optional[str] = ..., extra_key_json: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes_u64", "medium")
    BLOCK_HASHES_U64_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes_u64: bytes
    medium: str
    def __init__(self, block_hashes_u64: _Optional[bytes] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StateStored(_message.Message):
    __slots__ = ("block_hash", "position", "medium")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    position: int
    medium: str
    def __init__(self, block_hash: _Optional[int] = ..., position: _Optional[int] = ..., medium: _Optional[str] = ...) -> None: ...

class StateRemoved(_message.Message):
    __slots__ = ("block_hashes_u64", "medium")
    BLOCK_HASHES_U64_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes_u64: bytes
    medium: str
    def __init__(self, block_hashes_u64: _Optional[bytes] = ..., medium: _Optional[str] = ...) -> None: ...

class EventsLost(_message.Message):
    __slots__ = ("first_seq", "count")
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    first_seq: int
    count: int
    def __init__(self, first_seq: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared", "state_stored", "state_removed", "events_lost", "seq")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    STATE_STORED_FIELD_NUMBER: _ClassVar[int]
    STATE_REMOVED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_LOST_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    state_stored: StateStored
    state_removed: StateRemoved
    events_lost: EventsLost
    seq: int
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ..., state_stored: _Optional[_Union[StateStored, _Mapping]] = ..., state_removed: _Optional[_Union[StateRemoved, _Mapping]] = ..., events_lost: _Optional[_Union[EventsLost, _Mapping]] = ..., seq: _Optional[int] = ...) -> None: ...

class TakeEventsRequest(_message.Message):
    __slots__ = ("session", "max_events")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    max_events: int
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., max_events: _Optional[int] = ...) -> None: ...

class TakeEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("session", "poll_interval_s", "start_seq", "from_now")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    POLL_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    START_SEQ_FIELD_NUMBER: _ClassVar[int]
    FROM_NOW_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    poll_interval_s: float
    start_seq: int
    from_now: bool
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., poll_interval_s: _Optional[float] = ..., start_seq: _Optional[int] = ..., from_now: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("method", "request", "request_id", "replay", "replay_request_id")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    REPLAY_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    method: str
    request: bytes
    request_id: str
    replay: bytes
    replay_request_id: str
    def __init__(self, method: _Optional[str] = ..., request: _Optional[bytes] = ..., request_id: _Optional[str] = ..., replay: _Optional[bytes] = ..., replay_request_id: _Optional[str] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "details", "trailing_keys", "trailing_values")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_KEYS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_VALUES_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailing_keys: _containers.RepeatedScalarFieldContainer[str]
    trailing_values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_keys: _Optional[_Iterable[str]] = ..., trailing_values: _Optional[_Iterable[str]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("reply", "error", "rides_replay", "replayed")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RIDES_REPLAY_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    reply: bytes
    error: StepError
    rides_replay: bool
    replayed: bool
    def __init__(self, reply: _Optional[bytes] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., rides_replay: _Optional[bool] = ..., replayed: _Optional[bool] = ...) -> None: ...

class StepHello(_message.Message):
    __slots__ = ("token", "version")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    token: str
    version: int
    def __init__(self, token: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...
