from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class CompatInfo(_message.Message):
    __slots__ = ("model_fingerprint", "dtype", "block_size", "layout", "num_layers", "block_nbytes", "tp_size", "num_kv_heads", "heads_outer")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEADS_OUTER_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    dtype: str
    block_size: int
    layout: str
    num_layers: int
    block_nbytes: int
    tp_size: int
    num_kv_heads: int
    heads_outer: bool
    def __init__(self, model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., layout: _Optional[str] = ..., num_layers: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., tp_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., heads_outer: _Optional[bool] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("transfer_id", "kv_address", "block_ids", "num_tokens", "compat", "tp_size", "layerwise")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    kv_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    compat: CompatInfo
    tp_size: int
    layerwise: bool
    def __init__(self, transfer_id: _Optional[str] = ..., kv_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., compat: _Optional[_Union[CompatInfo, _Mapping]] = ..., tp_size: _Optional[int] = ..., layerwise: _Optional[bool] = ...) -> None: ...
