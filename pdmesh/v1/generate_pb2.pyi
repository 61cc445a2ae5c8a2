from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "sampling", "cache_salt", "slo")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    slo: Slo
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ...) -> None: ...

class Slo(_message.Message):
    __slots__ = ("ttft_s", "tpot_s")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    tpot_s: float
    def __init__(self, ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "transfer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    transfer: TransferStats
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., transfer: _Optional[_Union[TransferStats, _Mapping]] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("num_blocks", "num_bytes", "seconds", "num_cached_tokens", "prefill_worker", "decode_worker", "first_block_seconds", "prefill_computed_tokens", "prefill_cached_tokens", "prefill_store_tokens", "num_failovers", "resumed_at_token", "local_prefill", "layerwise", "seconds_before_prefill_done", "seconds_after_prefill_done", "overlap_ratio", "prefill_seconds", "handoff_seconds", "num_moves")
    class PrefillStoreTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_AT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_BEFORE_PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_AFTER_PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_RATIO_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_MOVES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    seconds: float
    num_cached_tokens: int
    prefill_worker: str
    decode_worker: str
    first_block_seconds: float
    prefill_computed_tokens: int
    prefill_cached_tokens: int
    prefill_store_tokens: _containers.ScalarMap[str, int]
    num_failovers: int
    resumed_at_token: int
    local_prefill: bool
    layerwise: bool
    seconds_before_prefill_done: float
    seconds_after_prefill_done: float
    overlap_ratio: float
    prefill_seconds: float
    handoff_seconds: float
    num_moves: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., first_block_seconds: _Optional[float] = ..., prefill_computed_tokens: _Optional[int] = ..., prefill_cached_tokens: _Optional[int] = ..., prefill_store_tokens: _Optional[_Mapping[str, int]] = ..., num_failovers: _Optional[int] = ..., resumed_at_token: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., layerwise: _Optional[bool] = ..., seconds_before_prefill_done: _Optional[float] = ..., seconds_after_prefill_done: _Optional[float] = ..., overlap_ratio: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., handoff_seconds: _Optional[float] = ..., num_moves: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "max_model_len")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...
