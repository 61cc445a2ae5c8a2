import grpc
import pytest

from pdmesh import errors
from pdmesh.status_map import STATUS_TABLE, error_from_grpc, error_metadata, grpc_status_of, http_status_of


@pytest.mark.parametrize("err_type", list(STATUS_TABLE))
def test_every_domain_error_survives_a_hop(err_type):
    exc = err_type("why")
    back = error_from_grpc(grpc_status_of(exc), "why", error_metadata(exc))
    assert type(back) is err_type and str(back) == "why"


def test_codes_of_the_client_facing_errors():
    assert grpc_status_of(errors.InvalidRequest("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_status_of(errors.ModelNotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert grpc_status_of(errors.Incompatible("x")) == grpc.StatusCode.FAILED_PRECONDITION
    assert http_status_of(errors.InvalidRequest("x")) == 400
    assert http_status_of(errors.NoWorkerAvailable("x")) == 503
    assert grpc_status_of(KeyError("x")) == grpc.StatusCode.INTERNAL and http_status_of(KeyError()) == 500


def test_unknown_peer_status_becomes_worker_failed():
    assert type(error_from_grpc(grpc.StatusCode.UNKNOWN, "boom")) is errors.WorkerFailed
    # INTERNAL is an InternalError (not retried) only when the worker's handler named it
    assert type(error_from_grpc(grpc.StatusCode.INTERNAL, "RST_STREAM")) is errors.WorkerFailed
