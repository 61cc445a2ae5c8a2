from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpillKVRequest(_message.Message):
    __slots__ = ("tier",)
    TIER_FIELD_NUMBER: _ClassVar[int]
    tier: str
    def __init__(self, tier: _Optional[str] = ...) -> None: ...

class SpillKVResponse(_message.Message):
    __slots__ = ("num_blocks_moved",)
    NUM_BLOCKS_MOVED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_moved: int
    def __init__(self, num_blocks_moved: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("kv_blocks_received", "kv_bytes_received", "kv_failed_blocks", "kv_blocks_sent", "kv_bytes_sent", "num_held_transfers", "num_expired_transfers", "kv_store_blocks", "kv_store_occupancy_bytes", "kv_store_hit_blocks", "kv_store_corrupt_blocks", "kv_store_blocks_saved", "kv_store_blocks_loaded", "kv_store_failed_blocks", "kv_store_pinned_blocks", "kv_store_dropped_blocks", "kv_store_index_errors", "num_running_requests", "num_waiting_requests", "kv_cache_usage", "num_kv_blocks", "kv_store_saves_skipped", "kv_store_blocks_skipped", "kv_store_loads_cut", "kv_store_saves_pending", "kv_store_corrupt_blocks_by_tier", "engine_quiet_steps", "engine_worker_steps", "kv_store_index_dropped_events", "prefill_tokens_per_s", "decode_step_s")
    class KvStoreOccupancyBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvStoreHitBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvStoreCorruptBlocksByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    KV_BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_FAILED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_OCCUPANCY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_BLOCKS_SAVED_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_BLOCKS_LOADED_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_FAILED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_INDEX_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_SAVES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_BLOCKS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOADS_CUT_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_SAVES_PENDING_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_CORRUPT_BLOCKS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_QUIET_STEPS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_WORKER_STEPS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_INDEX_DROPPED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    kv_blocks_received: int
    kv_bytes_received: int
    kv_failed_blocks: int
    kv_blocks_sent: int
    kv_bytes_sent: int
    num_held_transfers: int
    num_expired_transfers: int
    kv_store_blocks: int
    kv_store_occupancy_bytes: _containers.ScalarMap[str, int]
    kv_store_hit_blocks: _containers.ScalarMap[str, int]
    kv_store_corrupt_blocks: int
    kv_store_blocks_saved: int
    kv_store_blocks_loaded: int
    kv_store_failed_blocks: int
    kv_store_pinned_blocks: int
    kv_store_dropped_blocks: int
    kv_store_index_errors: int
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    num_kv_blocks: int
    kv_store_saves_skipped: int
    kv_store_blocks_skipped: int
    kv_store_loads_cut: int
    kv_store_saves_pending: int
    kv_store_corrupt_blocks_by_tier: _containers.ScalarMap[str, int]
    engine_quiet_steps: int
    engine_worker_steps: int
    kv_store_index_dropped_events: int
    prefill_tokens_per_s: float
    decode_step_s: float
    def __init__(self, kv_blocks_received: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_failed_blocks: _Optional[int] = ..., kv_blocks_sent: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., num_held_transfers: _Optional[int] = ..., num_expired_transfers: _Optional[int] = ..., kv_store_blocks: _Optional[int] = ..., kv_store_occupancy_bytes: _Optional[_Mapping[str, int]] = ..., kv_store_hit_blocks: _Optional[_Mapping[str, int]] = ..., kv_store_corrupt_blocks: _Optional[int] = ..., kv_store_blocks_saved: _Optional[int] = ..., kv_store_blocks_loaded: _Optional[int] = ..., kv_store_failed_blocks: _Optional[int] = ..., kv_store_pinned_blocks: _Optional[int] = ..., kv_store_dropped_blocks: _Optional[int] = ..., kv_store_index_errors: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_kv_blocks: _Optional[int] = ..., kv_store_saves_skipped: _Optional[int] = ..., kv_store_blocks_skipped: _Optional[int] = ..., kv_store_loads_cut: _Optional[int] = ..., kv_store_saves_pending: _Optional[int] = ..., kv_store_corrupt_blocks_by_tier: _Optional[_Mapping[str, int]] = ..., engine_quiet_steps: _Optional[int] = ..., engine_worker_steps: _Optional[int] = ..., kv_store_index_dropped_events: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ...) -> None: ...

class WorkerRecord(_message.Message):
    __slots__ = ("role", "address", "kv_address", "model", "model_fingerprint", "max_num_seqs", "num_kv_blocks", "num_running", "num_waiting", "kv_cache_usage", "started_at", "updated_at", "prefill_tokens_per_s", "decode_step_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    kv_address: str
    model: str
    model_fingerprint: str
    max_num_seqs: int
    num_kv_blocks: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    started_at: float
    updated_at: float
    prefill_tokens_per_s: float
    decode_step_s: float
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., kv_address: _Optional[str] = ..., model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., started_at: _Optional[float] = ..., updated_at: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfoResponse(_message.Message):
    __slots__ = ("role", "model", "max_model_len", "compat", "kv_address", "vocab_size")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    max_model_len: int
    compat: _common_pb2.CompatInfo
    kv_address: str
    vocab_size: int
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., compat: _Optional[_Union[_common_pb2.CompatInfo, _Mapping]] = ..., kv_address: _Optional[str] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "layerwise_transfer_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    layerwise_transfer_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., layerwise_transfer_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "kv", "num_computed_tokens", "num_cached_tokens", "first_token_id", "first_text", "finish_reason", "kv_store_tokens", "prefill_tokens_per_s")
    class KvStoreTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv: _common_pb2.KVHandle
    num_computed_tokens: int
    num_cached_tokens: int
    first_token_id: int
    first_text: str
    finish_reason: _common_pb2.FinishReason
    kv_store_tokens: _containers.ScalarMap[str, int]
    prefill_tokens_per_s: float
    def __init__(self, request_id: _Optional[str] = ..., kv: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., num_computed_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., first_token_id: _Optional[int] = ..., first_text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., kv_store_tokens: _Optional[_Mapping[str, int]] = ..., prefill_tokens_per_s: _Optional[float] = ...) -> None: ...

class DecodeStreamsRequest(_message.Message):
    __slots__ = ("stream_id", "open", "cancel", "timeout_s", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    open: DecodeRequest
    cancel: bool
    timeout_s: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, stream_id: _Optional[int] = ..., open: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DecodeStreamsResponse(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[StreamChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[StreamChunk, _Mapping]]] = ...) -> None: ...

class StreamChunk(_message.Message):
    __slots__ = ("stream_id", "response", "error", "end")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    response: DecodeResponse
    error: StreamError
    end: bool
    def __init__(self, stream_id: _Optional[int] = ..., response: _Optional[_Union[DecodeResponse, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ..., end: _Optional[bool] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message", "error")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    error: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    kv: _common_pb2.KVHandle
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "num_cached_tokens", "kv_blocks_received", "kv_bytes_received", "kv_seconds", "kv_first_block_seconds", "kv_seconds_before_prefill_done", "kv_seconds_after_prefill_done", "kv_overlap_ratio", "kv_layerwise", "prefill_tokens_per_s", "decode_step_s")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_FIRST_BLOCK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_SECONDS_BEFORE_PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    KV_SECONDS_AFTER_PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    KV_OVERLAP_RATIO_FIELD_NUMBER: _ClassVar[int]
    KV_LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    num_cached_tokens: int
    kv_blocks_received: int
    kv_bytes_received: int
    kv_seconds: float
    kv_first_block_seconds: float
    kv_seconds_before_prefill_done: float
    kv_seconds_after_prefill_done: float
    kv_overlap_ratio: float
    kv_layerwise: bool
    prefill_tokens_per_s: float
    decode_step_s: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., kv_blocks_received: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_seconds: _Optional[float] = ..., kv_first_block_seconds: _Optional[float] = ..., kv_seconds_before_prefill_done: _Optional[float] = ..., kv_seconds_after_prefill_done: _Optional[float] = ..., kv_overlap_ratio: _Optional[float] = ..., kv_layerwise: _Optional[bool] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ...) -> None: ...
