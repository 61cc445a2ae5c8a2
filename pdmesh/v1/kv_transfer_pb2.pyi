from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PullRequest(_message.Message):
    __slots__ = ("transfer_id", "block_indexes", "compat")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEXES_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    block_indexes: _containers.RepeatedScalarFieldContainer[int]
    compat: _common_pb2.CompatInfo
    def __init__(self, transfer_id: _Optional[str] = ..., block_indexes: _Optional[_Iterable[int]] = ..., compat: _Optional[_Union[_common_pb2.CompatInfo, _Mapping]] = ...) -> None: ...

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
