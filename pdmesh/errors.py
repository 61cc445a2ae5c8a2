"""Domain errors of pdmesh. Each maps to exactly one gRPC status and HTTP code (see status_map)."""


class PDMeshError(Exception):
    """Base of every error pdmesh reports to a caller."""


class InvalidRequest(PDMeshError):
    """The request itself is malformed (empty prompt, bad sampling params, too long)."""


class ModelNotFound(PDMeshError):
    """The request names a model no worker serves."""


class Incompatible(PDMeshError):
    """Producer and consumer disagree on model fingerprint, dtype, block size or layout."""


class TransferNotFound(PDMeshError):
    """A KV transfer id the producer does not hold (expired, released or never existed)."""


class ChecksumMismatch(PDMeshError):
    """A block's bytes do not match the checksum sent with them."""


class BlockHashMismatch(PDMeshError):
    """A block's content hash does not match the consumer's own tokens."""


class NoWorkerAvailable(PDMeshError):
    """No healthy worker of the needed role."""


class WorkerFailed(PDMeshError):
    """A worker failed while serving the request."""


class Unauthenticated(PDMeshError):
    """No API key, or one the gateway does not know."""


class Overloaded(PDMeshError):
    """The gateway is at its admission limit; retry later."""


class DeadlineExceeded(PDMeshError):
    """The request's deadline passed before it finished."""


class Cancelled(PDMeshError):
    """The client went away or cancelled the request."""


class InternalError(PDMeshError):
    """A worker failed on this request itself (a bug, or something its engine refused): another worker
    would fail the same way, so the gateway does not retry it."""
