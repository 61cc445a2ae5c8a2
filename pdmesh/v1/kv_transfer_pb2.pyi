from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchRequest(_message.Message):
    __slots__ = ("transfer_id", "compat", "seen_version", "wait_ms", "block_indexes", "transport")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    SEEN_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEXES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    compat: _common_pb2.CompatInfo
    seen_version: int
    wait_ms: int
    block_indexes: _containers.RepeatedScalarFieldContainer[int]
    transport: str
    def __init__(self, transfer_id: _Optional[str] = ..., compat: _Optional[_Union[_common_pb2.CompatInfo, _Mapping]] = ..., seen_version: _Optional[int] = ..., wait_ms: _Optional[int] = ..., block_indexes: _Optional[_Iterable[int]] = ..., transport: _Optional[str] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("version", "started", "block_ids", "num_ready_tokens", "num_partial_tokens", "num_partial_layers", "held", "restarts", "checksums", "block_hashes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_READY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTIAL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    version: int
    started: bool
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_ready_tokens: int
    num_partial_tokens: int
    num_partial_layers: int
    held: bool
    restarts: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, version: _Optional[int] = ..., started: _Optional[bool] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_ready_tokens: _Optional[int] = ..., num_partial_tokens: _Optional[int] = ..., num_partial_layers: _Optional[int] = ..., held: _Optional[bool] = ..., restarts: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("transfer_id", "block_indexes", "compat", "first_layer", "end_layer")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEXES_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    block_indexes: _containers.RepeatedScalarFieldContainer[int]
    compat: _common_pb2.CompatInfo
    first_layer: int
    end_layer: int
    def __init__(self, transfer_id: _Optional[str] = ..., block_indexes: _Optional[_Iterable[int]] = ..., compat: _Optional[_Union[_common_pb2.CompatInfo, _Mapping]] = ..., first_layer: _Optional[int] = ..., end_layer: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("block_index", "offset", "data", "block_nbytes", "last", "checksum", "block_hash", "run_block_indexes", "run_checksums", "run_block_hashes")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    RUN_BLOCK_INDEXES_FIELD_NUMBER: _ClassVar[int]
    RUN_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    RUN_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    offset: int
    data: bytes
    block_nbytes: int
    last: bool
    checksum: int
    block_hash: bytes
    run_block_indexes: _containers.RepeatedScalarFieldContainer[int]
    run_checksums: _containers.RepeatedScalarFieldContainer[int]
    run_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., block_nbytes: _Optional[int] = ..., last: _Optional[bool] = ..., checksum: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., run_block_indexes: _Optional[_Iterable[int]] = ..., run_checksums: _Optional[_Iterable[int]] = ..., run_block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class LayerRegion(_message.Message):
    __slots__ = ("base", "nbytes", "block_stride", "part_stride", "num_parts", "part_nbytes", "shm_path")
    BASE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    PART_STRIDE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    PART_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    base: int
    nbytes: int
    block_stride: int
    part_stride: int
    num_parts: int
    part_nbytes: int
    shm_path: str
    def __init__(self, base: _Optional[int] = ..., nbytes: _Optional[int] = ..., block_stride: _Optional[int] = ..., part_stride: _Optional[int] = ..., num_parts: _Optional[int] = ..., part_nbytes: _Optional[int] = ..., shm_path: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("compat", "transports", "host_id", "store")
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    compat: _common_pb2.CompatInfo
    transports: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    store: bool
    def __init__(self, compat: _Optional[_Union[_common_pb2.CompatInfo, _Mapping]] = ..., transports: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., store: _Optional[bool] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("transport", "regions", "mooncake_session")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_SESSION_FIELD_NUMBER: _ClassVar[int]
    transport: str
    regions: _containers.RepeatedCompositeFieldContainer[LayerRegion]
    mooncake_session: str
    def __init__(self, transport: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[LayerRegion, _Mapping]]] = ..., mooncake_session: _Optional[str] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("transfer_id", "block_indexes", "compat", "transport")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEXES_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    block_indexes: _containers.RepeatedScalarFieldContainer[int]
    compat: _common_pb2.CompatInfo
    transport: str
    def __init__(self, transfer_id: _Optional[str] = ..., block_indexes: _Optional[_Iterable[int]] = ..., compat: _Optional[_Union[_common_pb2.CompatInfo, _Mapping]] = ..., transport: _Optional[str] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("block_ids", "checksums", "block_hashes")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...
