from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("compat", "token_ids", "extra_key", "include_remote", "block_hashes")
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_REMOTE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    compat: _common_pb2.CompatInfo
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_key: bytes
    include_remote: bool
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, compat: _Optional[_Union[_common_pb2.CompatInfo, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., extra_key: _Optional[bytes] = ..., include_remote: _Optional[bool] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BlockSource(_message.Message):
    __slots__ = ("node", "tier")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    node: str
    tier: str
    def __init__(self, node: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockSource]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockSource, _Mapping]]] = ...) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "token_ids")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("compat", "blocks")
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    compat: _common_pb2.CompatInfo
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    def __init__(self, compat: _Optional[_Union[_common_pb2.CompatInfo, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ...) -> None: ...

class ExportResponse(_message.Message):
    __slots__ = ("transfer_id", "num_blocks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    num_blocks: int
    def __init__(self, transfer_id: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...
