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
    errors.Unauthenticated: (grpc.StatusCode.UNAUTHENTICATED, 401),
    errors.Overloaded: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    errors.DeadlineExceeded: (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    errors.Cancelled: (grpc.StatusCode.CANCELLED, 499),
    errors.InternalError: (grpc.StatusCode.INTERNAL, 500),
}

# Several errors share a code; the exact one travels as trailing metadata under this key.
ERROR_KEY = "pdmesh-error"
_ERRORS_BY_NAME = {err.__name__: err for err in STATUS_TABLE}
# A bare code stands for the first error of that code, except INTERNAL: only a worker's own handler says
# InternalError (named in the metadata); INTERNAL or UNKNOWN from the transport (a connection torn down
# mid-call) is a failed worker, which another worker may not repeat.
_CODE_TO_ERROR = {code: err for err, (code, _) in reversed(list(STATUS_TABLE.items())) if err is not errors.InternalError}


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


def error_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata naming the domain error, for error_from_grpc on the other side."""
    return ((ERROR_KEY, type(exc).__name__),) if type(exc).__name__ in _ERRORS_BY_NAME else ()


def error_from_grpc(code: grpc.StatusCode, details: str, metadata=None) -> errors.PDMeshError:
    """Turns a peer's status back into the domain error it stood for."""
    names = [value for key, value in (metadata or ()) if key == ERROR_KEY]
    return error_named(code, details, names[0] if names else "")


def error_named(code: grpc.StatusCode, details: str, name: str = "") -> errors.PDMeshError:
    """The domain error `name` names (error_metadata's value), else the one a bare `code` stands for."""
    err_type = _ERRORS_BY_NAME.get(name)
    return (err_type or _CODE_TO_ERROR.get(code, errors.WorkerFailed))(details)


def status_code_of(value: int) -> grpc.StatusCode:
    """The status code of its number (as a message carries it); UNKNOWN for one gRPC has not."""
    return _CODES_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def error_from_rpc_error(exc: grpc.RpcError) -> errors.PDMeshError:
    return error_from_grpc(exc.code(), exc.details() or str(exc), exc.trailing_metadata())
