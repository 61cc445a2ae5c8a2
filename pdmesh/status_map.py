"""The one table from domain errors to gRPC status codes and HTTP codes."""

from __future__ import annotations

import grpc

from pdmesh import errors

STATUS_TABLE: dict[type[errors.PDMeshError], tuple[grpc.StatusCode, int]] = {
    errors.InvalidRequest: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    errors.ModelNotFound: (grpc.StatusCode.NOT_FOUND, 404),
    errors.Incompatible: (grpc.StatusCode.FAILED_PRECONDITION, 409),
    errors.TransferNotFound: (grpc.StatusCode.NOT_FOUND, 404),
    errors.ChecksumMismatch: (grpc.StatusCode.DATA_LOSS, 502),
    errors.BlockHashMismatch: (grpc.StatusCode.DATA_LOSS, 502),
    errors.NoWorkerAvailable: (grpc.StatusCode.UNAVAILABLE, 503),
    errors.WorkerFailed: (grpc.StatusCode.UNAVAILABLE, 503),
}

_CODE_TO_ERROR = {code: err for err, (code, _) in STATUS_TABLE.items()
                  if err not in (errors.TransferNotFound, errors.BlockHashMismatch, errors.WorkerFailed)}


def grpc_status_of(exc: BaseException) -> grpc.StatusCode:
    for err_type, (code, _) in STATUS_TABLE.items():
        if isinstance(exc, err_type):
            return code
    return grpc.StatusCode.INTERNAL


def http_status_of(exc: BaseException) -> int:
    for err_type, (_, http_code) in STATUS_TABLE.items():
        if isinstance(exc, err_type):
            return http_code
    return 500


def error_from_grpc(code: grpc.StatusCode, details: str) -> errors.PDMeshError:
    """Turns a peer's status back into the domain error it stood for."""
    return _CODE_TO_ERROR.get(code, errors.WorkerFailed)(details)
